"""Reading a set for indexing: its ``_SET.json`` and its parts, streamed in batches.

Only the on-disk contract is used (``OUT/sets/<set>/part-*.parquet`` with ``id`` and
``embedding``; ``_SET.json``; ``_changes/<generation>.json``), so the index never depends on
how the embed flow wrote them. Vectors are read one row group at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, ValidationError

from pipeline import storage
from pipeline.errors import FingerprintError, StorageError
from pipeline.sets import list_sets


class SetInfo(BaseModel):
    """The fields of ``_SET.json`` that indexing and search rely on."""

    model_config = ConfigDict(extra="ignore")

    name: str
    fingerprint: str
    dim: int
    normalize: bool
    encoder: dict
    pooler: dict
    model: str = ""
    generation: int = 0
    id_type: str | None = None
    corpus: str | None = None  # where the texts are, for snippets (if the embed flow records it)
    id_column: str = "id"
    text_column: str = "text"

    @property
    def metric(self) -> str:
        return "ip" if self.normalize else "l2"


@dataclass(frozen=True)
class Part:
    url: str
    name: str
    rows: int
    groups: tuple[int, ...]  # rows per row group


def set_url(out: str, name: str) -> str:
    return storage.join(out, "sets", name)


def read_set(out: str, name: str) -> SetInfo:
    url = storage.join(set_url(out, name), "_SET.json")
    if not storage.exists(url):
        known = list_sets(out)
        raise StorageError(
            f"no set {name!r} under {storage.join(out, 'sets')} (sets there: "
            f"{', '.join(known) if known else 'none'})"
        )
    try:
        return SetInfo.model_validate(storage.read_json(url))
    except ValidationError as exc:
        raise StorageError(f"{url} is not a set description: {exc.errors()[0]['msg']}") from None


def list_parts(out: str, info: SetInfo) -> list[Part]:
    """The set's parts, with their row counts, checked against the set's dimension."""
    parts = []
    for url in storage.list_files(set_url(out, info.name), ".parquet"):
        name = url.rsplit("/", 1)[-1]
        if not name.startswith("part-"):
            continue
        parts.append(open_part(url, info.dim))
    return parts


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


def vectors_of(column: pa.Array | pa.ChunkedArray, dim: int, where: str) -> np.ndarray:
    """A float32 (rows, dim) matrix from a fixed_size_list column."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if column.null_count:
        raise StorageError(f"{where} has {column.null_count} null embeddings")
    flat = column.flatten().to_numpy(zero_copy_only=False)
    return np.ascontiguousarray(flat.reshape(-1, dim), dtype=np.float32)


def iter_batches(parts: list[Part], dim: int,
                 batch_rows: int) -> Iterator[tuple[pa.Array, np.ndarray]]:
    """(ids, vectors) of every row of ``parts``, in part order, ``batch_rows`` at a time."""
    for part in parts:
        pf = storage.parquet_file(part.url)
        with storage.explained(part.url, "read"):
            for batch in pf.iter_batches(batch_size=batch_rows, columns=["id", "embedding"]):
                yield batch.column(0), vectors_of(batch.column(1), dim, part.url)


def gather(parts: list[Part], dim: int, positions: np.ndarray) -> tuple[pa.Array, np.ndarray]:
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
                vectors.append(vectors_of(table.column("embedding").take(take), dim, part.url))
            offset += rows
    if not ids:
        return pa.array([]), np.zeros((0, dim), np.float32)
    return pa.concat_arrays(ids), np.concatenate(vectors)


def read_ids(url: str) -> pa.Array:
    """The id column of one part."""
    return storage.read_parquet(url, columns=["id"]).column("id").combine_chunks()


def read_changes(out: str, name: str, generation: int) -> dict | None:
    """``_changes/<generation>.json``, or None when that run left no changes file."""
    url = storage.join(set_url(out, name), "_changes", f"{generation:06d}.json")
    if not storage.exists(url):
        return None
    payload = storage.read_json(url)
    if not isinstance(payload.get("parts"), list) or not isinstance(
        payload.get("deleted_ids"), list
    ):
        raise StorageError(f"{url} needs lists 'parts' and 'deleted_ids'")
    return payload
