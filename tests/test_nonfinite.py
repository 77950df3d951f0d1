"""A model that gives NaN or infinite vectors fails in one line naming where; nothing of the
shard is written, so no set ever holds a vector no search can find."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer, BertModel

import embedpipe
from pipeline.config import EncoderConfig, PoolerSpec
from pipeline.embedder import Embedder
from pipeline.errors import ModelError, NonFiniteVectors
from pipeline.sets import SetFolder

WORD = "zebra"  # its token's embedding is NaN: every text holding it pools to NaN


def _model_with_a_nan_word(tiny: Path, target: Path) -> Path:
    shutil.copytree(tiny, target)
    token = AutoTokenizer.from_pretrained(str(target)).convert_tokens_to_ids(WORD)
    model = BertModel.from_pretrained(str(target))
    with torch.no_grad():
        model.embeddings.word_embeddings.weight[token] = float("nan")
    model.save_pretrained(str(target))
    return target


@pytest.mark.parametrize(("dtype", "cause"), [
    ("fp32", "the model's weights hold NaN or infinity"),
    ("bf16", "its activations overflow bf16, or the model's weights hold NaN or infinity: "
             "try --dtype fp32"),
    ("int8", "the model's weights hold NaN or infinity, or its int8 kernels gave them: "
             "try --dtype fp32"),  # an int8 batch's scale is its own: no overflow
])
def test_the_embedder_refuses_vectors_that_are_not_finite(tiny_model_dir, tmp_path, dtype,
                                                          cause):
    model = _model_with_a_nan_word(tiny_model_dir, tmp_path / "model")
    embedder = Embedder(EncoderConfig(model=str(model), dtype=dtype, device="cpu"),
                        [PoolerSpec(name="mean"), PoolerSpec(name="cls")])
    assert embedder.encode(["a quiet horse", "a small cat"]).shape == (2, 32)
    with pytest.raises(NonFiniteVectors) as err:  # what a query (search, serve, eval) gets
        embedder.encode_queries(["a quiet horse", f"a striped {WORD}", f"one {WORD}"])
    assert str(err.value) == (f"pooler 'mean' gave 2 vectors that are not finite (NaN or "
                              f"infinity), one for text {err.value.row}: {cause}")
    assert err.value.row in (1, 2)


def test_a_learned_head_whose_outputs_overflow_is_named(tiny_model_dir, tmp_path):
    """Finite weights of 3e38 overflow the head's scores: it blamed the model's weights."""
    from pipeline.head_files import HeadConfig
    from pipeline.models.loader import read_model_files
    from pipeline.poolers.heads import PoolingHead, save_head

    head = PoolingHead(HeadConfig(kind="attention", hidden_size=32, num_layers=2,
                                  model_hash=read_model_files(str(tiny_model_dir)).model_hash()))
    with torch.no_grad():
        head.scorer.weight.fill_(3e38)
    save_head(head, str(tmp_path / "head"))
    embedder = Embedder(EncoderConfig(model=str(tiny_model_dir), dtype="fp32", device="cpu"),
                        [PoolerSpec(name="learned", strategy="learned",
                                    head=str(tmp_path / "head"))])
    with pytest.raises(NonFiniteVectors) as err:
        embedder.encode(["a quiet horse", "a small cat"])
    assert str(err.value).endswith(f": the pooling head {tmp_path / 'head'}'s outputs overflow, "
                                   "or the model's weights hold NaN or infinity")


def _write(path: Path, ids: list[int], texts: list[str]) -> None:
    pq.write_table(pa.table({"id": ids, "text": texts}), path)


def test_a_shard_with_nan_vectors_fails_in_one_line_and_the_others_are_kept(
        tiny_model_dir, tmp_path, prefect_api):
    model = _model_with_a_nan_word(tiny_model_dir, tmp_path / "model")
    corpus, out = tmp_path / "corpus", str(tmp_path / "out")
    corpus.mkdir()
    _write(corpus / "a.parquet", list(range(100, 110)), [f"a clean text {i}" for i in range(10)])
    texts = [f"another text {i}" for i in range(10)]
    texts[4] = f"a striped {WORD}"
    _write(corpus / "b.parquet", list(range(200, 210)), texts)
    opts = dict(poolers=["mean"], model=str(model), dtype="fp32", device="cpu")

    with pytest.raises(ModelError) as err:
        embedpipe.embed(str(corpus), out, **opts)
    assert re.fullmatch(
        r"shard b-\w+-g00000-00001, not written: pooler 'mean' gave 1 vectors that are not "
        r"finite \(NaN or infinity\), one for id 204: the model's weights hold NaN or "
        r"infinity", str(err.value)), str(err.value)
    folder = SetFolder(out, "mean")
    assert [m.file for m in folder.read_markers().values()] == ["a.parquet"]
    assert [Path(url).name.startswith("part-a-") for url in folder.part_urls()] == [True]
    with pytest.warns(embedpipe.EmbedpipeWarning, match="the last run that wrote to it did not "
                                                        "finish"):
        assert embedpipe.read_set(out, "mean").collect()["id"].to_list() == list(range(100, 110))

    texts[4] = "a striped horse"  # the text fixed: the rerun does the failed shard only
    _write(corpus / "b.parquet", list(range(200, 210)), texts)
    summary = embedpipe.embed(str(corpus), out, **opts)
    assert (summary["rows"], summary["embedded"]) == (20, 10)  # rows in the set
    assert sorted(embedpipe.read_set(out, "mean").collect()["id"].to_list()) == [
        *range(100, 110), *range(200, 210)]
