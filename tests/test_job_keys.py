"""Sets made by the same job are planned without loading the model (pipeline.run.job_keys)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from _flowkit import job, read_set, run_library, same_vectors, text_for, write_corpus

import pipeline.embedder
from pipeline.config import EmbedJob, parse
from pipeline.embedder import get_embedder, preload
from pipeline.errors import EmbedpipeError, FingerprintError
from pipeline.job import embed_shard
from pipeline.run import finalize, needs_model, prepare
from pipeline.sets import SetFolder


def _never() -> None:
    raise AssertionError("the model was loaded")


def _plan(job_dict: dict, load=_never, verify: bool = False):
    spec = parse(EmbedJob, job_dict, "job")
    return spec, prepare(spec, load, verify=verify)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "c.parquet", list(range(40)), [text_for(i) for i in range(40)])


def test_same_job_plans_without_the_model_and_new_rows_still_embed(
        tmp_path: Path, corpus: Path, tiny_model_dir: Path, monkeypatch) -> None:
    params = job(corpus, tmp_path / "out", tiny_model_dir)
    run_library(params)
    meta = SetFolder(str(tmp_path / "out"), "mean").meta()
    assert meta.job_key

    _, plan = _plan(params)  # nothing to do: the model is never loaded
    assert plan.requests == []
    with monkeypatch.context() as patch:  # a nightly run re-reads every shard: still no model
        patch.setattr(pipeline.embedder, "get_embedder", lambda *a: _never())
        _, plan = _plan(params, verify=True)
        results = [embed_shard(r) for r in plan.requests]
        assert len(results) == 2 and sum(r.embedded for r in results) == 0
        assert sum(r.rows for r in results) == 40
        finalize(plan, results, 1.0)

    write_corpus(corpus, list(range(50)), [text_for(i) for i in range(50)])
    spec, plan = _plan(params)  # new rows: planned without the model, embedded by the workers
    assert [r.shard.rows for r in plan.requests] == [10]
    finalize(plan, [embed_shard(r) for r in plan.requests], 1.0)
    clean = tmp_path / "clean"
    run_library(job(corpus, clean, tiny_model_dir))
    assert same_vectors(read_set(tmp_path / "out", "mean"), read_set(clean, "mean"), atol=1e-6)


def test_another_job_loads_the_model_and_records_its_key(
        tmp_path: Path, corpus: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "out"
    params = job(corpus, out, tiny_model_dir)
    run_library(params)
    first = SetFolder(str(out), "mean").meta().job_key

    other = params | {"encoder": params["encoder"] | {"token_budget": 4096}}
    loaded = []

    def load():
        loaded.append(1)
        spec = parse(EmbedJob, other, "job")
        return get_embedder(spec.encoder, spec.poolers)

    _, plan = _plan(other, load)  # another key, same fingerprint: checked once, then recorded
    assert loaded == [1] and plan.requests == []
    second = SetFolder(str(out), "mean").meta().job_key
    assert second and second != first
    _plan(other)  # and known from then on


def test_changed_model_files_are_never_taken_for_the_same_job(
        tmp_path: Path, corpus: Path, tiny_model_dir: Path, monkeypatch) -> None:
    from conftest import build_tiny_bert

    monkeypatch.setattr(pipeline.embedder, "_CACHE", {})  # this process loads the new weights

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    params = job(corpus, tmp_path / "out", model)
    run_library(params)
    build_tiny_bert(tmp_path / "other", seed=1)
    shutil.copy(tmp_path / "other" / "model.safetensors", model / "model.safetensors")

    def load():  # the cached embedder's files changed: get_embedder loads the new ones
        spec = parse(EmbedJob, params, "job")
        return get_embedder(spec.encoder, spec.poolers)

    with pytest.raises(FingerprintError, match="fingerprint"):
        _plan(params, load)


def test_needs_model_says_when_planning_will_load_it(
        tmp_path: Path, corpus: Path, tiny_model_dir: Path) -> None:
    params = job(corpus, tmp_path / "out", tiny_model_dir)
    spec = parse(EmbedJob, params, "job")
    assert needs_model(spec)  # a set to create: its fingerprint needs the model
    run_library(params)
    assert not needs_model(spec)  # every set carries this job's key
    other = parse(EmbedJob, params | {"encoder": params["encoder"] | {"token_budget": 4096}},
                  "job")
    assert needs_model(other)  # another job's key: checked against the loaded model
    more = parse(EmbedJob, params | {"poolers": [{"name": "mean"}, {"name": "cls"}]}, "job")
    assert needs_model(more)


def test_a_preloaded_model_is_the_one_a_run_gets(tiny_model_dir: Path) -> None:
    spec = parse(EmbedJob, {"corpus": "c", "out": "o", "encoder": {
        "model": str(tiny_model_dir), "device": "cpu", "max_length": 48}}, "job")
    preload(spec.encoder, spec.poolers).join()
    loaded = [e for e, _ in pipeline.embedder._CACHE.values()
              if e.cfg == spec.encoder and e.info.max_length == 48]
    assert len(loaded) == 1
    assert get_embedder(spec.encoder, spec.poolers) is loaded[0]


def test_a_failed_preload_leaves_the_error_to_the_run(tmp_path: Path) -> None:
    spec = parse(EmbedJob, {"corpus": "c", "out": "o",
                            "encoder": {"model": str(tmp_path / "no-such-model")}}, "job")
    preload(spec.encoder, spec.poolers).join()  # nothing raised in the thread, nothing cached
    with pytest.raises(EmbedpipeError, match="no-such-model"):
        get_embedder(spec.encoder, spec.poolers)


def test_a_worker_whose_model_changed_after_planning_writes_nothing(
        tmp_path: Path, corpus: Path, tiny_model_dir: Path, monkeypatch) -> None:
    """A long-lived worker must not write another model's vectors under the planned set."""
    from conftest import build_tiny_bert

    monkeypatch.setattr(pipeline.embedder, "_CACHE", {})
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    params = job(corpus, tmp_path / "out", model)
    spec = parse(EmbedJob, params, "job")
    _, plan = _plan(params, lambda: get_embedder(spec.encoder, spec.poolers))
    build_tiny_bert(tmp_path / "other", seed=1)  # the files change between planning and shards
    shutil.copy(tmp_path / "other" / "model.safetensors", model / "model.safetensors")
    with pytest.raises(FingerprintError, match="set 'mean': this worker's model makes"):
        embed_shard(plan.requests[0])
    assert SetFolder(str(tmp_path / "out"), "mean").read_markers() == {}
    assert not list((tmp_path / "out" / "sets" / "mean").glob("part-*"))


def test_a_set_is_never_fed_from_other_corpus_columns_and_follows_a_moved_corpus(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    corpus = write_corpus(tmp_path / "c.parquet", list(range(40)),
                          [text_for(i) for i in range(40)],
                          body=[text_for(i, "body") for i in range(40)])
    out = tmp_path / "out"
    run_library(job(corpus, out, tiny_model_dir))
    before = read_set(out, "mean")
    body = job(corpus, out, tiny_model_dir, text_column="body")
    # the markers match the row groups whichever column is read: refused before any model
    with pytest.raises(FingerprintError, match=r"columns 'text' \(ids 'id'\), this job reads "
                                               r"'body' \(ids 'id'\)"):
        _plan(body)
    with pytest.raises(FingerprintError, match="pass --text-column text"):
        run_library(body, verify=True)
    assert same_vectors(read_set(out, "mean"), before)
    assert SetFolder(str(out), "mean").meta().text_column == "text"

    (tmp_path / "moved").mkdir()
    moved = shutil.copy(corpus, tmp_path / "moved" / corpus.name)  # same name: same shards
    summary = run_library(job(moved, out, tiny_model_dir))
    assert summary.embedded == 0 and summary.shards_run == 0
    assert SetFolder(str(out), "mean").meta().corpus == str(moved)  # snippets come from here
    assert same_vectors(read_set(out, "mean"), before)


def test_the_counts_add_up_when_one_set_is_new_and_another_done(
        tmp_path: Path, corpus: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "out"
    run_library(job(corpus, out, tiny_model_dir, poolers=[{"name": "cls"}]))
    both = job(corpus, out, tiny_model_dir, poolers=[{"name": "cls"}, {"name": "max"}])
    summary = run_library(both, verify=True)  # cls keeps its vectors, max needs every row
    assert (summary.rows, summary.embedded, summary.reused) == (40, 40, 0)
    again = run_library(both, verify=True)
    assert (again.rows, again.embedded, again.reused) == (40, 0, 40)
