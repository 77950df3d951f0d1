"""``GET /metrics``: Prometheus text from one registry per app (prometheus_client).

- ``embedpipe_requests_total{route,status}`` and ``embedpipe_request_seconds{route}``: every
  request, 401/413/429 included (the middleware sits outside all others). ``route`` is the
  app's route path, or ``other`` for paths the app does not have (bounded label values).
- ``embedpipe_queue_depth``: requests running or waiting for a worker.
- ``embedpipe_index_generation{set}``, ``embedpipe_index_rows{set}``: what is being served.
- ``embedpipe_reloads_total{set}``, ``embedpipe_reload_failures_total{set}``: hot swaps.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("embedpipe_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.latency = Histogram("embedpipe_request_seconds", "HTTP request latency",
                                 ["route"], buckets=BUCKETS, registry=r)
        self.queue_depth = Gauge("embedpipe_queue_depth",
                                 "requests running or waiting for a worker", registry=r)
        self.generation = Gauge("embedpipe_index_generation",
                                "set generation of the index being served", ["set"], registry=r)
        self.rows = Gauge("embedpipe_index_rows", "searchable rows of the index being served",
                          ["set"], registry=r)
        self.reloads = Counter("embedpipe_reloads", "new generations swapped in", ["set"],
                               registry=r)
        self.reload_failures = Counter("embedpipe_reload_failures",
                                       "reloads that failed (the old generation kept serving)",
                                       ["set"], registry=r)

    def text(self) -> bytes:
        return generate_latest(self.registry)


class RequestMetrics:
    """ASGI middleware counting every HTTP request by route and status, with its latency."""

    def __init__(self, app, metrics: ServerMetrics, routes: frozenset[str]) -> None:
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in self.routes else "other"
        status = 500  # what the client sees if the app dies before answering
        started = time.perf_counter()

        async def sending(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - started)
