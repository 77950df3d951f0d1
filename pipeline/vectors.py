"""Row-wise vector arithmetic shared by the embedder, search, the server, benches and tests."""

from __future__ import annotations

import numpy as np

EPS = 1e-12  # a zero row stays zero


def unit_rows(vectors: np.ndarray) -> np.ndarray:
    """``vectors`` with each row scaled to unit L2 length."""
    return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), EPS)


def row_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine between each row of ``a`` and the same row of ``b``."""
    return (unit_rows(a) * unit_rows(b)).sum(axis=1)
