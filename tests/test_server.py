"""The query server as users meet it: `embedpipe serve` in a subprocess, a real HTTP client."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil
import pytest
from _search_sets import TEXTS, embedded_set

from pipeline.index import IndexRequest, index_set

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    out = embedded_set(tmp_path_factory.mktemp("serve"), tiny_model_dir)
    index_set(IndexRequest(out=str(out), set_name="mean"), say=lambda _: None)
    port = free_port()
    code = ("import sys; from flows.cli import main; "
            f"sys.exit(main(['serve', {str(out)!r}, '--port', '{port}', '--workers', '1', "
            "'--queue', '2', '--max-k', '50']))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180  # a hang guard, not a timing
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"server did not start: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.5)
    yield base, proc
    proc.terminate()
    proc.wait(timeout=30)


def test_health_describes_the_loaded_sets(server):
    base, _ = server
    body = httpx.get(f"{base}/health").json()
    assert body["status"] == "ok" and body["default_set"] == "mean"
    mean = body["sets"]["mean"]
    assert (mean["kind"], mean["rows"], mean["recall_at_10"], mean["metric"]) == (
        "flat", 20, 1.0, "ip")
    assert body["limits"]["max_k"] == 50 and body["limits"]["queue"] == 2
    assert httpx.get(f"{base}/openapi.json").json()["paths"]["/search"]["post"]


def test_search_one_query_and_a_batch(server):
    base, _ = server
    one = httpx.post(f"{base}/search", json={"query": TEXTS[2], "k": 3}).json()
    assert one["set"] == "mean" and one["k"] == 3 and len(one["results"]) == 1
    top = one["results"][0][0]
    assert (top["rank"], top["id"], top["snippet"]) == (1, 102, TEXTS[2])
    assert top["score"] == pytest.approx(1.0, abs=1e-4)
    batch = httpx.post(f"{base}/search",
                       json={"queries": TEXTS[5:8], "k": 2, "set": "mean"}).json()
    assert [r[0]["id"] for r in batch["results"]] == [105, 106, 107]
    assert all(len(r) == 2 for r in batch["results"])


@pytest.mark.parametrize(
    ("body", "status", "reason"),
    [
        ({}, 422, "exactly one of 'query'"),
        ({"query": "a", "queries": ["b"]}, 422, "exactly one of 'query'"),
        ({"query": ""}, 422, "at least 1 character"),
        ({"query": "   "}, 422, "empty or whitespace"),
        ({"queries": []}, 422, "at least 1 item"),
        ({"queries": ["ok", 5]}, 422, "valid string"),
        ({"query": "a", "k": 0}, 422, "greater than or equal to 1"),
        ({"query": "a", "k": "ten"}, 422, "valid integer"),
        ({"query": "a", "k": 51}, 422, "k must be <= 50"),
        ({"query": "a", "k": 10**9}, 422, "less than or equal to 1000"),
        ({"query": "x" * 2_001}, 422, "longer than 2000 characters"),
        ({"queries": ["q"] * 33}, 422, "at most 32 queries"),
        ({"query": "a", "set": "nope"}, 404, "unknown set 'nope' (served: mean)"),
        ({"query": "a", "limit": 3}, 422, "Extra inputs are not permitted"),
        (["query", "a"], 422, "valid dictionary"),
    ],
)
def test_malformed_requests_get_4xx_with_a_reason(server, body, status, reason):
    base, _ = server
    response = httpx.post(f"{base}/search", json=body)
    assert response.status_code == status
    assert reason in str(response.json()["detail"])


def test_bodies_that_are_not_json_or_too_large_get_4xx(server):
    base, _ = server
    bad = httpx.post(f"{base}/search", content=b"{not json",
                     headers={"content-type": "application/json"})
    assert bad.status_code == 422 and "JSON" in str(bad.json()["detail"])
    big = httpx.post(f"{base}/search", json={"query": "x" * 2_000_000})
    assert big.status_code == 413 and "larger than 1,000,000 bytes" in big.json()["detail"]

    def chunks():  # no Content-Length: the limit applies to the streamed body
        for _ in range(40):
            yield b" " * 50_000

    streamed = httpx.post(f"{base}/search", content=chunks(),
                          headers={"content-type": "application/json"})
    assert streamed.status_code == 413
    assert httpx.get(f"{base}/search").status_code == 405


def _hammer(base: str, seconds: float, clients: int) -> Counter:
    statuses: Counter = Counter()
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def client(n: int) -> None:
        with httpx.Client(base_url=base, timeout=30) as http:
            i = 0
            while time.monotonic() < stop:
                body = {"queries": [TEXTS[(n + i) % 20], TEXTS[i % 20]], "k": 10}
                code = http.post("/search", json=body).status_code
                with lock:
                    statuses[code] += 1
                i += 1

    threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statuses


def test_under_load_only_queue_refusals_and_memory_stays_flat(server):
    base, proc = server
    rss = psutil.Process(proc.pid)
    warm = _hammer(base, 3, 24)
    before = rss.memory_info().rss
    statuses = _hammer(base, 6, 24)
    after = rss.memory_info().rss
    assert set(warm) | set(statuses) <= {200, 429, 503}, statuses
    assert statuses[200] > 0
    assert statuses[429] + statuses[503] > 0  # 24 clients against 1 worker + 2 queued
    assert after - before < 50 * 2**20, (before, after)
    # The server is healthy afterwards.
    assert httpx.post(f"{base}/search", json={"query": TEXTS[0], "k": 1}).status_code == 200
