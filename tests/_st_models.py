"""Tiny sentence-transformers models saved by sentence-transformers itself, and real texts.

Each variant is a random 2-layer BERT (``build_tiny_bert``: the packaged MiniLM's tokenizer)
wrapped in sentence-transformers modules and saved with ``SentenceTransformer.save``, so
embedpipe reads exactly the files sentence-transformers writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from pipeline.config import EncoderConfig, PoolerSpec
from pipeline.embedder import Embedder
from pipeline.vectors import row_cosines

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
PYPI = SHARED / "pypi_summaries_200k.parquet"
PROMPTS = {"query": "query: ", "document": "passage: ", "search": "Represent this for search: "}
MIN_COSINE = 0.9999  # embedpipe's vectors against sentence-transformers' own


def ours_for(folder: Path, *specs: PoolerSpec, **encoder) -> Embedder:
    """embedpipe's Embedder over ``folder`` in fp32 on the CPU: ``specs``, else the model's
    own pipeline (set ``model``)."""
    cfg = EncoderConfig(model=str(folder), dtype="fp32", device="cpu", **encoder)
    return Embedder(cfg, list(specs) or [PoolerSpec(name="model")])


def assert_same(ours: np.ndarray, theirs: np.ndarray, what: str) -> float:
    """The same vectors: every row's cosine >= MIN_COSINE and its norm within 1e-4; returns
    the worst cosine."""
    assert ours.shape == theirs.shape, (what, ours.shape, theirs.shape)
    worst = float(row_cosines(ours, theirs).min())
    assert worst >= MIN_COSINE, (what, worst)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), np.linalg.norm(theirs, axis=1),
                               rtol=1e-4, err_msg=what)
    return worst


def real_texts(n: int = 300) -> list[str]:
    """``n`` real PyPI summaries plus long and odd texts (fallback: Python docstrings)."""
    if PYPI.exists():
        rows = pq.read_table(PYPI, columns=["text"]).column("text").to_pylist()
        real = [t for t in rows[: n + 100] if t and t.strip()][:n]
    else:  # the tests must also run where shared/ is absent
        import pydoc

        real = [pydoc.getdoc(obj)[:400] for obj in (int, str, dict, list, Path) * (n // 5)]
    long = ["word " * 400, "embedding pipelines pool token states " * 40]
    return real + long + ["a", "Ünïcödé ✓ 🚀", "line\nbreaks\tand\ttabs"]


@dataclass(frozen=True)
class Variant:
    """One saved model: its Pooling, the modules after it and its prompts."""

    name: str
    mode: str | tuple[str, ...]
    include_prompt: bool = True
    dense: tuple[int, str] | None = None  # (out_features, torch.nn activation class name)
    normalize: bool = False
    normalize_first: bool = False  # a Normalize before the Dense (Pooling, Normalize, Dense)
    max_seq_length: int | None = None
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt: str | None = None
    similarity: str | None = None  # similarity_fn_name (None: sentence-transformers' default)


VARIANTS = [
    Variant("cls_dense_norm_prompts", "cls", include_prompt=False, dense=(24, "GELU"),
            normalize=True, max_seq_length=64, prompts=PROMPTS, default_prompt="document"),
    Variant("cls_norm_prompts_counted", "cls", normalize=True, prompts=PROMPTS,
            default_prompt="document"),  # the last layer at the [CLS] token alone
    Variant("max_len64", "max", max_seq_length=64),
    Variant("mean_norm_prompts", "mean", normalize=True, prompts=PROMPTS,
            default_prompt="document"),
    Variant("mean_sqrt_len_dense_tanh", "mean_sqrt_len_tokens", dense=(16, "Tanh")),
    Variant("weightedmean_no_prompt_tokens", "weightedmean", include_prompt=False,
            prompts=PROMPTS, default_prompt="search", max_seq_length=48),
    Variant("lasttoken_norm", "lasttoken", normalize=True, prompts={"query": "query: "}),
    Variant("cls_and_mean_dense_identity", ("cls", "mean"), dense=(16, "Identity")),
    Variant("mean_norm_then_dense", "mean", dense=(16, "Tanh"), normalize_first=True,
            prompts=PROMPTS, default_prompt="document"),  # vectors not unit length
]


def save_variant(base: Path, target: Path, v: Variant) -> Path:
    """``v`` around the tiny BERT in ``base``, saved by sentence-transformers into ``target``."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Dense,
        Normalize,
        Pooling,
        Transformer,
    )

    transformer = Transformer(str(base), max_seq_length=v.max_seq_length)
    pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode=v.mode,
                      include_prompt=v.include_prompt)
    modules = [transformer, pooling]
    if v.normalize_first:
        modules.append(Normalize())
    if v.dense:
        torch.manual_seed(1)
        out, activation = v.dense
        modules.append(Dense(pooling.get_embedding_dimension(), out,
                             activation_function=getattr(torch.nn, activation)()))
    if v.normalize:
        modules.append(Normalize())
    model = SentenceTransformer(modules=modules, prompts=dict(v.prompts),
                                default_prompt_name=v.default_prompt, device="cpu",
                                similarity_fn_name=v.similarity)
    model.save(str(target))
    return target
