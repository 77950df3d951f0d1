"""Hot swap: a served set follows new generations without a restart (``pipeline.live``).

In-process tests drive ``LiveSets.poll`` by hand over a real set, real FAISS indexes and the
tiny BERT; the slow test runs `embedpipe serve` while `embedpipe embed` and `embedpipe index`
add rows to the same OUT in another process.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref

import httpx
import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _index_sets import bump, write_part
from _search_sets import TEXTS, embedded_set
from _serve import cli_env, serving, serving_app

from pipeline.index import IndexRequest, index_set, read_meta
from pipeline.live import LiveSets
from pipeline.search import Searcher

FIRST = 12  # rows in the first generation; TEXTS[FIRST:] arrive later


def reindex(out, rebuild: bool = False) -> None:
    index_set(IndexRequest(out=str(out), set_name="mean", rebuild=rebuild), say=lambda _: None)


def add_rows(out, searcher: Searcher, texts: list[str], first_id: int, part: str) -> None:
    """What an incremental embed does: a new part, the corpus grown, the generation bumped."""
    ids = list(range(first_id, first_id + len(texts)))
    write_part(out, "mean", part, ids, searcher.embedder.encode(texts, "mean"))
    corpus = out.parent / "corpus.parquet"
    grown = pa.concat_tables([pq.read_table(corpus), pa.table({"id": ids, "text": texts})])
    pq.write_table(grown, corpus)
    bump(out, "mean", [part], [])


@pytest.fixture
def first_generation(tmp_path, tiny_model_dir):
    out = embedded_set(tmp_path, tiny_model_dir, texts=TEXTS[:FIRST])
    reindex(out)
    return out


def test_new_rows_then_a_new_index_are_swapped_in_with_the_same_model(first_generation):
    out = first_generation
    first = Searcher(str(out), "mean")
    swapped = []
    live = LiveSets({"mean": first}, interval_s=0, on_swap=swapped.append)
    live.poll()
    assert live.get("mean") is first and swapped == []  # nothing new published

    add_rows(out, first, TEXTS[FIRST:], 100 + FIRST, "part-00001.parquet")
    live.poll()  # the set grew, its index did not yet: new snippets, same index and model
    second = live.get("mean")
    assert second is not first and second.set.generation == 2
    assert second.handle is first.handle and second.embedder is first.embedder

    reindex(out)
    live.poll()
    third = live.get("mean")
    assert third.meta.generation == 2 and third.meta.rows == len(TEXTS)
    assert third.handle is not first.handle and third.embedder is first.embedder
    assert third.snippets._groups is not None  # corpus ids read before the swap, not by a request
    assert swapped == [second, third] and live.status("mean")["swaps"] == 2
    top = third.search([TEXTS[15]], k=1)[0][0]
    assert (top.id, top.snippet) == (115, TEXTS[15])
    # a request that took the first generation before the swap finishes on it
    assert first.search([TEXTS[15]], k=1)[0][0].id != 115
    assert first.search([TEXTS[3]], k=1)[0][0].id == 103

    old_index = weakref.ref(first.handle)
    del first, second
    swapped.clear()  # the test's own record of swaps; the server keeps none
    gc.collect()
    assert old_index() is None  # the old generation's index is released


def test_a_failed_reload_keeps_serving_the_old_generation_and_says_so(first_generation,
                                                                      caplog):
    out = first_generation
    first = Searcher(str(out), "mean")
    failures = []
    live = LiveSets({"mean": first}, interval_s=0, on_failure=failures.append)
    add_rows(out, first, TEXTS[FIRST:], 100 + FIRST, "part-00001.parquet")
    reindex(out)
    meta = read_meta(str(out), "mean")
    (out / "index" / "mean" / meta.index_file).write_bytes(b"not a faiss index")

    live.poll()
    assert live.get("mean") is first  # still serving generation 1
    state = live.status("mean")
    assert state["failures"] == 1 and failures == ["mean"]
    assert meta.index_file in state["last_error"]
    assert "reload failed, still serving index" in caplog.text
    live.poll()  # the same broken version is not retried at every poll
    assert live.status("mean")["failures"] == 1
    assert first.search([TEXTS[3]], k=1)[0][0].id == 103

    reindex(out, rebuild=True)  # a good generation is published: picked up, error cleared
    live.poll()
    assert live.get("mean").meta.rows == len(TEXTS)
    assert live.status("mean") == {"swaps": 1, "failures": 1, "last_error": None}


def test_a_set_removed_or_unindexed_while_served_fails_once_per_retry_not_every_poll(
        first_generation, caplog):
    """Removed (to be made again, for hours), it logged a failed reload at every poll; its
    index removed too, it was served on without a word."""
    import shutil

    out = first_generation
    first = Searcher(str(out), "mean")
    live = LiveSets({"mean": first}, interval_s=0, retry_s=0.3)
    shutil.rmtree(out / "sets" / "mean")
    for _ in range(5):
        live.poll()
    assert live.status("mean")["failures"] == 1
    assert caplog.text.count("reload failed") == 1
    time.sleep(0.4)  # past retry_s: the same cause is logged again, once
    live.poll()
    live.poll()
    assert live.status("mean")["failures"] == 2
    shutil.rmtree(out / "index" / "mean")
    live.poll()
    state = live.status("mean")
    assert state["failures"] == 3 and "has no published index any more" in state["last_error"]
    assert live.get("mean") is first  # what it holds still answers
    assert first.search([TEXTS[3]], k=1)[0][0].id == 103


def test_rows_deleted_before_the_index_catches_up_leave_the_others_their_snippets(
        first_generation, caplog):
    """A nightly deleted a quarter of the rows, its index not caught up yet: the reload
    checked the corpus against the index's (stale) ids, found too few, and every hit lost
    its snippet without a word until `index` ran."""
    out = first_generation
    first = Searcher(str(out), "mean")
    live = LiveSets({"mean": first}, interval_s=0)
    corpus = out.parent / "corpus.parquet"
    kept = pq.read_table(corpus).slice(0, FIRST - 3)  # ids 109-111 deleted
    pq.write_table(kept, corpus)
    bump(out, "mean", [], [109, 110, 111])
    live.poll()
    served = live.get("mean")
    assert served is not first and served.meta.token == first.meta.token  # same index
    top = served.search([TEXTS[4]], k=1)[0][0]
    assert (top.id, top.snippet) == (104, TEXTS[4])
    assert "no snippets" not in caplog.text


def test_stop_does_not_wait_on_a_reload_stuck_on_storage(first_generation, monkeypatch):
    """SIGTERM left the server running for 410 s while a download of a new index retried."""
    out = first_generation
    live = LiveSets({"mean": Searcher(str(out), "mean")}, interval_s=0.01)
    stuck, entered = threading.Event(), threading.Event()

    def poll() -> None:
        entered.set()
        stuck.wait(60)

    monkeypatch.setattr(live, "poll", poll)
    live.start()
    assert entered.wait(30)
    started = time.monotonic()
    live.stop(timeout_s=0.5)
    assert time.monotonic() - started < 5  # a hang guard: it waits its 0.5 s, not the 60
    stuck.set()


def test_the_poller_thread_swaps_within_its_interval_and_stops(first_generation):
    out = first_generation
    first = Searcher(str(out), "mean")
    live = LiveSets({"mean": first}, interval_s=0.05)
    live.start()
    try:
        add_rows(out, first, TEXTS[FIRST:], 100 + FIRST, "part-00001.parquet")
        reindex(out)
        deadline = time.monotonic() + 60  # a hang guard, not a timing
        while live.get("mean").meta.generation != 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert live.get("mean").meta.generation == 2
    finally:
        live.stop()
    assert not any(t.name == "embedpipe-reload" for t in threading.enumerate())


def test_a_set_indexed_after_the_start_is_served_without_a_restart(first_generation,
                                                                    tiny_model_dir):
    from fastapi.testclient import TestClient

    from pipeline.server import ServerConfig, create_app

    out = first_generation
    app = create_app(ServerConfig(out=str(out), default_set="mean"))
    live, http = app.state.live, TestClient(app)  # no lifespan: the test polls by hand
    embedded_set(out.parent, tiny_model_dir, name="cls", texts=TEXTS[:FIRST], strategy="cls")
    live.poll()
    assert live.names == ["mean"]  # embedded, not indexed yet: nothing to serve
    index_set(IndexRequest(out=str(out), set_name="cls"), say=lambda _: None)
    live.poll()
    assert sorted(http.get("/health").json()["sets"]) == ["cls", "mean"]
    found = http.post("/search", json={"query": TEXTS[3], "k": 1, "set": "cls"})
    assert found.status_code == 200 and found.json()["results"][0][0]["id"] == 103
    assert live.get("mean").set.name == "mean"  # the served set untouched


def test_one_sets_unreadable_index_file_does_not_hide_a_newly_indexed_set(first_generation,
                                                                          tiny_model_dir):
    """Discovery read every set's ``_INDEX.json``: one unreadable file failed the listing, and
    no set indexed after it was served until the file was mended."""
    from pipeline.server import ServerConfig, create_app

    out = first_generation
    live = create_app(ServerConfig(out=str(out), default_set="mean")).state.live
    embedded_set(out.parent, tiny_model_dir, name="cls", texts=TEXTS[:FIRST], strategy="cls")
    embedded_set(out.parent, tiny_model_dir, name="max", texts=TEXTS[:FIRST], strategy="max")
    for name in ("cls", "max"):
        index_set(IndexRequest(out=str(out), set_name=name), say=lambda _: None)
    (out / "index" / "cls" / "_INDEX.json").write_text("not json")
    live.poll()
    assert sorted(live.names) == ["max", "mean"]  # cls: its load failed, logged, retried later
    assert live.get("max").search([TEXTS[3]], k=1)[0][0].id == 103


def test_a_new_set_that_fails_to_load_is_retried_later_and_the_others_serve_on(
        first_generation):
    out = first_generation
    tried = []

    def load(name: str) -> Searcher:
        tried.append(name)
        raise OSError("model folder gone")

    live = LiveSets({"mean": Searcher(str(out), "mean")}, interval_s=0, retry_s=3600,
                    discover=lambda: ["mean", "broken"], load=load)
    live.poll()
    live.poll()  # within retry_s: not tried again
    assert tried == ["broken"] and live.names == ["mean"]
    assert live.get("mean").search([TEXTS[3]], k=1)[0][0].id == 103


def _by_set(base: str, name: str) -> dict[str, float]:
    """The samples of metric ``name`` on the server's /metrics, by set."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base}/metrics").text
    return {s.labels["set"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


def test_metrics_count_each_swap_as_a_reload_but_not_a_new_sets_first_load(first_generation,
                                                                         tiny_model_dir):
    from pipeline.server import ServerConfig, create_app

    out = first_generation
    app = create_app(ServerConfig(out=str(out), default_set="mean", reload_interval_s=0))
    live = app.state.live  # no reload thread: the test polls by hand
    with serving_app(app) as base:
        assert _by_set(base, "embedpipe_reloads_total") == {"mean": 0.0}
        add_rows(out, live.get("mean"), TEXTS[FIRST:], 100 + FIRST, "part-00001.parquet")
        live.poll()  # new rows: a new set generation swapped in
        assert _by_set(base, "embedpipe_reloads_total") == {"mean": 1.0}
        reindex(out)
        live.poll()  # a new index
        assert _by_set(base, "embedpipe_reloads_total") == {"mean": 2.0}
        assert _by_set(base, "embedpipe_index_generation") == {"mean": 2.0}
        assert httpx.get(f"{base}/health").json()["sets"]["mean"]["reload"]["swaps"] == 2

        embedded_set(out.parent, tiny_model_dir, name="cls", texts=TEXTS[:FIRST],
                     strategy="cls")
        index_set(IndexRequest(out=str(out), set_name="cls"), say=lambda _: None)
        live.poll()  # a newly indexed set: served, its first load is no reload
        assert _by_set(base, "embedpipe_reloads_total") == {"mean": 2.0, "cls": 0.0}
        assert _by_set(base, "embedpipe_reload_failures_total") == {"mean": 0.0, "cls": 0.0}
        assert _by_set(base, "embedpipe_index_rows") == {"mean": len(TEXTS), "cls": FIRST}


def _cli(*commands: list[str]) -> str:
    """``embedpipe`` commands run one after another in ONE Python subprocess; returns the
    script for ``python -c``."""
    calls = "; ".join(f"assert main({c!r}) == 0, {c[0]!r}" for c in commands)
    return f"from flows.cli import main; {calls}"


def _write_corpus(path, ids: list[int], texts: list[str]) -> None:
    pq.write_table(pa.table({"id": ids, "text": texts}), path)


def _hammer(base: str, stop: threading.Event, statuses: list, latencies: list) -> None:
    """Bounded (count and stop event) alternating searches and OpenAI embedding calls."""
    with httpx.Client(base_url=base, timeout=60) as http:
        for i in range(20_000):
            if stop.is_set():
                return
            started = time.perf_counter()
            if i % 2:
                r = http.post("/search", json={"query": f"document number {i % 40}", "k": 5})
            else:
                r = http.post("/v1/embeddings", json={"input": [TEXTS[i % 20], "topic 3"]})
            latencies.append(time.perf_counter() - started)
            statuses.append(r.status_code)
            time.sleep(0.02)


@pytest.mark.slow
def test_serve_answers_throughout_embed_index_and_then_serves_the_new_rows(
        tmp_path, tiny_model_dir):
    import subprocess
    import sys

    from _serve import ROOT

    corpus, out = tmp_path / "corpus", tmp_path / "out"
    corpus.mkdir()
    _write_corpus(corpus / "a.parquet", list(range(40)),
                  [f"document number {i} about topic {i % 7}" for i in range(40)])
    embed = ["embed", str(corpus), str(out), "--model", str(tiny_model_dir), "--dtype", "fp32",
             "--device", "cpu", "--index"]  # embed, then index catch-up, in one flow run

    def embed_and_index(*extra: str) -> None:
        run_cli = [sys.executable, "-c", _cli([*embed, *extra])]
        done = subprocess.run(run_cli, cwd=ROOT, env=cli_env(), capture_output=True, text=True,
                              timeout=900)  # a hang guard
        assert done.returncode == 0, done.stderr[-3000:]

    embed_and_index()

    with serving(out, "--reload-interval", "0.5") as (base, proc, log):
        stop, statuses, latencies = threading.Event(), [], []
        clients = [threading.Thread(target=_hammer, args=(base, stop, statuses, latencies))
                   for _ in range(2)]
        for c in clients:
            c.start()
        try:
            new_ids = list(range(1000, 1000 + len(TEXTS)))
            _write_corpus(corpus / "b.parquet", new_ids, TEXTS)  # new rows arrive
            embed_and_index("--incremental")  # the nightly run
            deadline = time.monotonic() + 120  # a hang guard: the swap takes ~interval
            while time.monotonic() < deadline:
                if httpx.get(f"{base}/health").json()["sets"]["mean"]["generation"] == 2:
                    break
                time.sleep(0.25)
            time.sleep(1)  # keep answering a little after the swap too
        finally:
            stop.set()
            for c in clients:
                c.join()
        assert proc.poll() is None  # never restarted
        health = httpx.get(f"{base}/health").json()["sets"]["mean"]
        assert (health["generation"], health["rows"]) == (2, 60), log()[-3000:]
        assert health["reload"]["failures"] == 0 and health["reload"]["swaps"] >= 1
        assert len(statuses) > 50 and set(statuses) == {200}, sorted(set(statuses))
        print(f"{len(statuses)} requests during the update, all 200; latency max "
              f"{max(latencies):.3f}s, median {sorted(latencies)[len(latencies) // 2]:.3f}s")

        top = httpx.post(f"{base}/search", json={"query": TEXTS[7], "k": 1}).json()
        assert (top["results"][0][0]["id"], top["results"][0][0]["snippet"]) == (1007, TEXTS[7])
        # the set's own vectors, as `embed` wrote them, for old and new corpus texts
        texts = [TEXTS[2], TEXTS[11], "document number 5 about topic 5"]
        got = httpx.post(f"{base}/v1/embeddings", json={"input": texts}).json()["data"]
        parts = pl.concat([pl.read_parquet(p) for p in (out / "sets" / "mean").glob("part-*")])
        want = {r["id"]: r["embedding"] for r in parts.filter(
            pl.col("id").is_in([1002, 1011, 5])).iter_rows(named=True)}
        for row, i in zip(got, [1002, 1011, 5], strict=True):
            a, b = np.asarray(row["embedding"]), np.asarray(want[i])
            assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) >= 0.9999
        metrics = httpx.get(f"{base}/metrics").text
        assert 'embedpipe_index_generation{set="mean"} 2.0' in metrics
        assert 'embedpipe_reload_failures_total{set="mean"} 0.0' in metrics
        assert "now serving index" in log()
