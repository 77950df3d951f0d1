"""Clients people already use, against `embedpipe serve` with an API key: the openai SDK,
huggingface_hub's InferenceClient, plain HTTP for keys and 422s, a Prometheus scrape."""

from __future__ import annotations

import json

import httpx
import numpy as np
import polars as pl
import pytest
from _search_sets import TEXTS, embedded_set
from _serve import cli_env, serving

from pipeline.index import IndexRequest, index_set
from pipeline.vectors import row_cosines

KEY = "test-key-5f1c2a"


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir):
    """Two sets (``cls``, ``mean``), no --default-set, EMBEDPIPE_API_KEY set."""
    root = tmp_path_factory.mktemp("clients")
    for name in ("cls", "mean"):
        out = embedded_set(root, tiny_model_dir, name=name, strategy=name)
        index_set(IndexRequest(out=str(out), set_name=name), say=lambda _: None)
    env = cli_env(EMBEDPIPE_API_KEY=KEY)
    with serving(out, env=env) as (base, _, log):
        yield base, out, log


def stored(out, name: str) -> np.ndarray:
    """The set's vectors as `embed` wrote them, in TEXTS order (ids 100...)."""
    frame = pl.read_parquet(out / "sets" / name / "part-00000.parquet").sort("id")
    assert frame["id"].to_list() == list(range(100, 100 + len(TEXTS)))
    return np.asarray(frame["embedding"].to_list(), dtype=np.float32)


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/search", {"query": TEXTS[0]}),
    ("POST", "/v1/embeddings", {"input": TEXTS[0]}),
    ("POST", "/embed", {"inputs": TEXTS[0]}),
    ("GET", "/metrics", None),
    ("GET", "/openapi.json", None),
])
def test_every_route_but_health_needs_the_key(served, method, path, body):
    base, _, _ = served
    statuses = []
    for headers in ({}, auth("wrong-key"), {"Authorization": KEY}, auth()):
        r = httpx.request(method, f"{base}{path}", json=body, headers=headers)
        statuses.append(r.status_code)
        if r.status_code == 401:
            assert r.headers["www-authenticate"] == "Bearer"
            assert "missing or wrong API key" in r.json()["detail"]
    assert statuses == [401, 401, 401, 200]
    assert httpx.get(f"{base}/health").status_code == 200


def test_health_names_the_default_set_not_the_first_alphabetically(served):
    base, _, _ = served
    health = httpx.get(f"{base}/health").json()
    assert health["default_set"] == "mean" and sorted(health["sets"]) == ["cls", "mean"]
    assert health["auth"] is True


def test_openai_sdk_gets_the_sets_own_vectors(served):
    from openai import OpenAI

    base, out, _ = served
    client = OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
    for name in ("mean", "cls"):
        result = client.embeddings.create(input=TEXTS[:7], model=name)  # base64 by default
        got = np.asarray([d.embedding for d in result.data], dtype=np.float32)
        assert [d.index for d in result.data] == list(range(7)) and result.model == name
        assert got.shape == (7, 32)
        assert row_cosines(got, stored(out, name)[:7]).min() >= 0.9999
    assert result.usage.prompt_tokens == result.usage.total_tokens > 7
    one = client.embeddings.create(input=TEXTS[9], model="mean", encoding_format="float")
    assert row_cosines(np.asarray([one.data[0].embedding]), stored(out, "mean")[9:10])[0] >= 0.9999


def test_openai_shape_base64_and_dimensions_over_plain_http(served):
    base, out, _ = served
    body = {"input": [TEXTS[3], TEXTS[4]], "encoding_format": "base64", "dimensions": 8}
    r = httpx.post(f"{base}/v1/embeddings", json=body, headers=auth()).json()
    assert r["object"] == "list" and r["model"] == "mean"  # no model: the default set
    assert [d["object"] for d in r["data"]] == ["embedding", "embedding"]
    import base64

    got = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in r["data"]])
    want = stored(out, "mean")[3:5, :8]
    want = want / np.linalg.norm(want, axis=1, keepdims=True)  # truncated, then re-normalised
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_huggingface_inference_client_gets_the_default_sets_vectors(served, monkeypatch):
    from huggingface_hub import InferenceClient, constants

    base, out, _ = served
    # offline mode (conftest) blocks every request, loopback included; a URL model needs no Hub
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    client = InferenceClient(model=base, token=KEY)
    got = client.feature_extraction(TEXTS[5])
    assert got.shape == (1, 32)
    assert row_cosines(got, stored(out, "mean")[5:6])[0] >= 0.9999
    raw = httpx.post(f"{base}/embed", headers=auth(),
                     json={"inputs": TEXTS[:3], "normalize": False, "truncate": True}).json()
    assert row_cosines(np.asarray(raw), stored(out, "mean")[:3]).min() >= 0.9999


@pytest.mark.parametrize(("path", "body", "status", "reason"), [
    ("/v1/embeddings", {"input": [[101, 2023], [101]]}, 422, "token-id input is not supported"),
    ("/v1/embeddings", {"input": [5, 6]}, 422, "token-id input is not supported"),
    ("/v1/embeddings", {"input": []}, 422, "no input"),
    ("/v1/embeddings", {"input": "x", "dimensions": 33}, 422, "dimensions must be <= 32"),
    ("/v1/embeddings", {"input": "x", "model": "text-embedding-3-small"}, 404,
     "unknown set 'text-embedding-3-small' (served: cls, mean)"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, 422, "'float' or 'base64'"),
    ("/v1/embeddings", {"input": ["x"] * 257}, 422, "at most 256 inputs"),
    ("/v1/embeddings", {"input": "x" * 10_001}, 422, "input 0 is longer than 10000"),
    ("/embed", {"inputs": "x", "prompt_name": "query"}, 422, "prompt_name is not supported"),
    ("/embed", {"inputs": "  "}, 422, "empty or whitespace"),
    ("/embed", {"inputs": ["x", "word " * 300], "truncate": False}, 413,
     "input 1 is longer than 128 tokens, the most set 'mean' reads, and truncate is false"),
])
def test_embedding_requests_out_of_bounds_get_4xx_with_a_reason(served, path, body, status,
                                                                reason):
    base, _, _ = served
    r = httpx.post(f"{base}{path}", json=body, headers=auth())
    assert r.status_code == status and reason in str(r.json()["detail"]), r.text


@pytest.mark.parametrize(("path", "body", "loc", "reason"), [
    ("/v1/embeddings", {"input": [""]}, ["body", "input", 0], "at least 1 character"),
    ("/v1/embeddings", {"input": ["ok", "  "]}, ["body", "input", 1], "empty or whitespace"),
    ("/v1/embeddings", {"input": ["ok", "\u200b"]}, ["body", "input", 1],
     "no visible character"),
    ("/v1/embeddings", {"input": ""}, ["body", "input", 0], "at least 1 character"),
    ("/embed", {"inputs": ["ok", None]}, ["body", "inputs", 1], "valid string"),
])
def test_a_bad_text_gets_one_error_where_it_lies(served, path, body, loc, reason):
    """``str | list[str]`` reported each alternative: two errors for one empty text, the first
    saying the list "should be a valid string"."""
    base, _, _ = served
    r = httpx.post(f"{base}{path}", json=body, headers=auth())
    assert r.status_code == 422, r.text
    [error] = r.json()["detail"]
    assert error["loc"] == loc and reason in error["msg"], error


@pytest.mark.parametrize("path", ["/v1/embeddings", "/embed", "/search"])
@pytest.mark.parametrize(("content_type", "said"), [
    ("text/plain", "not text/plain"),
    ("application/x-www-form-urlencoded", "not application/x-www-form-urlencoded"),
    (None, "and none was given"),
])
def test_a_body_not_sent_as_json_gets_415(served, path, content_type, said):
    """FastAPI hands such a body to the model as bytes: 422 "valid dictionary" said nothing of
    the header that was wrong. JSON types (``+json``, with parameters) parse."""
    base, _, _ = served
    field = {"/v1/embeddings": "input", "/embed": "inputs", "/search": "query"}[path]
    body = json.dumps({field: TEXTS[0]}).encode()
    with httpx.Client() as client:
        def send(content_type: str | None) -> httpx.Response:
            headers = auth() | ({"content-type": content_type} if content_type else {})
            request = client.build_request("POST", f"{base}{path}", content=body,
                                           headers=headers)
            assert ("content-type" in request.headers) == (content_type is not None)
            return client.send(request)

        r = send(content_type)
        assert r.status_code == 415, r.text
        assert r.json()["detail"] == ("the request body must be JSON (Content-Type: "
                                      f"application/json), {said}")
        for fine in ("application/json; charset=utf-8", "application/vnd.api+json"):
            assert send(fine).status_code == 200, fine


def test_tei_truncate_false_embeds_texts_that_fit_and_true_truncates(served):
    """TEI's ``truncate``: false answers 413 for a text over the model's rows (above) and
    embeds the others; true, or left out, embeds a long text's first tokens."""
    base, _, _ = served
    long = "word " * 300

    def tei(body: dict) -> np.ndarray:
        r = httpx.post(f"{base}/embed", json=body, headers=auth())
        assert r.status_code == 200, r.text
        return np.asarray(r.json())

    fits = tei({"inputs": TEXTS[:2], "truncate": False})
    np.testing.assert_allclose(fits, tei({"inputs": TEXTS[:2]}), atol=1e-6)
    cut = tei({"inputs": [long], "truncate": True})
    np.testing.assert_allclose(cut, tei({"inputs": [long]}), atol=1e-6)
    np.testing.assert_allclose(cut, tei({"inputs": [long + "more words " * 50]}), atol=1e-6)


def _samples(text: str, name: str) -> dict[tuple, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {tuple(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name}


def test_metrics_count_requests_by_route_and_status(served):
    base, _, _ = served
    before = httpx.get(f"{base}/metrics", headers=auth()).text
    for _ in range(3):
        httpx.post(f"{base}/v1/embeddings", json={"input": "x"}, headers=auth())
    httpx.post(f"{base}/v1/embeddings", json={"input": "x"})  # 401
    httpx.get(f"{base}/no/such/path", headers=auth())  # 404 under route "other"
    after = httpx.get(f"{base}/metrics", headers=auth())
    assert after.headers["content-type"].startswith("text/plain")

    def grew(labels: dict) -> float:
        key = tuple(sorted(labels.items()))
        return (_samples(after.text, "embedpipe_requests_total").get(key, 0)
                - _samples(before, "embedpipe_requests_total").get(key, 0))

    assert grew({"route": "/v1/embeddings", "status": "200"}) == 3
    assert grew({"route": "/v1/embeddings", "status": "401"}) == 1
    assert grew({"route": "other", "status": "404"}) == 1
    latency = _samples(after.text, "embedpipe_request_seconds_count")
    assert latency[(("route", "/v1/embeddings"),)] >= 4
    generations = _samples(after.text, "embedpipe_index_generation")
    assert generations == {(("set", "cls"),): 1.0, (("set", "mean"),): 1.0}
    assert _samples(after.text, "embedpipe_queue_depth") == {(): 0.0}
    assert _samples(after.text, "embedpipe_reload_failures_total") == {
        (("set", "cls"),): 0.0, (("set", "mean"),): 0.0}
