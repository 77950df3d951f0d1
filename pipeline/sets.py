"""A pooler set on disk: ``OUT/sets/<set>/`` with its parts, metadata, markers and changes.

Layout (the index reads only the first three)::

    part-<shard>.parquet        id, embedding (fixed_size_list<float32>[dim])
    _SET.json                   SetMeta
    _changes/<generation>.json  parts written and ids deleted by the run of that generation
    _hashes/<shard>.parquet     id, hash (uint64 content hash of the text) per row of the part,
                                and the generation that wrote it (schema metadata)
    _done/<shard>.json          ShardMarker, written after the part and its hashes
    _removed/<gen>-<shard>.json ids a run of that generation removed, written BEFORE the part
                                that drops them, so a crash cannot lose a deletion

A shard counts as done only through its marker, and the marker is written last, so a crash
at any point leaves either a complete shard or one that the next run redoes.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict

from pipeline import storage
from pipeline.errors import FingerprintError, StorageError


class SetMeta(BaseModel):
    """``_SET.json``: what made the set's vectors and how far the set has got."""

    model_config = ConfigDict(extra="ignore")

    name: str
    fingerprint: str
    model: str
    model_hash: str
    encoder: dict
    pooler: dict
    dim: int
    dtype: str
    normalize: bool
    max_length: int
    window: dict | None = None
    id_type: str = "string"
    corpus: str | None = None  # where the texts are: search joins snippets back by id
    id_column: str = "id"
    text_column: str = "text"
    shards_done: int = 0
    rows_written: int = 0
    rows_skipped: dict[str, int] = {}
    generation: int = 0


class ShardMarker(BaseModel):
    """``_done/<shard>.json``: the shard's part (if it has rows) and hashes are complete."""

    model_config = ConfigDict(extra="ignore")

    shard: str
    file: str
    first_group: int
    end_group: int
    signature: str
    rows: int
    skipped: dict[str, int] = {}
    generation: int  # the generation that last wrote the part


def set_url(out: str, name: str) -> str:
    return storage.join(out, "sets", name)


def part_name(shard: str) -> str:
    return f"part-{shard}.parquet"


def part_url(out: str, name: str, shard: str) -> str:
    return storage.join(set_url(out, name), part_name(shard))


def _hashes_url(out: str, name: str, shard: str) -> str:
    return storage.join(set_url(out, name), "_hashes", f"{shard}.parquet")


def _marker_url(out: str, name: str, shard: str) -> str:
    return storage.join(set_url(out, name), "_done", f"{shard}.json")


def changes_url(out: str, name: str, generation: int) -> str:
    return storage.join(set_url(out, name), "_changes", f"{generation:06d}.json")


def quarantine_url(out: str, shard: str) -> str:
    return storage.join(out, "_quarantine", f"{shard}.parquet")


# ---- metadata ------------------------------------------------------------------------------


def list_sets(out: str) -> list[str]:
    """Names of the sets under ``OUT/sets`` that have metadata."""
    found = []
    for url in storage.list_dirs(storage.join(out, "sets")):
        name = url.rstrip("/").rsplit("/", 1)[-1]
        if storage.exists(storage.join(url, "_SET.json")):
            found.append(name)
    return sorted(found)


def read_meta(out: str, name: str) -> SetMeta | None:
    url = storage.join(set_url(out, name), "_SET.json")
    if not storage.exists(url):
        return None
    return SetMeta.model_validate(storage.read_json(url))


def write_meta(out: str, meta: SetMeta) -> None:
    storage.write_json(storage.join(set_url(out, meta.name), "_SET.json"), meta.model_dump())


def claim(out: str, meta: SetMeta) -> SetMeta:
    """The set's stored metadata, after checking it was made the same way; new sets are created.

    Writing ``_SET.json`` before any part means a crashed first run cannot be resumed with
    another model or pooler and leave a set of mixed vectors.
    """
    stored = read_meta(out, meta.name)
    where = set_url(out, meta.name)
    if stored is None:
        done = storage.join(where, "_done")
        if storage.list_files(where, ".parquet") or storage.list_files(done):
            raise FingerprintError(
                f"{where} holds parts but no _SET.json; remove it or use another OUT"
            )
        write_meta(out, meta)
        return meta
    if stored.fingerprint != meta.fingerprint:
        raise FingerprintError(
            f"set {meta.name!r} in {out} was made with fingerprint {stored.fingerprint} "
            f"(model {stored.model}, pooler {stored.pooler.get('strategy')}), this job makes "
            f"{meta.fingerprint} (model {meta.model}); use another set name or another OUT"
        )
    if stored.id_type != meta.id_type:
        raise FingerprintError(
            f"set {meta.name!r} in {out} stores {stored.id_type} ids, the corpus has {meta.id_type}"
        )
    return stored


# ---- parts and hashes ----------------------------------------------------------------------


def write_part(out: str, name: str, shard: str, ids: pa.Array, vectors: np.ndarray) -> str:
    """Write one part atomically; returns its file name."""
    flat = pa.array(np.ascontiguousarray(vectors, dtype=np.float32).ravel(), pa.float32())
    embedding = pa.FixedSizeListArray.from_arrays(flat, vectors.shape[1])
    table = pa.table({"id": ids, "embedding": embedding})
    storage.write_parquet(part_url(out, name, shard), table)
    return part_name(shard)


def read_part(out: str, name: str, shard: str) -> tuple[pa.Array, np.ndarray]:
    table = storage.read_parquet(part_url(out, name, shard))
    column = table.column("embedding").combine_chunks()
    dim = column.type.list_size
    vectors = column.values.to_numpy(zero_copy_only=False).reshape(-1, dim)
    return table.column("id").combine_chunks(), vectors


def write_hashes(
    out: str, name: str, shard: str, ids: pa.Array, hashes: np.ndarray, generation: int
) -> None:
    table = pa.table({"id": ids, "hash": pa.array(hashes, pa.uint64())})
    table = table.replace_schema_metadata({"generation": str(generation)})
    storage.write_parquet(_hashes_url(out, name, shard), table)


def read_hashes(out: str, name: str, shard: str) -> tuple[pa.Array, np.ndarray, int]:
    """Ids, content hashes and writing generation of a shard's part (empty, -1 if none)."""
    url = _hashes_url(out, name, shard)
    if not storage.exists(url):
        return pa.array([]), np.zeros(0, np.uint64), -1
    table = storage.read_parquet(url)
    ids = table.column("id").combine_chunks()
    generation = int((table.schema.metadata or {}).get(b"generation", b"-1"))
    return ids, table.column("hash").combine_chunks().to_numpy(zero_copy_only=False), generation


def remove_part(out: str, name: str, shard: str) -> None:
    storage.remove(part_url(out, name, shard))
    storage.remove(_hashes_url(out, name, shard))


# ---- markers and changes -------------------------------------------------------------------


def write_marker(out: str, name: str, marker: ShardMarker) -> None:
    storage.write_json(_marker_url(out, name, marker.shard), marker.model_dump(mode="json"))


def read_markers(out: str, name: str) -> dict[str, ShardMarker]:
    markers = {}
    for url in storage.list_files(storage.join(set_url(out, name), "_done"), ".json"):
        try:
            marker = ShardMarker.model_validate(storage.read_json(url))
        except (StorageError, ValueError):
            continue  # unreadable marker: the shard is simply redone
        markers[marker.shard] = marker
    return markers


def remove_marker(out: str, name: str, shard: str) -> None:
    storage.remove(_marker_url(out, name, shard))


def _removed_dir(out: str, name: str) -> str:
    return storage.join(set_url(out, name), "_removed")


def record_removed(out: str, name: str, generation: int, shard: str, ids: list) -> None:
    """Add ``ids`` to what ``generation`` removed from ``shard`` (merged with earlier attempts)."""
    if not ids:
        return
    url = storage.join(_removed_dir(out, name), f"{generation:06d}-{shard}.json")
    earlier = storage.read_json(url)["ids"] if storage.exists(url) else []
    storage.write_json(url, {"generation": generation, "ids": list(dict.fromkeys(earlier + ids))})


def removed_ids(out: str, name: str, generation: int) -> list:
    found: list = []
    for url in storage.list_files(_removed_dir(out, name), ".json"):
        if url.rsplit("/", 1)[-1].startswith(f"{generation:06d}-"):
            found.extend(storage.read_json(url)["ids"])
    return list(dict.fromkeys(found))


def clear_removed(out: str, name: str, up_to: int) -> None:
    """Forget removal records of generations already written to a changes file."""
    for url in storage.list_files(_removed_dir(out, name), ".json"):
        if int(url.rsplit("/", 1)[-1].split("-", 1)[0]) <= up_to:
            storage.remove(url)


def write_changes(out: str, name: str, generation: int, parts: list[str], deleted: list) -> None:
    payload = {"generation": generation, "parts": sorted(parts), "deleted_ids": deleted}
    storage.write_json(changes_url(out, name, generation), payload)
