"""Row-wise vector arithmetic shared by the embedder, search, the server, benches and tests,
and vectors as the fixed-size-list column a set stores them in."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pipeline.errors import StorageError

if TYPE_CHECKING:
    import pyarrow as pa

EPS = 1e-12  # a zero row stays zero


def unit_rows(vectors: np.ndarray) -> np.ndarray:
    """``vectors`` with each row scaled to unit L2 length."""
    return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), EPS)


def row_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine between each row of ``a`` and the same row of ``b``."""
    return (unit_rows(a) * unit_rows(b)).sum(axis=1)


def nonfinite_rows(vectors: np.ndarray) -> np.ndarray:
    """Positions of the rows of ``vectors`` holding a NaN or an infinity (no search finds them)."""
    return np.flatnonzero(~np.isfinite(vectors).all(axis=1))


def vector_column(vectors: np.ndarray) -> pa.FixedSizeListArray:
    """A [rows, dim] matrix as a ``fixed_size_list<float32>[dim]`` column."""
    import pyarrow as pa

    flat = pa.array(np.ascontiguousarray(vectors, np.float32).ravel(), pa.float32())
    return pa.FixedSizeListArray.from_arrays(flat, vectors.shape[1])


def vectors_of(column: pa.Array | pa.ChunkedArray, where: str, dim: int | None = None
               ) -> np.ndarray:
    """A float32 (rows, dim) matrix from a fixed_size_list column (``dim``: its list size
    unless given); null rows, and rows with a NaN or infinity (which no search finds, and
    which an index's recall check does not see), are refused naming ``where``."""
    if hasattr(column, "combine_chunks"):
        column = column.combine_chunks()
    if column.null_count:
        raise StorageError(f"{where} has {column.null_count} null embeddings")
    flat = column.flatten().to_numpy(zero_copy_only=False)
    matrix = np.ascontiguousarray(flat.reshape(-1, dim or column.type.list_size), np.float32)
    bad = len(nonfinite_rows(matrix))
    if bad:
        raise StorageError(f"{where} has {bad:,} embeddings that are not finite (NaN or "
                           "infinity); remove it and run embed again, which redoes them")
    return matrix
