"""A run that names no pooler works on every set already in OUT: the nightly run keeps them all
current, a rerun resumes them (``pipeline.assembly.keep_sets_current``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from _flowkit import job, out_digest, read_set, run_library, same_vectors, text_for, write_corpus

from flows.embed import backfill_flow, embed_flow, nightly_flow
from pipeline.assembly import inherit_encoder, keep_sets_current, resolve_job
from pipeline.config import EmbedJob, parse
from pipeline.errors import ConfigError
from pipeline.run import needs_model
from pipeline.sets import META_FILE, list_sets

CLS = {"name": "cls", "layers": [-1, -2]}


def _unnamed(params: dict) -> dict:
    """``params`` naming no pooler and no model (the device and dtype still given)."""
    return {k: v for k, v in params.items() if k != "poolers"} | {
        "encoder": {"dtype": "fp32", "device": "cpu"}}


def _corpus(path: Path, rows: int) -> Path:
    return write_corpus(path, list(range(rows)), [text_for(i) for i in range(rows)])


@pytest.mark.usefixtures("prefect_api")
def test_the_nightly_run_keeps_a_backfilled_set_current(tmp_path: Path, tiny_model_dir: Path):
    corpus, out = _corpus(tmp_path / "c" / "a.parquet", 30), tmp_path / "out"
    embed_flow(job(corpus, out, tiny_model_dir, poolers=[CLS]))
    backfill_flow(job(corpus, out, tiny_model_dir, poolers=[{"name": "max"}]))
    _corpus(corpus, 45)  # the corpus grows

    nightly = _unnamed(job(corpus, out, tiny_model_dir))
    summary = nightly_flow(nightly)
    assert summary["sets"] == ["cls", "max"] and summary["embedded"] == 15
    assert list_sets(str(out)) == ["cls", "max"]  # no default `mean` set started beside them
    fresh = tmp_path / "fresh"
    embed_flow(job(corpus, fresh, tiny_model_dir, poolers=[CLS, {"name": "max"}]))
    for name in ("cls", "max"):
        assert same_vectors(read_set(out, name), read_set(fresh, name), atol=1e-5)

    # nothing new: planned from the sets' own job keys, without loading the model
    assert not needs_model(resolve_job(nightly))
    before = out_digest(out)
    assert nightly_flow(nightly)["embedded"] == 0
    rerun = embed_flow(nightly)  # a plain rerun naming no set resumes OUT's sets: done
    assert rerun["sets"] == ["cls", "max"] and rerun["shards_run"] == 0
    assert out_digest(out) == before


def test_a_job_naming_sets_or_an_out_without_sets_is_left_as_it_is(tmp_path: Path,
                                                                   tiny_model_dir: Path):
    corpus, out = _corpus(tmp_path / "a.parquet", 20), tmp_path / "out"
    empty = parse(EmbedJob, _unnamed(job(corpus, out, tiny_model_dir)), "job")
    assert keep_sets_current(empty) is empty  # a first run: the model's default set
    run_library(job(corpus, out, tiny_model_dir, poolers=[CLS, {"name": "max"}]))
    named = parse(EmbedJob, job(corpus, out, tiny_model_dir, poolers=[{"name": "max"}]), "job")
    assert keep_sets_current(named) is named
    kept = keep_sets_current(parse(EmbedJob, _unnamed(job(corpus, out, tiny_model_dir)), "job"))
    assert [p.name for p in kept.poolers] == ["cls", "max"]
    assert kept.poolers[0].layers == (-1, -2)
    assert kept.encoder.model == str(tiny_model_dir) and kept.encoder.device == "cpu"


def test_a_sets_own_encoder_wins_over_the_installations_settings(
        tmp_path: Path, tiny_model_dir: Path, monkeypatch) -> None:
    corpus, out = _corpus(tmp_path / "a.parquet", 20), tmp_path / "out"
    made = job(corpus, out, tiny_model_dir, poolers=[CLS])
    made["encoder"] |= {"max_length": 16}
    run_library(made)
    # an installation whose settings name the same model and other defaults
    monkeypatch.setenv("EMBEDPIPE_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("EMBEDPIPE_DTYPE", "auto")
    nightly = {k: v for k, v in made.items() if k not in ("poolers", "encoder")}
    spec = resolve_job(nightly)
    assert [p.name for p in spec.poolers] == ["cls"]
    assert spec.encoder.max_length == 16  # what made the set's vectors, as it was made
    assert needs_model(spec)  # another dtype than the set's job: checked against the model
    run_library(spec.model_dump(mode="json"))
    assert not needs_model(resolve_job(nightly))  # the set now carries this job's keys
    # and where OUT has no sets yet the settings still fill the job
    fresh = resolve_job(nightly | {"out": str(tmp_path / "fresh")})
    assert (fresh.encoder.model, fresh.encoder.dtype) == (str(tiny_model_dir), "auto")


def test_a_nightly_run_takes_the_device_and_dtype_of_its_machine(
        tmp_path: Path, tiny_model_dir: Path, monkeypatch) -> None:
    """A set first made on a CPU in fp32, kept current by a worker whose settings say another
    device and dtype (a GPU pool's EMBEDPIPE_DEVICE=cuda): the worker's apply, the options
    that made the vectors (model, max length, windows, int8) stay the set's."""
    corpus, out = _corpus(tmp_path / "a.parquet", 20), tmp_path / "out"
    made = job(corpus, out, tiny_model_dir, poolers=[CLS])
    made["encoder"] |= {"max_length": 16, "window": {"size": 8, "stride": 4},
                        "token_budget": 512}
    run_library(made)
    monkeypatch.setenv("EMBEDPIPE_DEVICE", "cuda")
    monkeypatch.setenv("EMBEDPIPE_DTYPE", "bf16")
    spec = resolve_job({k: v for k, v in made.items() if k not in ("poolers", "encoder")})
    assert (spec.encoder.device, spec.encoder.dtype, spec.encoder.token_budget) == (
        "cuda", "bf16", None)
    assert (spec.encoder.model, spec.encoder.max_length) == (str(tiny_model_dir), 16)
    assert (spec.encoder.window.size, spec.encoder.window.stride) == (8, 4)
    # a backfill naming no model takes the same options, and its own flags win
    backfill = inherit_encoder({k: v for k, v in made.items() if k != "encoder"}
                               | {"encoder": {"device": "cpu"}})
    assert backfill["encoder"] == {"model": str(tiny_model_dir), "max_length": 16,
                                   "window": {"size": 8, "stride": 4, "agg": "mean"},
                                   "prompt_name": None, "query_prompt_name": None,
                                   "device": "cpu"}


@pytest.mark.parametrize(("given", "differs"), [
    ({"max_length": 32}, "max length 16 -> 32"),
    ({"window": {"size": 8, "stride": 2}}, "window size=8 stride=4 agg='mean' -> size=8 stride=2"),
    ({"dtype": "int8"}, "dtype float -> int8 (auto)"),
])
def test_a_backfill_with_another_encoder_is_refused(tmp_path: Path, tiny_model_dir: Path,
                                                    given: dict, differs: str) -> None:
    """``backfill --pooler cls --max-length 32`` exited 0, and every later run naming no pooler
    (the nightly deployment) failed: the sets were made by different encoders."""
    corpus, out = _corpus(tmp_path / "a.parquet", 20), tmp_path / "out"
    made = job(corpus, out, tiny_model_dir, poolers=[CLS])
    made["encoder"] |= {"max_length": 16, "window": {"size": 8, "stride": 4}}
    run_library(made)
    backfill = made | {"poolers": [{"name": "mean"}]}
    assert inherit_encoder(backfill)["encoder"]["max_length"] == 16  # its own options: taken
    with pytest.raises(ConfigError, match=rf"backfill: {re.escape(differs)}.* would make the "
                                          "new sets with another encoder.*embedpipe embed"):
        inherit_encoder(backfill | {"encoder": made["encoder"] | given})
    keep_sets_current(parse(EmbedJob, _unnamed(made), "job"))  # OUT's sets: still one encoder


def test_an_int8_sets_dtype_and_kernel_are_kept(tmp_path: Path, tiny_model_dir: Path,
                                                monkeypatch) -> None:
    from pipeline.assembly import _one_encoder
    from pipeline.sets import SetFolder

    corpus, out = _corpus(tmp_path / "a.parquet", 20), tmp_path / "out"
    run_library(job(corpus, out, tiny_model_dir, poolers=[CLS]))
    meta = SetFolder(str(out), "cls").meta()
    int8 = meta.model_copy(update={"encoder": meta.encoder | {"dtype": "int8",
                                                              "int8_kernel": "onednn"}})
    kept = _one_encoder(str(out), [int8], "ask")
    assert (kept["dtype"], kept["int8_kernel"]) == ("int8", "onednn")
    assert "dtype" not in _one_encoder(str(out), [meta], "ask")  # fp32: the machine's


def test_sets_of_different_encoders_are_asked_for_by_name(tmp_path: Path, tiny_model_dir: Path):
    corpus, out = _corpus(tmp_path / "a.parquet", 20), tmp_path / "out"
    run_library(job(corpus, out, tiny_model_dir, poolers=[{"name": "max"}]))
    windowed = job(corpus, out, tiny_model_dir, poolers=[CLS])
    windowed["encoder"] = windowed["encoder"] | {"window": {"size": 8, "stride": 4}}
    run_library(windowed)
    unnamed = parse(EmbedJob, _unnamed(windowed), "job")
    with pytest.raises(ConfigError, match=r"different encoders \(cls: .*, windows of 8 every 4; "
                                          r"max: .*\); name the sets to run"):
        keep_sets_current(unnamed)
    with pytest.raises(ConfigError, match="different encoders"):  # a model given: still refused
        keep_sets_current(parse(EmbedJob, {k: v for k, v in windowed.items() if k != "poolers"},
                                "job"))
    # a backfill naming no model has no encoder to take either
    with pytest.raises(ConfigError, match="different encoders.*name the encoder to backfill with"):
        inherit_encoder(_unnamed(windowed) | {"poolers": [{"name": "mean"}]})


def test_sets_of_other_prompts_are_asked_for_by_name(tmp_path: Path, tiny_model_dir: Path):
    """Sets that differ only by the prompt their model applies: the run applied the first
    set's prompt to every set, and then failed on the other's fingerprint, blaming the job."""
    from pipeline.assembly import _one_encoder
    from pipeline.sets import SetFolder

    corpus, out = _corpus(tmp_path / "a.parquet", 20), tmp_path / "out"
    run_library(job(corpus, out, tiny_model_dir, poolers=[CLS]))
    meta = SetFolder(str(out), "cls").meta()
    prompted = meta.model_copy(update={"name": "search",
                                       "encoder": meta.encoder | {"prompt_name": "search"}})
    with pytest.raises(ConfigError, match=r"different encoders \(cls: .*; search: .*prompt name "
                                          r"'search'\); ask"):
        _one_encoder(str(out), [meta, prompted], "ask")


@pytest.mark.parametrize(("change", "error"), [
    ({"strategy": "learned", "head": "/elsewhere/head"},
     "learned head /elsewhere/head, and EMBEDPIPE_HEADS is unset: a run takes a head's path"),
    ({"layers": []}, "pooler recorded by set 'max'.*layers"),
])
def test_a_stored_pooler_is_checked_before_it_is_run(tmp_path: Path, tiny_model_dir: Path,
                                                     change: dict, error: str):
    corpus, out = _corpus(tmp_path / "a.parquet", 20), tmp_path / "out"
    run_library(job(corpus, out, tiny_model_dir, poolers=[{"name": "max"}]))
    meta_file = out / "sets" / "max" / META_FILE
    meta = json.loads(meta_file.read_text())
    meta["pooler"] |= change
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=error):
        keep_sets_current(parse(EmbedJob, _unnamed(job(corpus, out, tiny_model_dir)), "job"))


@pytest.mark.parametrize("given", [{"window_agg": "max"}, {"stride": 8, "window_agg": "first"}])
def test_window_options_without_a_size_are_one_line(tmp_path: Path, given: dict) -> None:
    from pipeline.assembly import build_job

    flags = ", ".join(f"--{k.replace('_', '-')}" for k in given)
    with pytest.raises(ConfigError, match=f"^{flags} without a window size: give --window N"):
        build_job(str(tmp_path / "c.parquet"), str(tmp_path / "out"), **given)
    sized = build_job(str(tmp_path / "c.parquet"), str(tmp_path / "out"),
                      **({"window": 16, "stride": 8} | given))
    assert sized.encoder.window.size == 16 and sized.encoder.window.agg == given["window_agg"]


def test_a_job_records_local_corpus_and_model_paths_absolute(tmp_path: Path, tiny_model_dir: Path,
                                                             monkeypatch) -> None:
    """``_SET.json`` keeps the corpus and model a job names, and the nightly run, ``query`` and
    ``serve`` read them from other folders: relative ones broke there. OUT too: a Dask worker
    resolved a relative one against its own folder, found no lease there, and every run failed
    ('lost the writer lease ... to nobody'). URLs and Hugging Face names stay as given."""
    from pipeline.assembly import build_job

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny").symlink_to(tiny_model_dir)
    monkeypatch.chdir(tmp_path)
    spec = build_job("data/c.parquet", "out", model="models/tiny")
    assert spec.corpus == str(tmp_path / "data" / "c.parquet")
    assert spec.encoder.model == str(tmp_path / "models" / "tiny")
    assert spec.out == str(tmp_path / "out")
    named = build_job("s3://bucket/c/*.parquet", "s3://bucket/out",
                      model="sentence-transformers/x")
    assert (named.corpus, named.out, named.encoder.model) == (
        "s3://bucket/c/*.parquet", "s3://bucket/out", "sentence-transformers/x")
    config = tmp_path / "job.toml"  # a learned head's folder too: its path is in the fingerprint
    config.write_text('[[poolers]]\nname = "l"\nstrategy = "learned"\nhead = "heads/att"\n'
                      '[[poolers]]\nname = "s3l"\nstrategy = "learned"\n'
                      'head = "s3://bucket/heads/att"\n')
    learned = build_job("c.parquet", "out", config=config, poolers=["l", "s3l"])
    assert [p.head for p in learned.poolers] == [str(tmp_path / "heads" / "att"),
                                                 "s3://bucket/heads/att"]


@pytest.mark.usefixtures("prefect_api")
def test_the_nightly_run_keeps_a_learned_set_current_whose_head_the_operator_keeps(
        tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A backfilled learned set stopped the nightly run for every set: its head's path was
    never taken from _SET.json. It is, inside the operator's EMBEDPIPE_HEADS, links resolved."""
    from pipeline.head_files import HeadConfig
    from pipeline.models.loader import read_model_files
    from pipeline.poolers.heads import PoolingHead, save_head

    heads = tmp_path / "heads"
    save_head(PoolingHead(HeadConfig(kind="attention", hidden_size=32, num_layers=2,
                                     model_hash=read_model_files(str(tiny_model_dir))
                                     .model_hash())), str(heads / "att"))
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "att").symlink_to(heads / "att")  # the path a set records: a link
    learned = {"name": "learned", "strategy": "learned", "head": str(tmp_path / "root" / "att")}
    corpus, out = _corpus(tmp_path / "c" / "a.parquet", 30), tmp_path / "out"
    embed_flow(job(corpus, out, tiny_model_dir, poolers=[CLS]))
    backfill_flow(job(corpus, out, tiny_model_dir, poolers=[learned]))
    _corpus(corpus, 45)
    nightly = _unnamed(job(corpus, out, tiny_model_dir))
    with pytest.raises(ConfigError, match="EMBEDPIPE_HEADS is unset"):
        nightly_flow(nightly)
    monkeypatch.setenv("EMBEDPIPE_HEADS", str(tmp_path / "root"))  # the link leads out of it
    with pytest.raises(ConfigError, match=r"outside EMBEDPIPE_HEADS \("):
        nightly_flow(nightly)
    monkeypatch.setenv("EMBEDPIPE_HEADS", str(heads))
    summary = nightly_flow(nightly)
    assert summary["sets"] == ["cls", "learned"] and summary["embedded"] == 15
    fresh = tmp_path / "fresh"
    embed_flow(job(corpus, fresh, tiny_model_dir, poolers=[CLS, learned]))
    for name in ("cls", "learned"):
        assert same_vectors(read_set(out, name), read_set(fresh, name), atol=1e-5)


@pytest.mark.usefixtures("prefect_api")
def test_runs_that_give_no_rows_per_shard_keep_the_sets_shard_layout(tmp_path: Path,
                                                                     tiny_model_dir: Path):
    """Made at 10 rows a shard, OUT was planned at the default 20,000 by the next run that
    gave none: a rerun rewrote every part (a new generation for the index to catch up
    with), a backfill laid its set out apart from the others."""
    from pipeline.sets import SetFolder

    corpus, out = _corpus(tmp_path / "a.parquet", 30), tmp_path / "out"
    made = job(corpus, out, tiny_model_dir, rows_per_shard=10)
    embed_flow(made)
    meta = SetFolder(str(out), "mean").meta()
    assert (meta.rows_per_shard, meta.shards_done, meta.generation) == (10, 3, 1)
    given = {k: v for k, v in made.items() if k != "rows_per_shard"}
    before = out_digest(out)
    assert embed_flow(given)["shards_run"] == 0 and out_digest(out) == before
    assert nightly_flow(given)["embedded"] == 0 and out_digest(out) == before
    assert backfill_flow(given | {"poolers": [{"name": "max"}]})["shards_run"] == 3
    assert SetFolder(str(out), "max").marked_shards() == SetFolder(str(out), "mean").marked_shards()
    # given again, it wins: the new layout is the sets' from then on
    embed_flow(made | {"rows_per_shard": 15, "poolers": [{"name": "mean"}, {"name": "max"}]})
    meta = SetFolder(str(out), "max").meta()
    assert (meta.rows_per_shard, meta.shards_done) == (15, 2)  # row groups 0-1, then 2
