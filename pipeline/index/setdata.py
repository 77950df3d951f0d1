"""Reading a set's parts for indexing, streamed in batches.

Where the parts are and what ``_SET.json`` and ``_changes`` say comes from
``pipeline.sets.SetFolder`` (the one reader of a set's files); this module reads the parts'
vectors, one row group at a time, and checks their shape against the set's dimension.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from pipeline import storage
from pipeline.errors import FingerprintError, StorageError
from pipeline.sets import SetFolder
from pipeline.vectors import unit_rows


@dataclass(frozen=True)
class Part:
    url: str
    name: str
    rows: int
    groups: tuple[int, ...]  # rows per row group


def list_parts(folder: SetFolder, dim: int) -> list[Part]:
    """The set's parts, with their row counts, checked against the set's dimension."""
    return [open_part(url, dim) for url in folder.part_urls()]


def open_part(url: str, dim: int) -> Part:
    """A part's layout from its footer; a part of another shape is refused by name."""
    pf = storage.parquet_file(url)
    schema = pf.schema_arrow
    if "id" not in schema.names or "embedding" not in schema.names:
        raise StorageError(f"{url} is not a set part: it needs columns id and embedding")
    kind = schema.field("embedding").type
    if not pa.types.is_fixed_size_list(kind) or kind.value_type != pa.float32():
        raise FingerprintError(f"{url}: embedding is {kind}, not fixed_size_list<float32>")
    if kind.list_size != dim:
        raise FingerprintError(
            f"{url} holds {kind.list_size}-dim vectors but the set's _SET.json says dim {dim}; "
            "the set mixes vectors of two shapes"
        )
    meta = pf.metadata
    groups = tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
    return Part(url=url, name=url.rsplit("/", 1)[-1], rows=meta.num_rows, groups=groups)


def vectors_of(column: pa.Array | pa.ChunkedArray, dim: int, where: str,
               unit: bool = False) -> np.ndarray:
    """A float32 (rows, dim) matrix from a fixed_size_list column; ``unit``: rows scaled to
    unit length (search by cosine, ``SetMeta.unit_search``)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if column.null_count:
        raise StorageError(f"{where} has {column.null_count} null embeddings")
    flat = column.flatten().to_numpy(zero_copy_only=False)
    vectors = np.ascontiguousarray(flat.reshape(-1, dim), dtype=np.float32)
    return unit_rows(vectors) if unit else vectors


def iter_batches(parts: list[Part], dim: int, batch_rows: int,
                 unit: bool = False) -> Iterator[tuple[pa.Array, np.ndarray]]:
    """(ids, vectors) of every row of ``parts``, in part order, ``batch_rows`` at a time."""
    for part in parts:
        pf = storage.parquet_file(part.url)
        with storage.explained(part.url, "read"):
            for batch in pf.iter_batches(batch_size=batch_rows, columns=["id", "embedding"]):
                yield batch.column(0), vectors_of(batch.column(1), dim, part.url, unit)


def gather(parts: list[Part], dim: int, positions: np.ndarray,
           unit: bool = False) -> tuple[pa.Array, np.ndarray]:
    """The rows at sorted global ``positions`` (over parts in order), reading only their groups."""
    ids, vectors = [], []
    offset = 0
    for part in parts:
        pf = None
        for group, rows in enumerate(part.groups):
            lo, hi = np.searchsorted(positions, [offset, offset + rows])
            if hi > lo:
                pf = pf or storage.parquet_file(part.url)
                with storage.explained(part.url, "read"):
                    table = pf.read_row_group(group, columns=["id", "embedding"])
                take = pa.array(positions[lo:hi] - offset)
                ids.append(table.column("id").take(take).combine_chunks())
                vectors.append(vectors_of(table.column("embedding").take(take), dim, part.url,
                                          unit))
            offset += rows
    if not ids:
        return pa.array([]), np.zeros((0, dim), np.float32)
    return pa.concat_arrays(ids), np.concatenate(vectors)


def read_ids(url: str) -> pa.Array:
    """The id column of one part."""
    return storage.read_parquet(url, columns=["id"]).column("id").combine_chunks()
