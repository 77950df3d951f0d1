"""The query server: FastAPI over loaded Searchers, with bounded work and bounded input.

- Models and indexes load once, when the app is made (a bad OUT fails before serving).
- ``POST /search`` takes ``query`` or ``queries``, ``k`` and ``set``; every bound is checked
  by pydantic or the handler, so bad requests get 4xx with a reason, never a 500.
- Request bodies above ``max_body_bytes`` get 413 before they are parsed.
- At most ``workers`` searches run at once (in a thread pool); up to ``queue`` more wait. A
  request arriving when both are full gets 429 at once; one that waited longer than
  ``queue_timeout_s`` for a worker gets 503. Both carry ``Retry-After``. Memory stays flat
  under any load because nothing beyond ``workers + queue`` requests is ever held.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline.errors import EmbedpipeError
from pipeline.search import Hit, Searcher

MAX_K = 1000
MAX_QUERY_CHARS = 10_000
MAX_BATCH = 256


class ServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    out: str
    sets: tuple[str, ...] = ()  # empty: every indexed set under OUT
    device: str | None = None
    max_k: int = Field(default=100, gt=0, le=MAX_K)
    max_query_chars: int = Field(default=2_000, gt=0, le=MAX_QUERY_CHARS)
    max_batch: int = Field(default=32, gt=0, le=MAX_BATCH)
    max_body_bytes: int = Field(default=1_000_000, gt=0)
    workers: int = Field(default=2, gt=0)
    queue: int = Field(default=16, ge=0)
    queue_timeout_s: float = Field(default=5.0, gt=0)
    faiss_threads: int = Field(default=1, gt=0)
    trust_remote_code: bool = False  # the operator's --trust-remote-code, never _SET.json's


class SearchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    query: str | None = Field(default=None, min_length=1, max_length=MAX_QUERY_CHARS)
    queries: list[str] | None = Field(default=None, min_length=1, max_length=MAX_BATCH)
    k: int = Field(default=10, ge=1, le=MAX_K)
    set: str | None = Field(default=None, min_length=1, max_length=64)

    @model_validator(mode="after")
    def _one_of(self) -> SearchRequest:
        if (self.query is None) == (self.queries is None):
            raise ValueError("give exactly one of 'query' (a string) or 'queries' (a list)")
        texts = [self.query] if self.query is not None else self.queries
        for i, text in enumerate(texts):
            if not text.strip():
                raise ValueError(f"query {i} is empty or whitespace")
            if len(text) > MAX_QUERY_CHARS:
                raise ValueError(f"query {i} is longer than {MAX_QUERY_CHARS} characters")
        return self

    def texts(self) -> list[str]:
        return [self.query] if self.query is not None else list(self.queries)


class SearchResponse(BaseModel):
    set: str
    k: int
    results: list[list[Hit]]
    took_ms: float


class _Gate:
    """Admission control: ``workers`` running, ``queue`` waiting, everything else refused."""

    def __init__(self, workers: int, queue: int) -> None:
        self.limit = workers + queue
        self.pending = 0
        self.slots = asyncio.Semaphore(workers)


class _Busy(Exception):
    def __init__(self, status: int, reason: str) -> None:
        self.status, self.reason = status, reason


def _problem(status: int, reason: str, **headers: str) -> JSONResponse:
    return JSONResponse({"detail": reason}, status_code=status, headers=headers or None)


class _BodyLimit:
    """ASGI middleware: 413 for a body above ``limit`` bytes, declared or streamed.

    The body is read here (never more than ``limit`` bytes are held) and replayed to the app,
    so a chunked upload without Content-Length is bounded too.
    """

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and not declared.isdigit():
            return await _problem(400, "invalid Content-Length header")(scope, receive, send)
        if declared is not None and int(declared) > self.limit:
            return await self._too_large(scope, receive, send)
        chunks, seen = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            seen += len(message.get("body", b""))
            if seen > self.limit:
                return await self._too_large(scope, receive, send)
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send):
        reason = f"request body is larger than {self.limit:,} bytes"
        await _problem(413, reason)(scope, receive, send)


def create_app(config: ServerConfig) -> FastAPI:
    """The app, with every set's model and index loaded (fails here, not on the first query)."""
    import faiss

    from pipeline.index import list_sets, read_meta

    faiss.omp_set_num_threads(config.faiss_threads)  # parallelism comes from requests
    names = list(config.sets) or [s for s in list_sets(config.out)
                                  if read_meta(config.out, s) is not None]
    if not names:
        raise EmbedpipeError(f"no indexed sets under {config.out}; run `embedpipe index "
                             f"{config.out}` first")
    searchers = {n: Searcher(config.out, n, device=config.device,
                             trust_remote_code=config.trust_remote_code) for n in names}
    default = names[0]
    pool = ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="search")
    app = FastAPI(title="embedpipe search", version="1", description=__doc__.splitlines()[0])
    app.add_middleware(_BodyLimit, limit=config.max_body_bytes)
    state: dict = {}

    def gate() -> _Gate:  # made lazily: it belongs to the server's event loop
        if "gate" not in state:
            state["gate"] = _Gate(config.workers, config.queue)
        return state["gate"]

    @app.exception_handler(_Busy)
    async def busy(_: Request, exc: _Busy) -> JSONResponse:
        return _problem(exc.status, exc.reason, **{"Retry-After": "1"})

    @app.exception_handler(EmbedpipeError)
    async def embedpipe_error(_: Request, exc: EmbedpipeError) -> JSONResponse:
        return _problem(400, str(exc))

    @app.exception_handler(json.JSONDecodeError)
    async def bad_json(_: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return _problem(400, f"request body is not JSON: {exc}")

    @app.get("/health")
    def health() -> dict:
        return {
            "status": "ok",
            "default_set": default,
            "sets": {n: _describe(s) for n, s in searchers.items()},
            "limits": {"max_k": config.max_k, "max_query_chars": config.max_query_chars,
                       "max_batch": config.max_batch, "workers": config.workers,
                       "queue": config.queue},
        }

    @app.post("/search", response_model=SearchResponse,
              responses={413: {}, 429: {}, 503: {}, 404: {}, 422: {}})
    async def search(req: SearchRequest):
        texts = req.texts()
        problem = _check_limits(req, texts, config, searchers)
        if problem:
            return _problem(*problem)
        name = req.set or default
        started = time.perf_counter()
        hits = await _run_gated(gate(), config, pool, searchers[name].search, texts, req.k)
        took = round((time.perf_counter() - started) * 1000, 2)
        return SearchResponse(set=name, k=req.k, results=hits, took_ms=took)

    app.state.searchers = searchers
    app.state.pool = pool
    return app


def _describe(s: Searcher) -> dict:
    m = s.meta
    return {"kind": m.kind, "factory": m.factory, "rows": m.rows, "dim": m.dim,
            "metric": m.metric, "recall_at_10": m.recall_at_10, "params": m.params,
            "generation": m.generation, "model": s.set.model, "fingerprint": m.fingerprint}


def _check_limits(req: SearchRequest, texts: list[str], config: ServerConfig,
                  searchers: dict) -> tuple[int, str] | None:
    if req.set is not None and req.set not in searchers:
        return 404, f"unknown set {req.set!r} (served: {', '.join(searchers)})"
    if req.k > config.max_k:
        return 422, f"k must be <= {config.max_k}"
    if len(texts) > config.max_batch:
        return 422, f"at most {config.max_batch} queries per request"
    long = [i for i, t in enumerate(texts) if len(t) > config.max_query_chars]
    if long:
        return 422, f"query {long[0]} is longer than {config.max_query_chars} characters"
    return None


async def _run_gated(gate: _Gate, config: ServerConfig, pool, fn, *args):
    if gate.pending >= gate.limit:
        raise _Busy(429, f"server busy: {gate.limit} requests in progress or queued")
    gate.pending += 1
    try:
        queued = time.perf_counter()
        async with gate.slots:
            if time.perf_counter() - queued > config.queue_timeout_s:
                raise _Busy(503, f"waited over {config.queue_timeout_s:g}s for a search worker")
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(pool, fn, *args)
    finally:
        gate.pending -= 1
