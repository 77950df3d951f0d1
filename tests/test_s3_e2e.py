"""The real flows against a real S3 API server on loopback (moto, server mode).

embed s3://bucket/corpus/ -> s3://bucket/out/ with an upload that dies half-way (the server
fails it; the client's real retries give up), resume, backfill, index and query, and the same
job run on local paths gives the same vectors.

How the failure is injected: the fault layer in front of moto (tests/_s3.py) reads half the
body of the matching PUT and answers 500 InternalError, for every attempt while armed. The
flow, storage, s3fs and botocore are untouched: they see what they would see if S3 failed
the upload. (moto's IAM mode could deny the PUT instead, but moto 5.2 then also rejects
every prefix listing with a bad-signature error, so a run could not get as far as uploading.)
"""

from __future__ import annotations

import contextlib
import io
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline import storage
from pipeline.corpus import describe
from pipeline.errors import EmbedpipeError
from pipeline.sets import SetFolder, list_sets
from pipeline.shards import plan_shards

pytestmark = pytest.mark.slow

WORDS = ["vector", "index", "shard", "parquet", "pooler", "encoder", "token", "bucket",
         "upload", "query", "model", "batch", "window", "layer", "flow", "worker", "cluster"]


def corpus_table(start: int, rows: int) -> pa.Table:
    rng = np.random.default_rng(start)
    texts = [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 12)))) for _ in range(rows)]
    return pa.table({"id": pa.array(range(start, start + rows), pa.int64()), "text": texts})


def write_corpus(root: str) -> list[int]:
    """Two Parquet files of three 16-row groups each, written through storage (so: S3 too)."""
    ids: list[int] = []
    for i, name in enumerate(("a.parquet", "b.parquet")):
        table = corpus_table(1000 * i, 48)
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, row_group_size=16)
        storage.write_bytes(storage.join(root, "corpus", name), sink.getvalue().to_pybytes())
        ids += table.column("id").to_pylist()
    return ids


def job(root: str, model: Path, poolers: list[str]) -> dict:
    return {
        "corpus": storage.join(root, "corpus") + "/",
        "out": storage.join(root, "out") + "/",
        "encoder": {"model": str(model), "device": "cpu", "dtype": "fp32"},
        "poolers": [{"name": p} for p in poolers],
        "rows_per_shard": 16,
    }


def set_rows(out: str, name: str) -> dict[int, np.ndarray]:
    """Every live row of a set, read the way the index reads it: all parts of the set."""
    rows: dict[int, np.ndarray] = {}
    for url in storage.list_files(SetFolder(out, name).url, ".parquet"):
        table = storage.read_parquet(url)
        dim = table.schema.field("embedding").type.list_size
        vectors = table.column("embedding").combine_chunks().values.to_numpy().reshape(-1, dim)
        for ident, vector in zip(table.column("id").to_pylist(), vectors, strict=True):
            assert ident not in rows, f"id {ident} in two parts of {name}"
            rows[ident] = vector
    return rows


def uploads_since(s3_server, mark: int) -> list[str]:
    return s3_server.faults.uploads[mark:]


def cli_json(capsys, argv: list[str]):
    """Run ``embedpipe ARGV`` in this process; its stdout parsed as JSON."""
    from flows.cli import main

    capsys.readouterr()
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


@contextmanager
def serving(out: str, set_name: str) -> Iterator[str]:
    """The query server app for ``out`` under uvicorn on 127.0.0.1 (a free port), in a thread."""
    import uvicorn

    from pipeline.server import ServerConfig, create_app

    app = create_app(ServerConfig(out=out, sets=(set_name,)))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:  # a start-up wait, not a timing assertion
            if not thread.is_alive():
                raise RuntimeError("the query server did not start")
            time.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def test_embed_resume_backfill_index_query_on_s3(s3_server, s3_bucket, tiny_model_dir,
                                                 prefect_api, tmp_path, monkeypatch,
                                                 capsys) -> None:
    from flows.embed import backfill_flow, embed_flow, nightly_flow
    from flows.index import index_flow

    root = f"s3://{s3_bucket}"
    out = storage.join(root, "out")
    ids = write_corpus(root)

    # 1. the upload of one shard's `cls` part dies half-way, on every attempt: the run fails
    shards = plan_shards(describe(storage.join(root, "corpus"), "id", "text").files, 16)
    assert len(shards) == 6
    victim = shards[2].id
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # the client gives up at once (no backoff)
    mark = len(s3_server.faults.uploads)
    with s3_server.faults.failing_uploads(f"{s3_bucket}/out/sets/cls/part-{victim}") \
            as fault, pytest.raises(EmbedpipeError) as exc:
        embed_flow(job(root, tiny_model_dir, ["mean", "cls"]))
    assert str(exc.value).startswith(f"cannot write s3://{s3_bucket}/out/sets/cls/part-")
    assert "\n" not in str(exc.value) and "internal error" in str(exc.value)
    assert fault.hits == 3  # the task's first try and its two retries
    monkeypatch.delenv("AWS_MAX_ATTEMPTS")

    # nothing partial: every marker's part is whole, the failed shard has no cls part at all
    cls_markers = SetFolder(out, "cls").read_markers()
    mean_markers = SetFolder(out, "mean").read_markers()
    failed = sorted(set(mean_markers) - set(cls_markers))
    assert failed == [victim], (sorted(mean_markers), sorted(cls_markers))
    assert sorted(mean_markers) == sorted(s.id for s in shards)  # the other shards finished
    assert not storage.exists(SetFolder(out, "cls").part_url(failed[0]))
    for name, markers in (("mean", mean_markers), ("cls", cls_markers)):
        for shard, marker in markers.items():
            assert storage.parquet_file(SetFolder(out, name).part_url(shard)).metadata.num_rows \
                == marker.rows
    assert s3_server.pending_multipart_uploads(s3_bucket) == []
    first_run = uploads_since(s3_server, mark)

    # 2. resume: only the failed shard's cls part is written again
    mark = len(s3_server.faults.uploads)
    summary = embed_flow(job(root, tiny_model_dir, ["mean", "cls"]))
    assert summary["shards_run"] == 1 and summary["rows"] == len(ids)
    parts = [k for k in uploads_since(s3_server, mark) if "/part-" in k]
    assert parts == [f"{s3_bucket}/out/sets/cls/part-{failed[0]}.parquet"]
    assert all(f"/sets/cls/part-{failed[0]}" not in k for k in first_run)
    for name in ("mean", "cls"):
        assert sorted(set_rows(out, name)) == sorted(ids)

    # 3. the same job on local paths gives the same vectors: S3 changes nothing
    local = str(tmp_path / "local")
    write_corpus(local)
    embed_flow(job(local, tiny_model_dir, ["mean", "cls"]))
    for name in ("mean", "cls"):
        on_s3, on_disk = set_rows(out, name), set_rows(storage.join(local, "out"), name)
        assert on_s3.keys() == on_disk.keys()
        for ident, vector in on_disk.items():
            np.testing.assert_array_equal(on_s3[ident], vector)

    # 4. backfill a new set next to the others; they are not rewritten
    mark = len(s3_server.faults.uploads)
    backfill_flow(job(root, tiny_model_dir, ["max"]))
    written = uploads_since(s3_server, mark)
    assert not [k for k in written if "/sets/mean/" in k or "/sets/cls/" in k]
    assert list_sets(out) == ["cls", "max", "mean"]
    assert sorted(set_rows(out, "max")) == sorted(ids)

    # a nightly run naming no pooler and no model re-reads every shard of every set in OUT
    # (their poolers and encoder from their _SET.json on S3); nothing changed: no part written
    mark = len(s3_server.faults.uploads)
    nightly = {k: v for k, v in job(root, tiny_model_dir, []).items() if k != "poolers"}
    summary = nightly_flow(nightly | {"encoder": {"device": "cpu", "dtype": "fp32"}})
    assert summary["sets"] == ["cls", "max", "mean"] and summary["embedded"] == 0
    assert not [k for k in uploads_since(s3_server, mark) if "/part-" in k]

    # 5. index every set: built locally from streamed parts, published to S3, marker last
    results = index_flow(out)
    assert sorted(r["meta"]["name"] for r in results) == ["cls", "max", "mean"]
    assert all(r["meta"]["rows"] == len(ids) for r in results)
    for name in ("cls", "max", "mean"):
        published = s3_server.keys(s3_bucket, f"out/index/{name}/")
        assert f"out/index/{name}/_INDEX.json" in published and len(published) >= 3
        marker = [k for k in s3_server.faults.uploads if k.endswith(f"index/{name}/_INDEX.json")]
        assert s3_server.faults.uploads.index(marker[-1]) > max(
            s3_server.faults.uploads.index(k) for k in s3_server.faults.uploads
            if f"/index/{name}/" in k and not k.endswith("_INDEX.json"))

    # 6. query and eval over S3 (index downloaded into the cache, snippets read from the
    # S3 corpus) answer exactly as the same commands over the local copy
    monkeypatch.setenv("EMBEDPIPE_CACHE", str(tmp_path / "cache"))
    index_flow(storage.join(local, "out"), "mean")
    text = corpus_table(1000, 48).column("text")[7].as_py()
    answers = {}
    for where in (out, storage.join(local, "out")):
        answers[where] = cli_json(capsys, ["query", where, text, "--set", "mean", "-k", "5",
                                           "--json"])
    on_s3, on_disk = answers[out]["results"], answers[storage.join(local, "out")]["results"]
    assert [h["id"] for h in on_s3] == [h["id"] for h in on_disk]
    np.testing.assert_allclose([h["score"] for h in on_s3], [h["score"] for h in on_disk],
                               rtol=1e-6)
    assert on_s3[0]["snippet"] == text and on_s3[0]["score"] == pytest.approx(1.0, abs=1e-4)
    assert any((tmp_path / "cache").rglob("*")), "the S3 index was not cached locally"

    with serving(out, "mean") as base:  # `embedpipe serve` over S3: a real HTTP round trip
        response = httpx.post(f"{base}/search", json={"query": text, "k": 5}, timeout=60)
    assert response.status_code == 200, response.text
    served = response.json()["results"][0]
    assert [h["id"] for h in served] == [h["id"] for h in on_s3]
    np.testing.assert_allclose([h["score"] for h in served], [h["score"] for h in on_s3],
                               rtol=1e-6)

    queries = f"s3://{s3_bucket}/eval/queries.parquet"
    table = corpus_table(0, 48).slice(0, 10)
    storage.write_parquet(queries, pa.table({"query": table.column("text"),
                                             "doc_id": table.column("id")}))
    report = cli_json(capsys, ["eval", out, queries, "--set", "mean", "--json"])
    assert len(report) == 1, report
    assert report[0]["queries"] == len(set(table.column("text").to_pylist()))
    assert report[0]["scores"]["recall@10"] == 1.0  # each text finds its own row


@pytest.fixture
def cli(prefect_api, tiny_model_dir):
    """Run ``embedpipe embed CORPUS OUT`` in this process; return (exit code, stderr text).

    stderr is caught by swapping ``sys.stderr`` for the call: that is where the CLI prints
    its reason (Prefect's own log handler may still hold the stream of an earlier test)."""
    from flows.cli import main

    def run(corpus: str, out: str) -> tuple[int, str]:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(["embed", corpus, out, "--model", str(tiny_model_dir),
                         "--dtype", "fp32", "--device", "cpu"])
        return code, err.getvalue()

    return run


@pytest.mark.parametrize("problem", ["missing bucket", "no parquet", "no credentials",
                                     "access denied"])
def test_cli_bad_s3_input_is_one_line_naming_the_url(problem, cli, s3_server, s3_bucket,
                                                     monkeypatch) -> None:
    out = f"s3://{s3_bucket}/out/"
    corpus = f"s3://{s3_bucket}/corpus/"
    write_corpus(f"s3://{s3_bucket}")
    storage.write_bytes(f"s3://{s3_bucket}/docs/README.txt", b"not a corpus")
    expected = {"missing bucket": "bucket 'no-such-bucket-embedpipe' does not exist",
                "no parquet": "no Parquet files under",
                "no credentials": "no AWS credentials found",
                "access denied": "access denied"}[problem]
    if problem == "missing bucket":
        corpus = "s3://no-such-bucket-embedpipe/corpus/"
    elif problem == "no parquet":
        corpus = f"s3://{s3_bucket}/docs/"
    elif problem == "no credentials":
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    else:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNKEY000000")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "NotARealSecretButStillSecret0000")
    if problem == "access denied":
        with s3_server.iam_enforced():
            code, err = cli(corpus, out)
    else:
        code, err = cli(corpus, out)
    assert code == 1
    reasons = [line for line in err.splitlines() if line.startswith("embedpipe embed: ")]
    assert len(reasons) == 1, err
    assert reasons[0].startswith("embedpipe embed: error: ") and expected in reasons[0], err
    assert corpus in reasons[0]
    assert "NotARealSecret" not in err
