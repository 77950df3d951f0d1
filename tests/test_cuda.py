"""The CUDA path on a real GPU: skipped where there is none (CI has none; a lent GPU runs it).

The tiny BERT and a tiny sentence-transformers model are built here as everywhere; the
packaged MiniLM checks that ``dtype auto`` on a GPU keeps cosine >= 0.9999 to fp32.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from _st_models import VARIANTS, real_texts, save_variant

from pipeline.config import EncoderConfig, PoolerSpec
from pipeline.embedder import Embedder
from pipeline.precision import MIN_COSINE
from pipeline.vectors import row_cosines

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

POOLERS = [PoolerSpec(name="mean"), PoolerSpec(name="cls"), PoolerSpec(name="max")]


def _min_cosine(x: np.ndarray, y: np.ndarray) -> float:
    return float(row_cosines(x, y).min())


def _vectors(model: Path, device: str, dtype: str, texts: list[str]) -> dict[str, np.ndarray]:
    embedder = Embedder(EncoderConfig(model=str(model), device=device, dtype=dtype), POOLERS)
    assert embedder.info.device.startswith(device) and embedder.info.dtype == dtype
    return {spec.name: embedder.encode(texts, spec.name) for spec in POOLERS}


@pytest.mark.parametrize("dtype,floor", [("fp32", 0.99999), ("bf16", 0.99), ("fp16", 0.999)])
def test_every_pooler_on_cuda_matches_the_cpu_in_fp32(tiny_model_dir: Path, dtype: str,
                                                      floor: float) -> None:
    texts = real_texts(150)
    cpu = _vectors(tiny_model_dir, "cpu", "fp32", texts)
    gpu = _vectors(tiny_model_dir, "cuda", dtype, texts)
    for name, want in cpu.items():
        assert gpu[name].shape == want.shape
        assert _min_cosine(gpu[name], want) >= floor, (name, dtype)


def test_a_sentence_transformers_model_on_cuda_matches_its_own_encode(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    variant = next(v for v in VARIANTS if v.name == "cls_dense_norm_prompts")
    folder = save_variant(tiny_model_dir, tmp_path / variant.name, variant)
    texts = real_texts(150)
    want = SentenceTransformer(str(folder), device="cuda").encode(texts)
    embedder = Embedder(EncoderConfig(model=str(folder), device="cuda", dtype="fp32"),
                        [PoolerSpec(name="model")])
    assert _min_cosine(embedder.encode(texts), want) >= 0.99999


def test_auto_on_cuda_takes_a_half_dtype_that_keeps_minilm_close(minilm_dir: Path) -> None:
    texts = real_texts(200)
    auto = Embedder(EncoderConfig(device="cuda"), [PoolerSpec(name="mean")])
    assert auto.info.dtype in ("bf16", "fp16")
    fp32 = Embedder(EncoderConfig(device="cuda", dtype="fp32"), [PoolerSpec(name="mean")])
    assert _min_cosine(auto.encode(texts), fp32.encode(texts)) >= MIN_COSINE


def test_compiled_on_cuda_matches_eager(tiny_model_dir: Path) -> None:
    texts = real_texts(100)
    spec = [PoolerSpec(name="mean")]
    eager = Embedder(EncoderConfig(model=str(tiny_model_dir), device="cuda", dtype="bf16"), spec)
    compiled = Embedder(EncoderConfig(model=str(tiny_model_dir), device="cuda", dtype="bf16",
                                      compile=True), spec)
    assert compiled.encoder.compiled
    # two calls of different shapes: one graph with dynamic shapes serves both
    for sample in (texts, texts[:7]):
        assert _min_cosine(compiled.encode(sample), eager.encode(sample)) >= 0.999
