"""The query server as users meet it: `embedpipe serve` in a subprocess, a real HTTP client."""

from __future__ import annotations

import threading
import time
from collections import Counter

import httpx
import psutil
import pytest
from _search_sets import TEXTS, embedded_set
from _serve import serving

from pipeline.index import IndexRequest, index_set


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    out = embedded_set(tmp_path_factory.mktemp("serve"), tiny_model_dir)
    index_set(IndexRequest(out=str(out), set_name="mean"), say=lambda _: None)
    with serving(out, "--workers", "1", "--queue", "2", "--max-k", "50",
                 "--body-timeout", "2") as (base, proc, _):
        yield base, proc


def test_health_describes_the_loaded_sets(server):
    base, _ = server
    assert httpx.head(f"{base}/health").status_code == 200  # load balancers' checks
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
        ({"query": "a", "k": "5"}, 422, "valid integer"),  # strict: not coerced
        ({"query": "a", "k": True}, 422, "valid integer"),
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


LONE_SURROGATE = b'"x \\ud800 y"'  # valid JSON, not valid Unicode: no model can read it


@pytest.mark.parametrize(("path", "body"), [
    ("/search", b'{"query": ' + LONE_SURROGATE + b"}"),
    ("/search", b'{"queries": ["fine", ' + LONE_SURROGATE + b"]}"),
    ("/search", b'{"query": "ok", ' + LONE_SURROGATE + b": 1}"),  # in a key
    ("/v1/embeddings", b'{"input": ' + LONE_SURROGATE + b"}"),
    ("/embed", b'{"inputs": [' + LONE_SURROGATE + b"]}"),
])
def test_a_lone_surrogate_gets_422_not_500(server, path, body):
    base, _ = server
    response = httpx.post(f"{base}{path}", content=body,
                          headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    assert "unicode string" in str(response.json()["detail"])
    assert httpx.post(f"{base}/search", json={"query": TEXTS[1], "k": 1}).status_code == 200


@pytest.mark.parametrize("body", [{"query": "a\ud800"}, {"queries": ["ok", "\udfff b"]}])
def test_request_models_refuse_lone_surrogates_in_process_too(body):
    """A plain ``str`` field would take them; the models' constrained text refuses them."""
    from pydantic import ValidationError

    from pipeline.server.models import SearchRequest

    with pytest.raises(ValidationError, match="unicode string"):
        SearchRequest.model_validate(body)


@pytest.mark.parametrize("body", [
    {"queries": ["q" * 900] * 1_000},  # 1,000 items where 32 are allowed: pydantic lists them
    {"query": 5, "k": "x" * 999_000},
    {"input": ["y" * 99_000] * 10},
])
def test_a_megabyte_of_invalid_input_is_not_echoed(server, body):
    base, _ = server
    content = httpx.Request("POST", base, json=body).content
    assert 900_000 < len(content) <= 1_000_000
    path = "/v1/embeddings" if "input" in body else "/search"
    response = httpx.post(f"{base}{path}", content=content,
                          headers={"content-type": "application/json"})
    assert 400 <= response.status_code < 500 and len(response.content) < 4_000, (
        response.status_code, len(response.content))
    assert response.json()["detail"]


def test_a_slow_body_gets_408_and_holds_no_worker(server):
    """One worker; a client sends headers and 10 of 100 promised bytes, then stalls."""
    import socket
    from urllib.parse import urlsplit

    base, _ = server
    host, port = urlsplit(base).hostname, urlsplit(base).port
    with socket.create_connection((host, port), timeout=60) as slow:
        slow.sendall(b"POST /search HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"query\": ")
        started = time.monotonic()
        for _ in range(3):  # the one worker still answers others while the body is pending
            assert httpx.post(f"{base}/search", json={"query": TEXTS[4], "k": 1}).status_code == 200
        answer = b""
        while chunk := slow.recv(4096):  # the server closes the connection after answering
            answer += chunk
        waited = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"not received within 2s" in answer
    assert waited < 30  # a hang guard: the server gave up on the body, not the client
