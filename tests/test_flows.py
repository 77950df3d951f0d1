"""The embed, backfill and nightly flows on Prefect's ephemeral API with the tiny model."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _flowkit import job, out_digest, read_set, same_vectors, text_for, tree_digest, write_corpus

from flows.embed import ShardFailed, backfill_flow, embed_flow, nightly_flow
from pipeline import faults, storage
from pipeline.config import EmbedJob
from pipeline.embedder import get_embedder
from pipeline.errors import ConfigError, CorpusError
from pipeline.sets import SetFolder, list_sets, part_name

TWO_SETS = [{"name": "mean"}, {"name": "cls", "layers": [-1, -2]}]


@pytest.fixture(scope="module", autouse=True)
def harness(prefect_api):
    """Every test here runs flows on the session's Prefect test API."""
    yield


def make_corpus(folder) -> list[int]:
    """Two files, 60 rows, 3 invalid; returns the valid ids."""
    ids = list(range(45))
    texts = [text_for(i) for i in ids]
    texts[7], texts[26] = None, "   "
    write_corpus(folder / "a.parquet", ids, texts)
    more = list(range(100, 115))
    more_texts = [text_for(i) for i in more]
    more_texts[3] = ""
    write_corpus(folder / "b.parquet", more, more_texts)
    return [i for i in ids + more if i not in (7, 26, 103)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    return folder, make_corpus(folder)


@pytest.fixture(scope="module")
def reference(corpus, tiny_model_dir, tmp_path_factory):
    """An uninterrupted run of the threads runner: the vectors every other run must match."""
    out = tmp_path_factory.mktemp("ref")
    summary = embed_flow(job(corpus[0], out, tiny_model_dir, poolers=TWO_SETS, workers=2))
    return out, summary, {name["name"]: read_set(out, name["name"]) for name in TWO_SETS}


def test_embed_writes_every_valid_row_once_with_metadata(corpus, reference, tiny_model_dir):
    folder, valid = corpus
    out, summary, vectors = reference
    assert summary["rows"] == len(valid) == 57 and summary["embedded"] == 57
    assert summary["shards"] == 4 and summary["shards_run"] == 4
    assert summary["skipped"] == {"null_text": 1, "empty_text": 2}
    embedder = get_embedder(EmbedJob.model_validate(job(folder, out, tiny_model_dir)).encoder,
                            EmbedJob.model_validate(job(folder, out, tiny_model_dir,
                                                        poolers=TWO_SETS)).poolers)
    for spec in TWO_SETS:
        name = spec["name"]
        assert sorted(vectors[name]) == sorted(valid)
        meta = SetFolder(str(out), name).read_meta()
        assert meta.fingerprint == embedder.fingerprint(name)
        assert (meta.model, meta.model_hash) == (str(tiny_model_dir), embedder.info.model_hash)
        assert meta.dim == 32 and meta.dtype == "fp32" and meta.normalize
        assert meta.pooler["strategy"] == name and meta.max_length == 128
        assert (meta.shards_done, meta.rows_written, meta.generation) == (4, 57, 1)
        assert meta.rows_skipped == {"null_text": 1, "empty_text": 2}
        parts = sorted(p.name for p in (out / "sets" / name).glob("part-*.parquet"))
        changes = storage.read_json(SetFolder(str(out), name).changes_url(1))
        assert changes == {"generation": 1, "parts": parts, "deleted_ids": []}
    assert not np.allclose(vectors["mean"][0], vectors["cls"][0])


def test_rerun_of_a_finished_job_is_a_no_op(corpus, reference, tiny_model_dir):
    out, _, _ = reference
    before = out_digest(out)
    summary = embed_flow(job(corpus[0], out, tiny_model_dir, poolers=TWO_SETS, workers=2))
    assert summary["shards_run"] == 0 and summary["embedded"] == 0 and summary["rows"] == 57
    assert summary["generation"] == {"mean": 1, "cls": 1}
    assert out_digest(out) == before


def test_resume_after_a_failure_mid_run(corpus, reference, tiny_model_dir, tmp_path, monkeypatch):
    folder, valid = corpus
    spec = job(folder, tmp_path / "out", tiny_model_dir, poolers=TWO_SETS, workers=1)
    # the 3rd part write and every later one fail, retries included: 1 shard done, 1 half done
    monkeypatch.setenv(faults.ENV, f"write_part:2:1000:{tmp_path / 'fp'}")
    expected = r"failed after 2 retries: InjectedFault.*rerun to resume"
    with pytest.raises(ShardFailed, match=expected):
        embed_flow(spec)
    done = {n: len(SetFolder(str(tmp_path / "out"), n).read_markers()) for n in ("mean", "cls")}
    assert done == {"mean": 1, "cls": 1}
    # bounded: 2 good writes, then 3 failing shards x (1 try + 2 retries)
    assert faults.hits(str(tmp_path / "fp"), "write_part") == 2 + 3 * 3
    monkeypatch.delenv(faults.ENV)
    summary = embed_flow(spec)
    assert summary["shards_run"] == 3 and summary["rows"] == 57
    for name, ref in reference[2].items():
        # the reference ran 2 workers (1 torch thread each), this run 1 (2 threads): sums in
        # another order, so equal to float rounding
        assert same_vectors(read_set(tmp_path / "out", name), ref, atol=1e-6)
        meta = SetFolder(str(tmp_path / "out"), name).read_meta()
        assert (meta.shards_done, meta.rows_written, meta.generation) == (4, 57, 1)
        changes = storage.read_json(SetFolder(str(tmp_path / "out"), name).changes_url(1))
        assert len(changes["parts"]) == 4  # the changes file covers both attempts


def test_transient_errors_are_retried_by_prefect(corpus, reference, tiny_model_dir, tmp_path,
                                                 monkeypatch):
    monkeypatch.setenv(faults.ENV, f"write_part:1:1:{tmp_path / 'fp'}")
    summary = embed_flow(job(corpus[0], tmp_path / "out", tiny_model_dir, workers=1))
    assert summary["shards_run"] == 4 and summary["rows"] == 57
    assert faults.hits(str(tmp_path / "fp"), "write_part") == 5  # 4 shards + 1 retry
    assert same_vectors(read_set(tmp_path / "out", "mean"), reference[2]["mean"], atol=1e-6)


def test_nightly_embeds_only_new_and_changed_rows(corpus, tiny_model_dir, tmp_path):
    src = tmp_path / "corpus"
    shutil.copytree(corpus[0], src)
    out = tmp_path / "out"
    embed_flow(job(src, out, tiny_model_dir))
    # change 2 texts, delete 4 rows at the end of a.parquet, add 10 rows to b, add a file c
    table = pq.read_table(src / "a.parquet").slice(0, 41)
    texts = table.column("text").to_pylist()
    texts[3], texts[17] = "a changed text", "another changed text"
    write_corpus(src / "a.parquet", table.column("id").to_pylist(), texts)
    b = pq.read_table(src / "b.parquet")
    new_b = list(range(115, 125))
    write_corpus(src / "b.parquet", b.column("id").to_pylist() + new_b,
                 b.column("text").to_pylist() + [text_for(i) for i in new_b])
    write_corpus(src / "c.parquet", list(range(200, 210)), [text_for(i) for i in range(10)])
    summary = nightly_flow(job(src, out, tiny_model_dir))
    assert summary["embedded"] == 2 + 10 + 10
    assert summary["rows"] == 57 - 4 + 20 and summary["removed"] == 4
    assert summary["generation"] == {"mean": 2}
    changes = storage.read_json(SetFolder(str(out), "mean").changes_url(2))
    assert changes["deleted_ids"] == [41, 42, 43, 44]
    assert changes["parts"] == sorted(
        part_name(s)
        for s in SetFolder(str(out), "mean").read_markers()
        if not s.endswith("g00002-00004") or not s.startswith("a-")
    )
    fresh = tmp_path / "fresh"
    embed_flow(job(src, fresh, tiny_model_dir))
    assert same_vectors(read_set(out, "mean"), read_set(fresh, "mean"), atol=1e-5)
    meta = SetFolder(str(out), "mean").read_meta()
    assert meta.rows_written == 73 and meta.generation == 2
    before = out_digest(out)
    again = nightly_flow(job(src, out, tiny_model_dir))
    assert again["embedded"] == 0 and again["generation"] == {"mean": 2}
    assert out_digest(out) == before


def test_nightly_records_a_deleted_file(corpus, tiny_model_dir, tmp_path):
    src = tmp_path / "corpus"
    shutil.copytree(corpus[0], src)
    out = tmp_path / "out"
    embed_flow(job(src, out, tiny_model_dir))
    (src / "b.parquet").unlink()
    summary = nightly_flow(job(src, out, tiny_model_dir))
    changes = storage.read_json(SetFolder(str(out), "mean").changes_url(2))
    assert changes["parts"] == [] and sorted(changes["deleted_ids"]) == [
        i for i in range(100, 115) if i != 103
    ]
    assert summary["embedded"] == 0 and sorted(read_set(out, "mean")) == [
        i for i in range(45) if i not in (7, 26)
    ]


def test_backfill_adds_sets_and_leaves_existing_ones_byte_identical(corpus, tiny_model_dir,
                                                                    tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match="has no sets to backfill"):
        backfill_flow(job(corpus[0], out, tiny_model_dir, poolers=[{"name": "max"}]))
    embed_flow(job(corpus[0], out, tiny_model_dir))
    before = tree_digest(out / "sets" / "mean")
    summary = backfill_flow(job(corpus[0], out, tiny_model_dir, poolers=[{"name": "max"}]))
    assert summary["rows"] == 57 and summary["sets"] == ["max"]
    assert tree_digest(out / "sets" / "mean") == before
    assert sorted(read_set(out, "max")) == sorted(corpus[1])
    assert list_sets(str(out)) == ["max", "mean"]


@pytest.mark.slow
@pytest.mark.parametrize("runner", ["processes", "dask"])
def test_process_and_dask_runners_match_threads(corpus, reference, tiny_model_dir, tmp_path,
                                                runner):
    spec = job(corpus[0], tmp_path / "out", tiny_model_dir, poolers=TWO_SETS, runner=runner,
               workers=2)
    summary = embed_flow(spec)
    assert summary["shards_run"] == 4 and summary["rows"] == 57
    for name, ref in reference[2].items():
        assert same_vectors(read_set(tmp_path / "out", name), ref, atol=1e-6)


@pytest.mark.slow
def test_a_worker_process_that_dies_is_named_and_the_rerun_finishes(
        corpus, reference, tiny_model_dir, tmp_path, monkeypatch):
    """A SIGKILLed worker takes its task's retries with it: the error said "failed after 2
    retries", none of which ran."""
    spec = job(corpus[0], tmp_path / "out", tiny_model_dir, runner="processes", workers=1)
    monkeypatch.setenv(faults.ENV, f"write_marker:1:1:{tmp_path / 'fp'}:kill")
    with pytest.raises(ShardFailed, match=r"shard \S+ its worker process died \(killed, or out "
                                          r"of memory\): BrokenProcessPool: .*rerun to resume"):
        embed_flow(spec)
    monkeypatch.delenv(faults.ENV)
    summary = embed_flow(spec)
    assert summary["rows"] == 57 and 0 < summary["shards_run"] < 4
    assert same_vectors(read_set(tmp_path / "out", "mean"), reference[2]["mean"], atol=1e-6)


def test_cli_embed_prints_a_summary_and_fails_in_one_line(corpus, tiny_model_dir, tmp_path,
                                                          capsys, monkeypatch):
    from flows.cli import main

    for var in ("PREFECT_LOGGING_LEVEL", "PREFECT_SERVER_ANALYTICS_ENABLED",
                "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS",
                "PREFECT_LOGGING_LOGGERS_PREFECT_FLOW_RUNS_LEVEL",
                "PREFECT_LOGGING_LOGGERS_PREFECT_TASK_RUNS_LEVEL"):
        monkeypatch.delenv(var, raising=False)  # restored after the test
    config = tmp_path / "job.toml"
    config.write_text(
        'rows_per_shard = 30\n[encoder]\ndtype = "fp32"\ndevice = "cpu"\n'
        '[[poolers]]\nname = "cls_last2"\nstrategy = "cls"\nlayers = [-1, -2]\n'
    )
    args = ["embed", str(corpus[0]), str(tmp_path / "out"), "--model", str(tiny_model_dir),
            "--config", str(config)]
    assert main([*args, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)  # one JSON object, nothing else on stdout
    assert summary["line"].startswith("embedded 57 rows") and "[cls_last2]" in summary["line"]
    assert "skipped 3 rows (empty_text 2, null_text 1)" in summary["line"]
    assert summary["stats"]["embedded"] == 57 and summary["skipped"] == {
        "empty_text": 2, "null_text": 1}
    assert set(summary["stats"]["seconds"]) == {"read", "tokenize", "encode", "write"}
    meta = SetFolder(str(tmp_path / "out"), "cls_last2").read_meta()
    assert meta.pooler["layers"] == [-1, -2] and meta.shards_done == 3
    assert main(args) == 0  # a rerun: the summary line, nothing to do
    line = capsys.readouterr().out.strip()
    assert line.startswith("embedded 0 rows (0 reused, 0 removed); 57 rows in 1 set(s)")
    assert "0/3 shards run" in line
    assert main(["backfill", *args[1:3], "--pooler", "mean", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["line"].startswith("backfilled 57 rows") and summary["sets"] == ["mean"]
    assert main(args[:5] + ["--text-column", "body"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("embedpipe embed: error: ")
    assert "has no column 'body' (its columns: id, text)" in err[-1]


def test_schedule_builds_a_cron_deployment(tmp_path, tiny_model_dir):
    from prefect import get_client

    from flows.schedule import nightly_deployment
    from pipeline.assembly import job_params

    spec = EmbedJob.model_validate(job(tmp_path / "c", tmp_path / "out", tiny_model_dir))
    deployment = nightly_deployment(spec, "0 2 * * *", name="test-nightly")
    assert deployment.parameters == {"job": job_params(spec)}  # settings fill the rest
    assert deployment.schedules[0].schedule.cron == "0 2 * * *"
    deployment_id = deployment.apply()
    with get_client(sync_client=True) as client:
        stored = client.read_deployment(deployment_id)
    assert stored.name == "test-nightly" and stored.schedules[0].schedule.cron == "0 2 * * *"
    # one run at a time: a night's run due while the last still runs waits for it
    assert stored.global_concurrency_limit.limit == 1
    assert stored.concurrency_options.collision_strategy == "ENQUEUE"
    assert stored.parameters["job"]["corpus"] == str(tmp_path / "c")
    with pytest.raises(ConfigError, match="invalid schedule --cron 'every night'"):
        nightly_deployment(spec, "every night")


def test_string_ids_round_trip(tiny_model_dir, tmp_path):
    ids = [f"doc-{i}" for i in range(25)]
    write_corpus(tmp_path / "a.parquet", ids, [text_for(i) for i in range(25)])
    embed_flow(job(tmp_path / "a.parquet", tmp_path / "out", tiny_model_dir))
    part = next((tmp_path / "out" / "sets" / "mean").glob("part-*.parquet"))
    assert pq.read_schema(part).field("id").type == pa.string()
    assert sorted(read_set(tmp_path / "out", "mean")) == sorted(ids)


def test_corrupt_row_group_fails_without_retries(tiny_model_dir, tmp_path, monkeypatch):
    """The footer is fine, a data page is not: the shard fails once, naming file and group."""
    path = tmp_path / "c" / "a.parquet"
    path.parent.mkdir()
    table = pa.table({"id": list(range(40)), "text": [text_for(i) * 5 for i in range(40)]})
    pq.write_table(table, path, row_group_size=20, use_dictionary=False, compression="snappy")
    column = pq.ParquetFile(path).metadata.row_group(1).column(1)
    start, size = column.data_page_offset, column.total_compressed_size
    data = bytearray(path.read_bytes())
    data[start + size // 4 : start + 3 * size // 4] = b"\xff" * (3 * size // 4 - size // 4)
    path.write_bytes(bytes(data))
    monkeypatch.setenv(faults.ENV, f"read_shard:1000:1:{tmp_path / 'fp'}")  # counts, never fails
    expected = r"corrupt Parquet file .*a\.parquet: row group 1"
    with pytest.raises(CorpusError, match=expected) as info:
        embed_flow(job(tmp_path / "c", tmp_path / "out", tiny_model_dir))
    assert "\n" not in str(info.value)
    assert faults.hits(str(tmp_path / "fp"), "read_shard") == 2  # no retry of the bad shard


def test_a_file_rewritten_in_place_with_rows_of_the_same_sizes_is_redone(
        tmp_path, tiny_model_dir):
    corpus, out = tmp_path / "c" / "a.parquet", tmp_path / "out"
    write_corpus(corpus, [f"id{i:02d}" for i in range(20)],
                 [f"text number {i:02d} alpha" for i in range(20)])
    embed_flow(job(corpus, out, tiny_model_dir))
    # other ids and texts of the same byte lengths: the same row groups, sizes and shard ids
    write_corpus(corpus, [f"XX{i:02d}" for i in range(20)],
                 [f"text number {i:02d} omega" for i in range(20)])
    summary = embed_flow(job(corpus, out, tiny_model_dir))  # a plain rerun, not --incremental
    assert (summary["shards_run"], summary["embedded"], summary["rows"]) == (1, 20, 20)
    clean = tmp_path / "clean"
    embed_flow(job(corpus, clean, tiny_model_dir))
    assert same_vectors(read_set(out, "mean"), read_set(clean, "mean"), atol=1e-6)
    assert embed_flow(job(corpus, out, tiny_model_dir))["shards_run"] == 0  # and then done


def test_markers_written_before_the_content_digest_still_count(tmp_path, tiny_model_dir):
    corpus = write_corpus(tmp_path / "c.parquet", list(range(20)), [text_for(i) for i in range(20)])
    out = tmp_path / "out"
    embed_flow(job(corpus, out, tiny_model_dir))
    folder = SetFolder(str(out), "mean")
    for marker in folder.read_markers().values():  # as an older embedpipe wrote them
        folder.write_marker(marker.model_copy(update={"content": None}))
    assert embed_flow(job(corpus, out, tiny_model_dir))["shards_run"] == 0  # no re-embedding


def test_flags_turn_off_what_the_config_file_turns_on(tmp_path):
    from flows.cli import build_parser
    from flows.cli.embed import _options
    from pipeline.assembly import build_job

    config = tmp_path / "job.toml"
    config.write_text("quarantine = true\ndedupe = true\n")
    args = build_parser().parse_args(["embed", "c.parquet", "out", "--config", str(config),
                                      "--no-quarantine", "--no-dedupe"])
    job_ = build_job(args.corpus, args.out, config=args.config, **_options(args))
    assert (job_.quarantine, job_.dedupe) == (False, False)
    args = build_parser().parse_args(["embed", "c.parquet", "out", "--config", str(config)])
    job_ = build_job(args.corpus, args.out, config=args.config, **_options(args))
    assert (job_.quarantine, job_.dedupe) == (True, True)


@pytest.mark.parametrize("text, reason", [
    ('poolers = "mean"', r"poolers must be \[\[poolers\]\] tables, each with a name"),
    ("poolers = [1, 2]", r"poolers must be \[\[poolers\]\] tables"),
    ('encoder = "x"', r"encoder must be a table \(\[encoder\]\), not 'x'"),
    ('[[poolers]]\nname = "a"\nstrategy = "mean"\n[[poolers]]\nname = "a"\nstrategy = "cls"',
     r"\[\[poolers\]\] name 'a' is defined twice"),
    ("max_length = 48\n[encoder]\nmax_length = 32",
     r"max_length is given both at the top level and in \[encoder\]; keep one"),
    ('corpus = "elsewhere.parquet"', r"corpus come\(s\) from the command line"),
])
def test_a_config_file_of_the_wrong_shape_is_one_line(tmp_path, text, reason):
    """Config files a user gets wrong: a traceback (AttributeError, ValueError) before, or
    silently taken (the second pooler of a name kept, the top-level length winning, a corpus
    key ignored)."""
    from pipeline.assembly import build_job

    config = tmp_path / "job.toml"
    config.write_text(text + "\n")
    with pytest.raises(ConfigError, match=reason) as info:
        build_job("c.parquet", "out", config=str(config))
    assert str(info.value).startswith(f"{config}: ") and "\n" not in str(info.value)


def test_indexing_a_set_that_is_not_there_leaves_out_untouched(tmp_path, capsys):
    """A mistyped OUT or set name: one line, and no OUT folder or lease files made for it."""
    from flows.cli import main

    out = tmp_path / "typo" / "out"
    assert main(["index", str(out), "--set", "x"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("embedpipe index: error: no set 'x' under ")
    assert not (tmp_path / "typo").exists()
