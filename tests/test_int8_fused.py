"""`--dtype int8` in the fused CPU forward: oneDNN's int8 product for the hidden-wide Linear
layers (pipeline/int8_linear.py), where this CPU runs it and bf16 natively."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import build_tiny_bert

import pipeline.embedder
from pipeline.config import EncoderConfig, PoolerSpec
from pipeline.embedder import Embedder
from pipeline.errors import ConfigError, FingerprintError
from pipeline.fused_bert import FusedBert
from pipeline.int8_ffn import Int8FeedForward
from pipeline.int8_linear import (
    Int8Linear,
    calibration_batches,
    onednn_int8_available,
    quantize_uint8,
    uint8_qparams,
    value_range,
)
from pipeline.models.hashing import int8_hint
from pipeline.vectors import row_cosines
from tests._flowkit import job, run_library, text_for, write_corpus
from tests._int8 import TEXTS, check_int8_vectors, check_text_alone, embedder

needs_int8 = pytest.mark.skipif(not onednn_int8_available(),
                                reason="no oneDNN int8 product or no native bf16 on this CPU")


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EMBEDPIPE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_uint8_rounds_within_half_a_step(dtype: torch.dtype) -> None:
    def own_range(x: torch.Tensor) -> tuple[torch.Tensor, float, int]:
        return quantize_uint8(x, uint8_qparams(*value_range(x)))

    x = (torch.randn(64, 48) * 3 + 1).to(dtype)
    q, scale, zero = own_range(x)
    assert q.dtype == torch.uint8 and 0 <= zero <= 255
    back = (q.float() - zero) * scale
    assert (back - x.float()).abs().max() <= scale / 2 + 1e-4
    assert int(q.min()) == 0 and int(q.max()) == 255  # the whole range used
    zeros, scale0, zero0 = own_range(torch.zeros(4, 8))  # no range: any scale, all zero
    assert scale0 > 0 and bool(((zeros.float() - zero0) * scale0 == 0).all())
    positive, _, zero_p = own_range(torch.rand(4, 8) + 1)  # the range widened to hold 0
    assert zero_p == 0 and int(positive.min()) > 0


def test_fixed_qparams_quantize_within_their_range_and_clip_outside_it() -> None:
    x = torch.tensor([[-4.0, -1.0, -0.3, 0.0, 0.7, 2.0, 6.0]])
    qparams = uint8_qparams(-1.0, 2.0)
    q, scale, zero = quantize_uint8(x, qparams)
    assert (scale, zero) == qparams == (3.0 / 255, 85)
    back = (q.float() - zero) * scale
    assert torch.allclose(back[0, 1:6], x[0, 1:6], atol=scale / 2 + 1e-6)
    assert back[0, 0] == back[0, 1] and back[0, -1] == back[0, -2]  # clipped to the range
    assert uint8_qparams(0.5, 2.0) == (2.0 / 255, 0)  # widened to hold zero


def test_calibration_batches_are_vocabulary_rows_drawn_the_same_every_time() -> None:
    special = [0, 100, 101, 102]
    batches = calibration_batches(500, special, [101], [102], max_length=64)
    assert [tuple(ids.shape) for ids, _ in batches] == [(8, n) for n in (8, 16, 32, 64)]
    again = calibration_batches(500, special, [101], [102], max_length=64)
    for (ids, mask), (same, _) in zip(batches, again, strict=True):
        assert torch.equal(ids, same) and bool(mask.all())
        assert bool((ids[:, 0] == 101).all() and (ids[:, -1] == 102).all())
        inner = ids[:, 1:-1]
        assert not bool(torch.isin(inner, torch.tensor(special)).any())
        assert int(inner.min()) >= 1 and int(inner.max()) < 500
    assert len({int(i) for ids, _ in batches for i in ids[:, 1:-1].flatten()}) > 400


@needs_int8
def test_int8_vectors_depend_on_their_text_alone_not_on_batch_mates(
    tiny_model_dir: Path, cache: Path
) -> None:
    int8 = embedder(tiny_model_dir, "int8")
    layers = [m for m in int8.encoder.model.modules() if isinstance(m, Int8Linear)]
    assert layers and all(m.input_qparams and m.observed is None for m in layers)
    again = [m.input_qparams for m in embedder(tiny_model_dir, "int8").encoder.model.modules()
             if isinstance(m, Int8Linear)]
    assert again == [m.input_qparams for m in layers]  # calibrated alike on every load
    check_text_alone(int8)  # with per-batch scales: 6e-5 and 9e-5 apart


def test_a_set_of_a_retired_int8_scheme_is_refused_with_why() -> None:
    hint = int8_hint("8457b09e37db1283-onednn-int8", "8457b09e37db1283-onednn-int8-ffn")
    assert hint == ("; its int8 vectors came from oneDNN with input scales taken per batch, "
                    "which this version no longer runs: make the set anew")
    assert int8_hint("8457b09e37db1283-onnx-int8", "8457b09e37db1283-onnx-int8-static") == (
        "; its int8 vectors came from ONNX Runtime with input scales taken per batch, which "
        "this version no longer runs: make the set anew")
    assert int8_hint("8457b09e37db1283-onednn-int8-static", "8457b09e37db1283-onednn-int8-ffn"
                     ) == ("; its int8 vectors came from oneDNN with the feed-forward block's "
                           "second product in bf16, which this version no longer runs: make "
                           "the set anew")
    made, making = "8457b09e37db1283-onnx-int8-static", "8457b09e37db1283-onednn-int8-ffn"
    assert int8_hint(made, making) == (
        "; its int8 vectors came from onnxruntime, this job's from onednn: int8_kernel "
        "onnxruntime (--int8-kernel onnxruntime) continues it")


@needs_int8
@pytest.mark.parametrize("gelu", [None, "none", "tanh"])
def test_int8_linear_is_the_product_within_quantization_error(gelu: str | None) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160)
    x = torch.randn(3, 17, 96)
    expected = linear(x)
    if gelu:
        expected = F.gelu(expected, approximate=gelu)
    out = Int8Linear(linear, gelu=gelu)(x)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 17, 160)
    error = (out.float() - expected).norm() / expected.norm()
    assert error < 0.03


@needs_int8
def test_int8_runs_fused_close_to_fp32_with_its_own_fingerprint(
    tiny_model_dir: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # not needed: not imported at all
    fp32, int8 = embedder(tiny_model_dir, "fp32"), embedder(tiny_model_dir, "int8")
    model = int8.encoder.model
    assert isinstance(model, FusedBert) and model.dtype == torch.bfloat16
    assert all(isinstance(layer.qkv, Int8Linear) and isinstance(layer.ffn, Int8FeedForward)
               and layer.ffn.up.output_qparams == layer.ffn.down.input_qparams
               for layer in model.layers)  # up writes the uint8 that down reads
    b = check_int8_vectors(fp32, int8, "-onednn-int8-ffn")
    np.testing.assert_array_equal(b, int8.encode(TEXTS))  # the same batches: the same vectors
    assert not (cache / "onnx-int8").exists()  # no ONNX export


@needs_int8
def test_int8_fused_gives_every_layer_to_layer_poolers(tiny_model_dir: Path, cache: Path
                                                      ) -> None:
    spec = PoolerSpec(name="layers", strategy="mean", layers=(0, 1, -1))
    fp32, int8 = embedder(tiny_model_dir, "fp32", spec), embedder(tiny_model_dir, "int8", spec)
    cosine = row_cosines(fp32.encode(TEXTS), int8.encode(TEXTS))
    assert cosine.min() > 0.95


@needs_int8
def test_int8_fused_gives_the_attention_pooler_its_weights(tiny_model_dir: Path, cache: Path
                                                           ) -> None:
    """The fused int8 forward computes the first token's attention weights as its fp32 one
    does: the attention set close to fp32's, a set of its own (ONNX Runtime's int8 refuses
    the pooler: tests/test_quantize.py)."""
    spec = PoolerSpec(name="attention")
    fp32, int8 = (embedder(tiny_model_dir, dtype, spec) for dtype in ("fp32", "int8"))
    assert int8.encoder.int8_kernel == "onednn" and int8.encoder.fused
    cosine = row_cosines(fp32.encode(TEXTS), int8.encode(TEXTS))
    assert cosine.min() > 0.95
    assert int8.fingerprint("attention") != fp32.fingerprint("attention")


@needs_int8
@pytest.mark.parametrize("kind", ["mpnet", "distilbert", "electra"])
def test_int8_runs_fused_for_the_other_architectures_it_fuses(
    kind: str, tmp_path: Path, cache: Path
) -> None:
    """MPNet (its relative position bias beside the int8 products), DistilBERT (its own
    layer names) and ELECTRA (its embeddings widened in fp32 before the int8 layers) take
    oneDNN's int8 path as BERT does; a text's vector does not depend on its batch-mates."""
    model = build_tiny_bert(tmp_path / kind, kind=kind)
    fp32, int8 = embedder(model, "fp32"), embedder(model, "int8")
    assert isinstance(int8.encoder.model, FusedBert) and int8.encoder.model.int8
    check_int8_vectors(fp32, int8, "-onednn-int8-ffn")
    check_text_alone(int8)


@needs_int8
def test_int8_fused_and_onnx_runtime_are_different_sets(
    tiny_model_dir: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fused = embedder(tiny_model_dir, "int8")
    monkeypatch.setattr("pipeline.int8_linear.onednn_int8_available", lambda: False)
    onnx = embedder(tiny_model_dir, "int8")
    assert not isinstance(onnx.encoder.model, FusedBert)
    assert fused.fingerprint("mean") != onnx.fingerprint("mean")
    cosine = row_cosines(fused.encode(TEXTS), onnx.encode(TEXTS))
    assert cosine.min() > 0.95


def test_int8_kernel_is_only_for_int8_and_onednn_says_why_it_cannot_run(
    tiny_model_dir: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="int8_kernel onednn is for dtype int8, not fp32"):
        EncoderConfig(dtype="fp32", int8_kernel="onednn")
    monkeypatch.setattr("pipeline.int8_linear.onednn_int8_available", lambda: False)
    with pytest.raises(ConfigError, match="int8_kernel onednn cannot run here: this CPU"):
        Embedder(EncoderConfig(model=str(tiny_model_dir), dtype="int8", int8_kernel="onednn",
                               device="cpu"), [PoolerSpec(name="mean")])


@needs_int8
def test_onnxruntime_is_chosen_where_the_fused_int8_path_would_run(
    tiny_model_dir: Path, cache: Path
) -> None:
    onnx = Embedder(EncoderConfig(model=str(tiny_model_dir), dtype="int8", device="cpu",
                                  int8_kernel="onnxruntime"), [PoolerSpec(name="mean")])
    assert not isinstance(onnx.encoder.model, FusedBert)
    assert onnx.info.model_hash.endswith("-onnx-int8-static")


@contextlib.contextmanager
def _where_auto_picks_onnx_runtime(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """As on a machine without the fused int8 path (with its own loaded models)."""
    with monkeypatch.context() as elsewhere:
        elsewhere.setattr(pipeline.embedder, "_CACHE", {})
        elsewhere.setattr("pipeline.int8_linear.onednn_int8_available", lambda: False)
        yield


def _corpus(tmp_path: Path, rows: int) -> Path:
    return write_corpus(tmp_path / "c.parquet", list(range(rows)),
                        [text_for(i) for i in range(rows)])


@needs_int8
def test_a_set_made_by_one_int8_kernel_is_never_continued_by_the_other(
    tmp_path: Path, tiny_model_dir: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pipeline.embedder, "_CACHE", {})
    corpus = _corpus(tmp_path, 30)
    int8 = {"model": str(tiny_model_dir), "dtype": "int8", "device": "cpu"}
    onnx = job(corpus, tmp_path / "out", tiny_model_dir,
               encoder=int8 | {"int8_kernel": "onnxruntime"})
    run_library(onnx)
    auto = onnx | {"encoder": int8}  # another job: planned with the model, refused at the claim
    with pytest.raises(FingerprintError, match="came from onnxruntime, this job's from onednn: "
                                               "int8_kernel onnxruntime"):
        run_library(auto)

    other = job(corpus, tmp_path / "other", tiny_model_dir, encoder=int8)
    with _where_auto_picks_onnx_runtime(monkeypatch):
        run_library(other)
    write_corpus(corpus, list(range(40)), [text_for(i) for i in range(40)])
    with pytest.raises(FingerprintError, match="dtype int8 runs through onednn here"):
        run_library(other)  # the same job's key: the worker finds the other kernel
    run_library(onnx | {"out": str(tmp_path / "other")})  # the kernel named: it continues


@needs_int8
def test_queries_of_an_int8_set_run_through_the_kernel_that_made_it(
    tmp_path: Path, tiny_model_dir: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.search import QueryEncoder
    from pipeline.sets import SetFolder

    encoder = {"model": str(tiny_model_dir), "dtype": "int8", "device": "cpu"}
    with _where_auto_picks_onnx_runtime(monkeypatch):
        run_library(job(_corpus(tmp_path, 10), tmp_path / "out", tiny_model_dir,
                        encoder=encoder))
    meta = SetFolder(str(tmp_path / "out"), "mean").meta()
    assert meta.model_hash.endswith("-onnx-int8-static") and meta.encoder["int8_kernel"] == "auto"
    query = QueryEncoder(meta)  # here auto would pick oneDNN: the set's kernel is kept
    assert not isinstance(query.embedder.encoder.model, FusedBert)
    assert query.encode([text_for(3)]).shape == (1, meta.dim)


def test_int8_kernel_comes_from_flags_and_config_files_like_any_option(tmp_path: Path) -> None:
    from pipeline.assembly import build_job

    corpus, out = str(tmp_path / "c.parquet"), str(tmp_path / "out")
    job_ = build_job(corpus, out, dtype="int8", int8_kernel="onnxruntime")
    assert job_.encoder.int8_kernel == "onnxruntime"
    toml = tmp_path / "job.toml"
    toml.write_text('[encoder]\ndtype = "int8"\nint8_kernel = "onednn"\n')
    assert build_job(corpus, out, config=str(toml)).encoder.int8_kernel == "onednn"
    flag_wins = build_job(corpus, out, config=str(toml), int8_kernel="auto")
    assert flag_wins.encoder.int8_kernel == "auto"
    with pytest.raises(ConfigError, match="int8_kernel onednn is for dtype int8, not fp32"):
        build_job(corpus, out, config=str(toml), dtype="fp32")
    toml.write_text('dtype = "int8"\nint8_kernel = "onnxruntime"\nprompt_name = ""\n')
    top = build_job(corpus, out, config=str(toml)).encoder  # encoder keys at the top level
    assert (top.int8_kernel, top.prompt_name) == ("onnxruntime", "")


@needs_int8
def test_minilm_in_int8_takes_its_wide_ffn_channels_apart(minilm_dir: Path, cache: Path
                                                          ) -> None:
    fp32, int8 = embedder(minilm_dir, "fp32"), embedder(minilm_dir, "int8")
    apart = [0 if layer.ffn.outliers is None else len(layer.ffn.outliers[1])
             for layer in int8.encoder.model.layers]
    assert all(apart[:4]) and sum(apart) <= 8  # measured: [1, 1, 2, 1, 0, 0]
    cosine = row_cosines(fp32.encode(TEXTS), int8.encode(TEXTS))
    assert cosine.mean() > 0.99 and cosine.min() > 0.97
