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
import pyarrow.parquet as pq

from pipeline import storage
from pipeline.sets import SetFolder, SetMeta, check_ids
from pipeline.vectors import unit_rows, vectors_of


@dataclass(frozen=True)
class Part:
    url: str
    name: str
    rows: int
    groups: tuple[int, ...]  # rows per row group
    footer: pq.FileMetaData  # as ``SetFolder.checked_parts`` read it: not read again

    def open(self) -> pq.ParquetFile:
        return storage.parquet_file(self.url, self.footer)


@dataclass(frozen=True)
class SetVectors:
    """Parts of a set as search reads them: ``dim``-wide float32 rows, scaled to unit length
    where the set is searched by cosine (``unit``, from ``SetMeta.unit_search``)."""

    parts: list[Part]
    dim: int
    unit: bool = False

    @classmethod
    def of(cls, folder: SetFolder, info: SetMeta) -> SetVectors:
        """Every done part of the set, checked (``SetFolder.checked_parts``)."""
        parts = [_part(url, meta) for url, meta in folder.checked_parts(info)]
        return cls(parts, info.dim, info.unit_search)

    def only(self, names: list[str]) -> SetVectors:
        """The parts named ``names`` (file names), in that order, where they are still parts."""
        by_name = {part.name: part for part in self.parts}
        return SetVectors([by_name[n] for n in names if n in by_name], self.dim, self.unit)

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.parts)

    def iter_batches(self, batch_rows: int) -> Iterator[tuple[pa.Array, np.ndarray]]:
        """(ids, vectors) of every row, in part order, ``batch_rows`` at a time."""
        for part in self.parts:
            with part.open() as pf, storage.explained(part.url, "read"):
                for batch in pf.iter_batches(batch_size=batch_rows, columns=["id", "embedding"]):
                    yield (check_ids(batch.column(0), part.url),
                           self._vectors(batch.column(1), part.url))

    def gather(self, positions: np.ndarray) -> tuple[pa.Array, np.ndarray]:
        """The rows at sorted global ``positions`` (over parts in order), reading only their
        row groups."""
        ids, vectors = [], []
        offset = 0
        for part in self.parts:
            pf = None
            for group, rows in enumerate(part.groups):
                lo, hi = np.searchsorted(positions, [offset, offset + rows])
                if hi > lo:
                    pf = pf or part.open()
                    with storage.explained(part.url, "read"):
                        table = pf.read_row_group(group, columns=["id", "embedding"])
                    take = pa.array(positions[lo:hi] - offset)
                    ids.append(check_ids(table.column("id").take(take), part.url).combine_chunks())
                    vectors.append(self._vectors(table.column("embedding").take(take), part.url))
                offset += rows
            if pf is not None:
                pf.close()
        if not ids:
            return pa.array([]), np.zeros((0, self.dim), np.float32)
        return pa.concat_arrays(ids), np.concatenate(vectors)

    def _vectors(self, column: pa.Array | pa.ChunkedArray, where: str) -> np.ndarray:
        vectors = vectors_of(column, where, self.dim)
        return unit_rows(vectors) if self.unit else vectors


def _part(url: str, meta: pq.FileMetaData) -> Part:
    """A part's layout from its (checked: ``SetFolder.checked_parts``) footer."""
    groups = tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
    return Part(url=url, name=url.rsplit("/", 1)[-1], rows=meta.num_rows, groups=groups,
                footer=meta)


def read_ids(url: str) -> pa.Array:
    """The id column of one part."""
    return check_ids(storage.read_parquet(url, columns=["id"]).column("id"), url).combine_chunks()
