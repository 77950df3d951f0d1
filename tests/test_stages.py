"""Shard stages: the prefetch thread, ShardStats, duplicates encoded once, reuse by join."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline.embedder import get_embedder
from pipeline.stages import prefetch
from pipeline.stats import ShardStats
from tests._flowkit import job, read_set, run_library, text_for, write_corpus


def test_prefetch_yields_in_order_and_runs_ahead_at_most_depth() -> None:
    produced: list[int] = []

    def items():
        for i in range(10):
            produced.append(i)
            yield i

    seen = []
    for value in prefetch(items(), depth=2):
        time.sleep(0.02)  # the producer fills the queue meanwhile
        # at most depth values queued + one being put + the one we hold
        assert len(produced) - len(seen) <= 4
        seen.append(value)
    assert seen == list(range(10))


def test_prefetch_raises_the_producer_error_at_its_position() -> None:
    def items():
        yield 1
        yield 2
        raise ValueError("bad row group")

    got = []
    with pytest.raises(ValueError, match="bad row group"):
        for value in prefetch(items()):
            got.append(value)
    assert got == [1, 2]


def test_prefetch_stops_the_producer_when_the_consumer_stops() -> None:
    produced = []

    def items():
        for i in range(1_000_000):
            produced.append(i)
            yield i

    stream = prefetch(items(), depth=1)
    assert next(stream) == 0
    stream.close()  # joins the producer thread
    assert len(produced) < 10
    assert not any(t.name == "prefetch" for t in threading.enumerate())


def test_stats_total_adds_every_count_and_stage() -> None:
    a = ShardStats(rows=3, embedded=2, encoded=1, duplicates=1, reused=1, tokens=10,
                   windows=1, truncated=0, batch_tokens=16, padding=2, skipped={"null_text": 1},
                   seconds={"read": 1.0, "encode": 2.0})
    b = ShardStats(rows=5, embedded=5, encoded=5, tokens=20, windows=6, truncated=1,
                   batch_tokens=24, padding=0, skipped={"null_text": 2, "empty_text": 1},
                   seconds={"encode": 0.5})
    total = ShardStats.total([a, b])
    assert (total.rows, total.embedded, total.encoded, total.duplicates, total.reused) == (
        8, 7, 6, 1, 1)
    assert (total.tokens, total.windows, total.truncated) == (30, 7, 1)
    assert (total.batch_tokens, total.padding, total.padding_share) == (40, 2, 0.05)
    assert total.skipped == {"null_text": 3, "empty_text": 1}
    assert total.seconds == {"read": 1.0, "encode": 2.5}
    assert total.stage_line() == "read 1.0s, encode 2.5s"
    assert total.encoder_line() == "30 tokens (1 texts truncated), padding 5.0%"
    assert ShardStats().padding_share == 0.0


@pytest.mark.parametrize("padded", [True, False])
def test_embedder_counts_the_token_rows_its_layers_ran_and_their_padding(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, padded: bool) -> None:
    """Two texts of near lengths (one batch): padded, the shorter one's padding counts; where
    the fused forward runs the batch unpadded, its real tokens alone."""
    from transformers import AutoTokenizer

    from pipeline import attention
    from pipeline.config import EncoderConfig, PoolerSpec
    from pipeline.data import TextBatch
    from pipeline.embedder import Embedder

    monkeypatch.setattr(attention, "unpadded_below", lambda dtype: 0 if padded else 1 << 30)
    embedder = Embedder(EncoderConfig(model=str(tiny_model_dir), dtype="fp32", device="cpu"),
                        [PoolerSpec(name="mean")])
    assert embedder.encoder.fused
    texts = ["alpha beta gamma delta epsilon", "alpha beta gamma delta epsilon zeta"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    sizes = [len(tokenizer(t)["input_ids"]) for t in texts]  # with [CLS] and [SEP]
    stats = embedder.embed(TextBatch([0, 1], texts)).stats
    assert stats.tokens == sum(sizes) - 2 * 2  # content tokens: [CLS] and [SEP] left out
    width = max(sizes)
    assert width > min(sizes)
    assert (stats.batch_tokens, stats.padding) == (
        (2 * width, width - min(sizes)) if padded else (sum(sizes), 0))


def test_stats_refuse_a_stage_they_do_not_know() -> None:
    with pytest.raises(ValueError, match="unknown shard stage 'decode'"):
        ShardStats().add_seconds("decode", 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seconds"):
        ShardStats(seconds={"decode": 1.0})


def test_identical_texts_share_one_forward_pass(tmp_path: Path, tiny_model_dir: Path) -> None:
    n = 60
    texts = [text_for(i % 7) for i in range(n)]  # 7 distinct texts, 53 repeats
    texts[5] = None  # skipped, not a duplicate
    corpus = write_corpus(tmp_path / "c.parquet", list(range(n)), texts, row_group_size=25)
    spec = job(corpus, tmp_path / "out", tiny_model_dir, rows_per_shard=1000)
    summary = run_library(spec)
    assert summary.embedded == n - 1
    assert summary.stats.encoded == 7
    assert summary.stats.duplicates == n - 1 - 7
    assert summary.skipped == {"null_text": 1}
    assert "duplicate texts encoded once" in summary.line()
    assert f"; {summary.stats.tokens:,} tokens, padding " in summary.line()
    assert "; busy read " in summary.line() and ", write " in summary.line()
    row = summary.table_row()
    assert (row["duplicates"], row["tokens"]) == (n - 1 - 7, summary.stats.tokens)
    assert set(row) >= {"read seconds", "tokenize seconds", "encode seconds", "write seconds"}
    timed = summary.model_copy(update={"seconds": 2.0, "setup_seconds": 3.0}).line()
    assert "shards run in 2.0s, 30 docs/s, after 3.0s of checks, planning and model load" in timed
    assert set(summary.stats.seconds) == {"read", "tokenize", "encode", "write"}
    vectors = read_set(tmp_path / "out", "mean")
    embedder = get_embedder(*_encoder_and_poolers(spec))
    alone = embedder.encode([text_for(i) for i in range(7)])
    for i, vec in vectors.items():
        np.testing.assert_allclose(vec, alone[i % 7], atol=1e-5)


def test_encode_tokenizes_the_next_slice_ahead_and_keeps_input_order(
        tiny_model_dir: Path) -> None:
    from pipeline.batching import SLICE_ROWS
    from pipeline.config import EncoderConfig, PoolerSpec

    embedder = get_embedder(EncoderConfig(model=str(tiny_model_dir), dtype="fp32"),
                            [PoolerSpec(name="mean")])
    assert embedder.slice_rows == SLICE_ROWS
    texts = [text_for(i) for i in range(SLICE_ROWS + 300)]  # two slices
    whole = embedder.encode(texts)
    parts = np.concatenate([embedder.encode(texts[:SLICE_ROWS]),
                            embedder.encode(texts[SLICE_ROWS:])])
    np.testing.assert_allclose(whole, parts, atol=1e-6)
    some = [0, SLICE_ROWS - 1, SLICE_ROWS, len(texts) - 1]
    np.testing.assert_allclose(whole[some], embedder.encode([texts[i] for i in some]),
                               atol=1e-5)


def test_rerun_reuses_by_id_and_hash_and_embeds_only_changes(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    n = 50
    texts = [text_for(i) for i in range(n)]
    corpus = write_corpus(tmp_path / "c.parquet", list(range(n)), texts, row_group_size=20)
    spec = job(corpus, tmp_path / "out", tiny_model_dir, rows_per_shard=20)
    run_library(spec)
    before = read_set(tmp_path / "out", "mean")
    texts[3] = "a changed text"
    write_corpus(corpus, list(range(n)), texts, row_group_size=20)
    summary = run_library(spec, verify=True)
    assert summary.embedded == 1 and summary.reused == n - 1
    after = read_set(tmp_path / "out", "mean")
    assert after.keys() == before.keys()
    assert all(np.array_equal(after[i], before[i]) for i in after if i != 3)
    assert not np.allclose(after[3], before[3])


def _encoder_and_poolers(spec: dict):
    from pipeline.config import EmbedJob, parse

    parsed = parse(EmbedJob, spec, "job")
    return parsed.encoder, parsed.poolers


def test_a_shard_that_loads_the_model_times_it_as_load_not_tokenize(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """A worker process's first shard loads the model: that was counted as tokenizing (3.9 s
    of "tokenize" for 64 rows under the processes runner)."""
    import shutil

    from pipeline.config import EmbedJob, parse
    from pipeline.embedder import Embedder
    from pipeline.job import embed_shard
    from pipeline.run import prepare

    model = shutil.copytree(tiny_model_dir, tmp_path / "model")  # no shard loaded it yet
    corpus = write_corpus(tmp_path / "c.parquet", list(range(40)),
                          [text_for(i) for i in range(40)])
    spec = parse(EmbedJob, job(corpus, tmp_path / "out", model, rows_per_shard=20), "job")
    plan = prepare(spec, lambda: Embedder(spec.encoder, spec.poolers))  # not the workers' one
    first, second = [embed_shard(r).stats.seconds for r in plan.requests]
    assert first["load"] > first["tokenize"] and "load" not in second
    assert set(second) == {"read", "tokenize", "encode", "write"}
