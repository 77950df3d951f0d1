"""What every int8 kernel must give: vectors close to fp32's yet changed, in a set of their own."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.config import EncoderConfig, PoolerSpec
from pipeline.embedder import Embedder
from pipeline.vectors import row_cosines
from tests._flowkit import text_for

TEXTS = [text_for(i) for i in range(40)]


def embedder(model: Path, dtype: str, *poolers: PoolerSpec, **encoder) -> Embedder:
    return Embedder(EncoderConfig(model=str(model), dtype=dtype, device="cpu", **encoder),
                    list(poolers) or [PoolerSpec(name="mean")])


def check_int8_vectors(fp32: Embedder, int8: Embedder, suffix: str) -> np.ndarray:
    """``int8``'s vectors of TEXTS, checked against ``fp32``'s; its model hash ends in
    ``suffix`` (the int8 kernel's)."""
    assert int8.info.dtype == "int8"
    a, b = fp32.encode(TEXTS), int8.encode(TEXTS)
    cosine = row_cosines(a, b)
    assert cosine.min() > 0.95
    assert not np.allclose(a, b, atol=1e-6)  # the vectors really changed...
    assert int8.fingerprint("mean") != fp32.fingerprint("mean")  # ...so the set is another
    assert int8.info.model_hash == f"{fp32.info.model_hash}{suffix}"
    return b


def check_text_alone(int8: Embedder) -> None:
    """A text's int8 vector is the same encoded alone, with TEXTS, or beside longer batch-mates
    (more padding): its input scales do not come from the batch."""
    together = int8.encode(TEXTS)
    alone = np.concatenate([int8.encode([text]) for text in TEXTS[:6]])
    np.testing.assert_allclose(alone, together[:6], atol=1e-6)
    others = [text_for(i) * 3 for i in range(100, 140)]
    np.testing.assert_allclose(int8.encode(TEXTS[:6] + others)[:6], together[:6], atol=1e-6)
