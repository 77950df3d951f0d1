"""Parity with sentence-transformers on the packaged all-MiniLM-L6-v2, on real texts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from _st_models import real_texts

from pipeline.config import EncoderConfig, PoolerSpec
from pipeline.data import TextBatch
from pipeline.embedder import Embedder
from pipeline.hardware import cpu_profile


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """300 real PyPI summaries plus a few long and odd texts."""
    return real_texts(300)


@pytest.fixture(scope="module")
def ours(minilm_dir: Path) -> Embedder:
    specs = [PoolerSpec(name=n) for n in ("model", "mean", "cls", "max")]
    return Embedder(EncoderConfig(dtype="fp32", device="cpu"), specs)


def test_the_default_model_set_is_sentence_transformers_encode(
    texts: list[str], ours: Embedder, minilm_dir
) -> None:
    """The packaged MiniLM is a sentence-transformers folder (its modules.json names a
    2_Normalize it ships no folder for): its ``model`` set is what ``encode`` gives."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(minilm_dir), device="cpu")
    got = ours.embed(TextBatch(list(range(len(texts))), texts)).vectors["model"]
    expected = st.encode(texts, batch_size=32)
    assert got.shape == expected.shape == (len(texts), 384)
    cosine = (got * expected).sum(1) / np.linalg.norm(expected, axis=1)
    assert cosine.min() >= 0.9999, cosine.min()
    print(f"\nall-MiniLM-L6-v2 model set: min cosine {cosine.min():.7f}")
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(expected, axis=1),
                               rtol=1e-5)
    queries = ours.encode_queries(texts[:50], "model")
    assert np.abs(queries - st.encode_query(texts[:50])).max() < 1e-5


def test_mean_matches_sentence_transformers(texts: list[str], ours: Embedder, minilm_dir) -> None:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(minilm_dir), device="cpu")
    expected = st.encode(texts, normalize_embeddings=True, batch_size=32)
    got = ours.embed(TextBatch(list(range(len(texts))), texts)).vectors["mean"]
    assert np.abs(got - expected).max() < 1e-5


def test_cls_and_max_match_last_hidden_state(texts: list[str], ours: Embedder, minilm_dir
                                              ) -> None:
    from transformers import AutoTokenizer

    sample = texts[:40] + texts[-4:]
    got = ours.embed(TextBatch(list(range(len(sample))), sample)).vectors
    tok, model = AutoTokenizer.from_pretrained(str(minilm_dir)), ours.encoder.model
    for i, text in enumerate(sample):
        enc = tok(text, truncation=True, max_length=256, return_tensors="pt")
        with torch.no_grad():
            h = model(**enc).last_hidden_state[0]
        for name, vec in (("cls", h[0]), ("max", h.max(0).values)):
            vec = torch.nn.functional.normalize(vec, dim=0).numpy()
            assert np.abs(got[name][i] - vec).max() < 1e-5, (name, text[:40])


@pytest.mark.skipif(not cpu_profile()["bf16_ok"], reason="this CPU cannot run bf16")
def test_bf16_stays_within_cosine_of_fp32(texts: list[str], ours: Embedder) -> None:
    bf16 = Embedder(EncoderConfig(dtype="bf16", device="cpu"), [PoolerSpec(name="mean")])
    assert bf16.info.dtype == "bf16"
    batch = TextBatch(list(range(len(texts))), texts)
    a = ours.embed(batch).vectors["mean"]
    b = bf16.embed(batch).vectors["mean"]
    cosine = (a * b).sum(axis=1)
    assert cosine.min() >= 0.9999, cosine.min()


def test_auto_dtype_is_recorded_and_keeps_cosine(ours: Embedder) -> None:
    auto = Embedder(EncoderConfig(device="cpu"), [PoolerSpec(name="mean")])
    assert auto.info.dtype in {"fp32", "bf16"}
    texts = ["dtype auto must stay close to fp32", "short", "a longer text about search " * 5]
    a = ours.encode(texts, "mean")
    b = auto.encode(texts)
    assert (a * b).sum(axis=1).min() >= 0.9999
