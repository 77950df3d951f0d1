"""The Python API (`import embedpipe`) and the commands over it, as users meet them."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _search_sets import TEXTS, embedded_set
from _serve import serving

import embedpipe
from flows.cli import main
from pipeline.assembly import VECTOR_OPTIONS
from pipeline.config import EncoderConfig, PoolerSpec
from pipeline.index import IndexRequest, index_set, store
from pipeline.sets import SetFolder

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
FAIL_FAST_S = 5.0  # generous: the input check runs before Prefect (torch: where a model loads)


def _cli(*args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=ROOT,
                          env=env or ENV, capture_output=True, text=True, timeout=600)
    return done, time.perf_counter() - started


def test_import_embedpipe_is_cheap_and_documented():
    code = ("import json, sys, embedpipe; print(json.dumps(sorted(m for m in "
            "('torch', 'transformers', 'prefect', 'faiss', 'polars') if m in sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []
    for name in ("embed", "backfill", "index", "search", "evaluate", "read_set"):
        assert callable(getattr(embedpipe, name)) and getattr(embedpipe, name).__doc__


def _unreadable_model(model: Path, tmp_path: Path) -> Path:
    """A copy of ``model`` whose config names a model type transformers does not know."""
    copy = tmp_path / "unknown-model"
    shutil.copytree(model, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(config | {"model_type": "nosuchtype"}))
    return copy


def test_bad_input_fails_before_orchestration(tmp_path, tiny_model_dir):
    """Missing corpus, missing column, bad option: one line, exit 1, in seconds."""
    pq.write_table(pa.table({"id": [1, 2], "body": ["a", "b"]}), tmp_path / "c.parquet")
    out = str(tmp_path / "out")
    cases = {
        "cannot read": ["embed", str(tmp_path / "missing.parquet"), out],
        "has no column 'text'": ["embed", str(tmp_path / "c.parquet"), out],
        "rows_per_shard: Input should be greater than 0": [
            "embed", str(tmp_path / "c.parquet"), out, "--text-column", "body",
            "--rows-per-shard", "0"],
        "model folder not found": ["embed", str(tmp_path / "c.parquet"), out, "--text-column",
                                   "body", "--model", str(tmp_path / "no-model")],
        "text column 'id' is int64, not text": ["embed", str(tmp_path / "c.parquet"), out,
                                                "--text-column", "id"],
        # before the run takes OUT's lease (it left an OUT holding only _LEASE.json)
        "unknown pooler 'nosuch' for set 'nosuch'": ["embed", str(tmp_path / "c.parquet"), out,
                                                     "--text-column", "body", "--pooler",
                                                     "nosuch"],
        "max_length 100000 exceeds the 128 tokens model": [
            "embed", str(tmp_path / "c.parquet"), out, "--text-column", "body", "--model",
            str(tiny_model_dir), "--max-length", "100000"],
        "cannot load an encoder from": [
            "embed", str(tmp_path / "c.parquet"), out, "--text-column", "body", "--model",
            str(_unreadable_model(tiny_model_dir, tmp_path)), "--max-length", "64"],
        "for runner 'dask', not 'threads'": ["embed", str(tmp_path / "c.parquet"), out,
                                             "--text-column", "body", "--dask-address",
                                             "tcp://127.0.0.1:1"],
        # after Prefect's 30 s, a traceback of distributed's, and OUT's sets made
        "cannot reach the Dask scheduler at tcp://127.0.0.1:1: Connection refused": [
            "embed", str(tmp_path / "c.parquet"), out, "--text-column", "body", "--runner",
            "dask", "--dask-address", "tcp://127.0.0.1:1"],
    }
    for reason, args in cases.items():
        done, seconds = _cli(*args)
        assert done.returncode == 1, done.stderr
        (line,) = done.stderr.strip().splitlines()
        assert line.startswith("embedpipe embed: error: ") and reason in line, line
        assert seconds < FAIL_FAST_S, f"{args}: {seconds:.1f}s to fail"
    # found in the backfill flow, after Prefect's API had started (a traceback in its log)
    done, seconds = _cli("backfill", str(tmp_path / "c.parquet"), out, "--text-column", "body",
                         "--pooler", "cls")
    assert done.returncode == 1 and seconds < FAIL_FAST_S, (done.stderr, seconds)
    assert done.stderr.strip().splitlines() == [
        f"embedpipe backfill: error: {out} has no sets to backfill next to; use `embedpipe embed`"]
    assert not (tmp_path / "out").exists()


def _write(folder: Path, name: str, ids: list[int], texts: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": ids, "text": texts}), folder / name, row_group_size=10)


def _flow_run_parents(name: str) -> list:
    """Flow runs of the flow ``name``, each with its parent flow run's flow name (or None)."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[name])))
        parents = []
        for run in runs:
            if run.parent_task_run_id is None:
                parents.append(None)
                continue
            parent = client.read_flow_run(client.read_task_run(run.parent_task_run_id).flow_run_id)
            parents.append(client.read_flow(parent.flow_id).name)
    return parents


def _latest_summary_artifact() -> dict:
    """The table row of the newest ``embed-summary`` artifact on the Prefect API."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    with get_client(sync_client=True) as client:
        (artifact,) = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["embed-summary"])),
            sort=ArtifactSort.CREATED_DESC, limit=1)
    data = json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data
    (row,) = data
    return row


@pytest.mark.slow
@pytest.mark.parametrize(("address", "says"), [
    ("scheduler", "--dask-address 'scheduler' is not a scheduler address (tcp://HOST:PORT"),
    ("http://127.0.0.1:8786", "is not a scheduler address"),
    ("tcp://127.0.0.1:99999", "is not a scheduler address: Port out of range"),
])
def test_a_dask_address_that_is_none_is_one_line(address, says):
    from pipeline.assembly import check_scheduler

    with pytest.raises(embedpipe.EmbedpipeError) as err:
        check_scheduler(address)
    assert says in str(err.value)


def test_python_api_end_to_end(tmp_path, tiny_model_dir, prefect_api):
    corpus, out = tmp_path / "corpus", str(tmp_path / "out")
    _write(corpus, "a.parquet", list(range(100, 120)), TEXTS)
    opts = {"model": str(tiny_model_dir), "device": "cpu", "dtype": "fp32", "rows_per_shard": 10}

    # embed --index: the sets and an up-to-date index from one call
    summary = embedpipe.embed(str(corpus), out, poolers=["mean"], index=True, **opts)
    assert (summary["rows"], summary["embedded"]) == (20, 20)
    assert [r["action"] for r in summary["index"]] == ["built"]
    meta = store.read_meta(out, "mean")
    assert (meta.rows, meta.generation) == (20, SetFolder(out, "mean").meta().generation)
    (hits,) = embedpipe.search(out, TEXTS[3], k=3)
    assert (hits[0].id, hits[0].snippet) == (103, TEXTS[3])

    # nightly to live: new rows, incremental embed and index catch-up in ONE flow run
    new = ["a field guide to mushrooms", "repairing a bicycle chain"]
    _write(corpus, "b.parquet", [200, 201], new)
    summary = embedpipe.embed(str(corpus), out, poolers=["mean"], index=True, incremental=True,
                              **opts)
    assert (summary["rows"], summary["embedded"], summary["reused"]) == (22, 2, 20)
    assert [r["action"] for r in summary["index"]] == ["caught up"]
    meta = store.read_meta(out, "mean")
    assert (meta.rows, meta.generation) == (22, SetFolder(out, "mean").meta().generation)
    assert [h[0].id for h in embedpipe.search(out, new, k=1)] == [200, 201]
    assert "embed-and-index" in _flow_run_parents("nightly")
    artifact = _latest_summary_artifact()
    assert artifact["seconds"] > 0  # the shards' time; "setup seconds" is the time before
    timed = {k: 0 for k in artifact if k.endswith("seconds") or k == "docs/s"}
    assert set(timed) == {"seconds", "docs/s", "setup seconds", "read seconds",
                          "tokenize seconds", "encode seconds", "write seconds"}
    assert artifact | timed == timed | {
        "sets": "mean", "rows": 22, "embedded": 2, "reused": 20, "removed": 0, "skipped": 0,
        "shards run": "3/3", "duplicates": 0, "tokens": summary["stats"]["tokens"],
        "truncated": 0, "padding %": round(100 * summary["stats"]["padding"]
                                          / summary["stats"]["batch_tokens"], 2)}

    # backfill names no model: it takes the encoder options that made the sets in OUT
    backfilled = embedpipe.backfill(str(corpus), out, poolers=["cls"], rows_per_shard=10)
    assert backfilled["rows"] == 22 and backfilled["line"].startswith("backfilled 22 rows")
    cls, mean = SetFolder(out, "cls").meta(), SetFolder(out, "mean").meta()
    assert all(cls.encoder[k] == mean.encoder[k] for k in VECTOR_OPTIONS)
    assert (cls.encoder["model"], cls.dim) == (str(tiny_model_dir), 32)

    # evaluate: exact by default (the cls set has no index at all), per-query ranks
    queries = tmp_path / "queries.parquet"
    pq.write_table(pa.table({"query": TEXTS[:5], "doc_id": list(range(100, 105))}), queries)
    ranks = tmp_path / "ranks.parquet"
    results = embedpipe.evaluate(out, str(queries), sets=["mean", "cls"], k=5,
                                 ranks_out=str(ranks))
    assert [(r.set, r.search, r.k) for r in results] == [("mean", "exact", 5),
                                                          ("cls", "exact", 5)]
    assert results[0].scores == {"recall@1": 1.0, "recall@5": 1.0, "mrr@5": 1.0, "ndcg@5": 1.0}
    frame = pl.read_parquet(ranks)
    assert frame.columns == ["set", "search", "k", "query", "doc_id", "rank"]
    assert frame.filter(pl.col("set") == "mean")["rank"].to_list() == [1] * 5
    assert frame.height == 10
    # doc_id as the corpus's ids, so the ranks join back to it (it was text)
    assert frame.schema["doc_id"] == pl.read_parquet(corpus).schema["id"]
    assert frame.join(pl.read_parquet(corpus), left_on="doc_id", right_on="id").height == 10


def test_the_api_runs_under_this_installations_settings_file(tmp_path, tiny_model_dir,
                                                             prefect_api, monkeypatch):
    out = embedded_set(tmp_path, tiny_model_dir)
    settings = tmp_path / "embedpipe.toml"
    settings.write_text("lease_ttl = 600\n")
    monkeypatch.setenv("EMBEDPIPE_CONFIG", str(settings))
    monkeypatch.setenv("EMBEDPIPE_LEASE_TTL", "60")
    monkeypatch.delenv("EMBEDPIPE_LEASE_TTL")  # unset here, and again after the test
    [result] = embedpipe.index(str(out), kind="flat")
    assert result.action == "built"
    assert json.loads((Path(out) / "_LEASE.json").read_text())["ttl"] == 600  # not 60


def test_each_api_call_runs_under_the_settings_file_named_at_the_call(tmp_path, monkeypatch):
    """A file's lease TTL and S3 endpoint, exported for the modules that read them from the
    environment, stayed there: a later call under another file (or none) kept the first's,
    since the environment wins over a file."""
    from pipeline.lease import lease_ttl

    for var in ("EMBEDPIPE_LEASE_TTL", "EMBEDPIPE_S3_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    seen = []
    for ttl in (5, 30, None):
        if ttl is None:
            monkeypatch.delenv("EMBEDPIPE_CONFIG")
        else:
            settings = tmp_path / f"{ttl}.toml"
            settings.write_text(f'lease_ttl = {ttl}\ns3_endpoint = "http://127.0.0.1:{ttl}"\n')
            monkeypatch.setenv("EMBEDPIPE_CONFIG", str(settings))
        with pytest.raises(embedpipe.EmbedpipeError):
            embedpipe.read_set(str(tmp_path / "no-out"), "mean")  # settings applied, then out
        seen.append((lease_ttl(), os.environ.get("EMBEDPIPE_S3_ENDPOINT")))
    assert seen[:2] == [(5, "http://127.0.0.1:5"), (30, "http://127.0.0.1:30")]
    assert seen[2][1] is None and seen[2][0] not in (5, 30)


def test_read_set_is_a_polars_frame_of_the_set(tmp_path, tiny_model_dir):
    out = embedded_set(tmp_path, tiny_model_dir)
    frame = embedpipe.read_set(str(out), "mean").collect()
    assert frame.columns == ["id", "embedding"]
    assert sorted(frame["id"].to_list()) == list(range(100, 120))


def test_read_set_names_a_part_whose_ids_are_not_the_sets_type(tmp_path, tiny_model_dir):
    """Polars failed to stack it at collect, naming no file."""
    out = embedded_set(tmp_path, tiny_model_dir)
    folder = SetFolder(str(out), "mean")
    url = folder.part_urls()[-1]
    table = pq.read_table(url)
    pq.write_table(table.set_column(0, "id", table.column("id").cast(pa.int32())), url)
    with pytest.raises(embedpipe.EmbedpipeError,
                       match=f"^{url}: its ids are int32, not the set's int64$"):
        embedpipe.read_set(out, "mean")


def test_paths_may_be_pathlib_and_names_a_single_str(tmp_path, tiny_model_dir):
    """``read_set``, ``search`` and ``evaluate`` raised AttributeError on a ``Path``; a str
    for ``sets`` was split into one-letter set names."""
    out = embedded_set(tmp_path, tiny_model_dir)
    index_set(IndexRequest(out=str(out), set_name="mean"), say=lambda _: None)
    assert embedpipe.read_set(out, "mean").collect().height == 20
    assert embedpipe.search(out, TEXTS[3], k=1)[0][0].id == 103
    assert len(embedpipe.search(out, TEXTS[3], k=np.int64(3))[0]) == 3  # a numpy count
    queries = tmp_path / "q.parquet"
    pq.write_table(pa.table({"query": TEXTS[:4], "doc_id": [100, 101, 102, 103]}), queries)
    [scores] = embedpipe.evaluate(out, queries, sets="mean", ranks_out=tmp_path / "r.parquet")
    assert (scores.set, scores.scores["recall@1"]) == ("mean", 1.0)
    assert pq.read_table(tmp_path / "r.parquet").num_rows == 4


@pytest.mark.parametrize("call, reason", [
    (lambda t: embedpipe.embed(pl.DataFrame({"id": [1], "text": ["a"]}), str(t / "o")),
     "corpus must be a path or URL (str or pathlib.Path), not DataFrame"),
    (lambda t: embedpipe.embed(str(t / "c.parquet"), None),
     "out must be a path or URL (str or pathlib.Path), not NoneType"),
    (lambda t: embedpipe.search(str(t / "o"), None),
     "queries must be a str or a list of texts, not NoneType"),
    (lambda t: embedpipe.evaluate(str(t / "o"), str(t / "q.parquet"), sets=3),
     "sets must be a str or a list of names, not int"),
    # a set's order is none: the answers came back in whichever order it iterated
    (lambda t: embedpipe.search(str(t / "o"), {"a", "b"}),
     "queries must be a str or a list of texts, not a set (unordered)"),
    (lambda t: embedpipe.search(str(t / "o"), "a", k=np.bool_(True)),
     "-k must be an integer between 1 and 1000, got np.True_"),
    # "" was taken for the working folder: "OUT o lies inside the corpus <cwd>"
    (lambda t: embedpipe.embed("", str(t / "o")),
     "invalid embedding job: corpus: Value error, is empty: name a local path or an s3:// URL"),
    (lambda t: embedpipe.embed(str(t / "c.parquet"), " "),
     "invalid embedding job: out: Value error, is empty: name a local path or an s3:// URL"),
])
def test_arguments_of_the_wrong_kind_are_one_line_naming_them(tmp_path, call, reason):
    with pytest.raises(embedpipe.EmbedpipeError) as refused:
        call(tmp_path)
    assert str(refused.value) == reason
    assert not (tmp_path / "None").exists()  # out=None made a folder named None


# --- eval -k 5 against a hand computation ---------------------------------------------------

def _hand_metrics(rank_lists: list[list[int | None]], k: int) -> dict[str, float]:
    """The textbook formulas, one query at a time (rank None: not returned)."""
    recall1, recall, mrr, ndcg = [], [], [], []
    for ranks in rank_lists:
        hit = sorted(r for r in ranks if r is not None and r <= k)
        recall1.append(sum(r == 1 for r in hit) / len(ranks))
        recall.append(len(hit) / len(ranks))
        mrr.append(1 / hit[0] if hit else 0.0)
        ideal = sum(1 / math.log2(i + 2) for i in range(min(len(ranks), k)))
        ndcg.append(sum(1 / math.log2(r + 1) for r in hit) / ideal)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"recall@1": mean(recall1), f"recall@{k}": mean(recall), f"mrr@{k}": mean(mrr),
            f"ndcg@{k}": mean(ndcg)}


def test_eval_k5_labels_values_exact_index_and_ranks_file(tmp_path, tiny_model_dir, capsys):
    out = embedded_set(tmp_path, tiny_model_dir)
    index_set(IndexRequest(out=str(out), set_name="mean"), say=lambda _: None)
    # Each query has two relevant docs: its own text and the doc 7 places on (rarely top 5).
    queries = TEXTS[:8]
    relevant = {q: [100 + i, 100 + (i + 7) % 20] for i, q in enumerate(queries)}
    pq.write_table(pa.table({"query": [q for q in queries for _ in relevant[q]],
                             "doc_id": [d for q in queries for d in relevant[q]]}),
                   tmp_path / "q.parquet")
    # The hand computation: brute-force ranks of every relevant doc from the vectors.
    from pipeline.embedder import get_embedder

    emb = get_embedder(EncoderConfig(model=str(tiny_model_dir), dtype="fp32", device="cpu"),
                       [PoolerSpec(name="mean")])
    docs, q_vectors = emb.encode(TEXTS, "mean"), emb.encode(queries, "mean")
    order = np.argsort(-(q_vectors @ docs.T), axis=1, kind="stable")
    rank_of = [{100 + int(d): r + 1 for r, d in enumerate(row[:5])} for row in order]
    hand_ranks = [[rank_of[i].get(d) for d in relevant[q]] for i, q in enumerate(queries)]
    expected = _hand_metrics(hand_ranks, 5)
    assert 0 < expected["recall@5"] < 1, "the example should have hits and misses"

    outputs = {}
    for flag in ("--exact", "--no-exact"):
        ranks = tmp_path / f"ranks{flag}.parquet"
        assert main(["eval", str(out), str(tmp_path / "q.parquet"), "-k", "5", flag,
                     "--out", str(ranks), "--json"]) == 0
        (result,) = json.loads(capsys.readouterr().out)
        assert list(result["scores"]) == ["recall@1", "recall@5", "mrr@5", "ndcg@5"]
        assert result["scores"] == pytest.approx(expected, abs=1e-6)
        frame = pl.read_parquet(ranks)
        got = {(row["query"], int(row["doc_id"])): row["rank"] for row in frame.to_dicts()}
        assert got == {(q, d): r for q, hand in zip(queries, hand_ranks, strict=True)
                       for d, r in zip(relevant[q], hand, strict=True)}
        outputs[flag] = result["search"]
    assert outputs == {"--exact": "exact", "--no-exact": "index"}
    assert main(["eval", str(out), str(tmp_path / "q.parquet"), "-k", "5"]) == 0
    head, row = capsys.readouterr().out.splitlines()
    assert head.split() == ["set", "queries", "search", "recall@1", "recall@5", "mrr@5",
                            "ndcg@5"]
    assert row.split()[:3] == ["mean", "8", "exact"]


# --- query --url: a running server answers ------------------------------------------------

@pytest.mark.slow
def test_query_url_asks_a_running_server(tmp_path, tiny_model_dir):
    out = embedded_set(tmp_path, tiny_model_dir)
    index_set(IndexRequest(out=str(out), set_name="mean"), say=lambda _: None)
    env = ENV | {"EMBEDPIPE_API_KEY": "test-key-123"}  # the server needs it; the client sends it
    with serving(out, "--max-k", "5", env=env) as (base, _, _):
        done, _ = _cli("query", "--url", base, TEXTS[4], "-k", "2", "--json", env=env)
        assert done.returncode == 0, done.stderr
        answer = json.loads(done.stdout)
        assert answer["set"] == "mean" and answer["query"] == TEXTS[4]
        assert [h["id"] for h in answer["results"]][0] == 104
        assert answer["results"][0]["snippet"] == TEXTS[4]
        # no -k: the server's default, its max_k where that is under 10 (was a 422, k=10)
        done, _ = _cli("query", "--url", base, TEXTS[4], "--json", env=env)
        assert done.returncode == 0, done.stderr
        assert len(json.loads(done.stdout)["results"]) == 5
        refused, _ = _cli("query", "--url", base, TEXTS[4], env=ENV)  # no key: 401, one line
        assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1
    done, _ = _cli("query", "--url", base, "anything")
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"embedpipe query: error: cannot reach {base}/search")


@pytest.mark.parametrize(("user", "spins"), [({}, "10000"), ({"GOMP_SPINCOUNT": "5"}, "5"),
                                              ({"OMP_WAIT_POLICY": "PASSIVE"}, None)])
def test_api_calls_let_openmp_spin_briefly_as_the_cli_does(tmp_path, user, spins):
    """A Python caller got libgomp's default spinning, 10-25x slower than the CLI on a shared
    2-core machine: every API call now sets GOMP_SPINCOUNT before torch loads (a user's own
    setting wins)."""
    code = ("import os, sys, embedpipe\n"
            "try:\n    embedpipe.search(sys.argv[1], 'q')\n"
            "except embedpipe.EmbedpipeError:\n    pass\n"
            "print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "nothing")], env=env | user,
                          capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == [str(spins), "False"]


@pytest.mark.slow
def test_the_dask_runner_keeps_the_terminal_quiet(tmp_path, tiny_model_dir, prefect_api):
    """A local Dask cluster's scheduler, nanny and workers logged ~30 INFO lines on stderr."""
    corpus = tmp_path / "corpus"
    _write(corpus, "a.parquet", list(range(100, 120)), TEXTS)
    done, _ = _cli("embed", str(corpus), str(tmp_path / "out"), "--model", str(tiny_model_dir),
                   "--dtype", "fp32", "--device", "cpu", "--runner", "dask", "--workers", "1",
                   "--rows-per-shard", "10")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("embedded 20 rows")
    assert "distributed" not in done.stderr and " INFO " not in done.stderr, done.stderr


@pytest.mark.parametrize("options, reason", [
    ({"lease_wait": -5}, "lease_wait -5 is not a number of seconds >= 0"),
    ({"lease_wait": "soon"}, "lease_wait 'soon' is not a number of seconds >= 0"),
    ({"lease_wait": float("nan")}, "lease_wait nan is not a number of seconds >= 0"),
    ({"set_name": 5}, "set_name 5 is not a set's name"),
    ({"kind": " "}, "index kind ' ' is not auto, flat, hnsw, ivf, ivfsq, ivfpq or a FAISS"),
    ({"kind": 5}, "index kind 5 is not auto, flat, hnsw, ivf, ivfsq, ivfpq or a FAISS"),
    ({"memory_budget": "lots"}, "memory budget 'lots' is not a size like 4GB"),
])
def test_index_options_are_checked_before_any_orchestration(tmp_path, monkeypatch, options,
                                                            reason):
    """Prefect's multi-line ParameterTypeError (after a temporary server started), or a
    negative lease wait taken, before."""
    def started():
        raise AssertionError("orchestration started")

    monkeypatch.setattr(embedpipe, "_orchestration", started)
    with pytest.raises(embedpipe.EmbedpipeError, match=reason) as refused:
        embedpipe.index(str(tmp_path / "out"), **options)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("poolers", [[{"name": "c", "strategy": "cls"}], [["mean"]], ["mean", 1]])
def test_poolers_named_by_anything_but_str_are_one_line(tmp_path, monkeypatch, poolers):
    """A dict or a list raised a bare TypeError (unhashable type) from the job's assembly."""
    monkeypatch.setattr(embedpipe, "_orchestration", lambda: pytest.fail("orchestration"))
    _write(tmp_path / "c", "a.parquet", list(range(100, 120)), TEXTS)
    for call in (embedpipe.embed, embedpipe.backfill):
        with pytest.raises(embedpipe.EmbedpipeError, match="poolers are named by str") as err:
            call(str(tmp_path / "c"), str(tmp_path / "out"), poolers=poolers)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("kind", ["FLAT", "Flat", " flat "])
def test_an_index_kind_is_its_name_in_any_case(tmp_path, tiny_model_dir, prefect_api, kind):
    """FAISS spells its flat index "Flat": it was refused as an unknown kind, inside the flow
    and after Prefect's tracebacks."""
    _write(tmp_path / "c", "a.parquet", list(range(100, 120)), TEXTS)
    out = str(tmp_path / "out")
    embedpipe.embed(str(tmp_path / "c"), out, poolers=["mean"], model=str(tiny_model_dir),
                    dtype="fp32", device="cpu")
    [result] = embedpipe.index(out, kind=kind)
    assert (result.meta.kind, result.meta.rows, result.action) == ("flat", 20, "built")
    [again] = embedpipe.index(out, kind="flat")
    assert again.action == "up to date"  # the same kind: nothing to rebuild


@pytest.mark.parametrize(("options", "says"), [
    ({"window": 1000, "stride": 500}, "window size 1000 is above the tokens model .* reads \\("),
    ({"window": 40, "stride": 20, "max_length": 32}, "window size 40 is above max_length \\(32\\)"),
])
def test_a_window_wider_than_the_model_reads_is_refused_before_orchestration(
        tmp_path, tiny_model_dir, monkeypatch, options, says):
    """It failed at the model's load inside the flow, after Prefect's traceback."""
    monkeypatch.setattr(embedpipe, "_orchestration", lambda: pytest.fail("orchestration"))
    _write(tmp_path / "c", "a.parquet", list(range(100, 120)), TEXTS)
    with pytest.raises(embedpipe.EmbedpipeError, match=says) as err:
        embedpipe.embed(str(tmp_path / "c"), str(tmp_path / "out"), model=str(tiny_model_dir),
                        dtype="fp32", device="cpu", **options)
    assert "\n" not in str(err.value)
