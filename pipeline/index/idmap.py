"""The id map: FAISS int64 labels back to corpus ids, stored as Parquet (``label``, ``id``).

Labels are appended in increasing order, so the live labels stay sorted and a label -> id
lookup is a binary search. A label missing from the map is dead (its row was deleted or
rewritten): search drops it even where the index itself cannot remove it (HNSW masks it).

The map knows only live labels: ``next_label`` is one past the highest LIVE one, and a dead
label above it may still be in the index. So a label is never handed out twice only because
builds take labels from the index's high-water mark (``IndexMeta.next_label``, which never
goes down), not from the map alone.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.errors import StorageError


class IdMap:
    def __init__(self, labels: np.ndarray, ids: pa.Array) -> None:
        self.labels = np.asarray(labels, dtype=np.int64)
        self.ids = ids

    @classmethod
    def empty(cls, id_type: pa.DataType) -> IdMap:
        return cls(np.zeros(0, np.int64), pa.array([], id_type))

    @classmethod
    def from_table(cls, table: pa.Table, where: str) -> IdMap:
        if table.column_names[:2] != ["label", "id"] or table.schema.field(0).type != pa.int64():
            raise StorageError(f"{where} is not an id map (columns label int64, id)")
        labels = table.column("label").to_numpy()
        if len(labels) > 1 and not np.all(np.diff(labels) > 0):
            raise StorageError(f"{where}: labels are not strictly increasing")
        if len(labels) and labels[0] < 0:
            raise StorageError(f"{where}: a label is negative")
        ids = table.column("id").combine_chunks()
        if not (pa.types.is_integer(ids.type) or pa.types.is_string(ids.type)
                or pa.types.is_large_string(ids.type)):
            raise StorageError(f"{where}: its ids are {ids.type}, not integers or strings")
        if ids.null_count or pc.count_distinct(ids).as_py() != len(ids):
            raise StorageError(f"{where}: its ids are not distinct, or some are null")
        return cls(labels, ids)

    def to_table(self) -> pa.Table:
        return pa.table({"label": pa.array(self.labels, pa.int64()), "id": self.ids})

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def next_label(self) -> int:
        """One past the highest live label (not a high-water mark: see the module's doc)."""
        return int(self.labels[-1]) + 1 if len(self.labels) else 0

    def append(self, labels: np.ndarray, ids: pa.Array) -> None:
        if len(labels) and len(self.labels) and labels[0] <= self.labels[-1]:
            raise ValueError("labels must be appended in increasing order")
        if len(self.ids) and ids.type != self.ids.type:
            ids = ids.cast(self.ids.type)
        self.labels = np.concatenate([self.labels, np.asarray(labels, np.int64)])
        self.ids = pa.concat_arrays([self.ids, ids]) if len(self.ids) else ids

    def drop_ids(self, ids: pa.Array) -> np.ndarray:
        """Forget every entry whose corpus id is in ``ids``; returns their labels."""
        if not len(ids) or not len(self.ids):
            return np.zeros(0, np.int64)
        if ids.type != self.ids.type:
            ids = ids.cast(self.ids.type)
        hit = pc.is_in(self.ids, value_set=ids).to_numpy(zero_copy_only=False)
        dropped = self.labels[hit]
        keep = ~hit
        self.labels = self.labels[keep]
        self.ids = self.ids.filter(pa.array(keep))
        return dropped

    def lookup(self, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(positions into ``ids``, live mask) for FAISS result labels (-1 = no result)."""
        flat = np.asarray(labels, np.int64).ravel()
        pos = np.searchsorted(self.labels, flat)
        pos = np.minimum(pos, max(len(self.labels) - 1, 0))
        live = (flat >= 0) & (len(self.labels) > 0)
        if len(self.labels):
            live &= self.labels[pos] == flat
        return pos.reshape(np.shape(labels)), live.reshape(np.shape(labels))
