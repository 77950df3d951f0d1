"""Writing embedding sets for index tests, following the on-disk contract (COMMON.md).

``OUT/sets/<set>/part-*.parquet`` (id, embedding) each with its done marker
(``_done/<shard>.json``: readers take marked parts only), ``_SET.json`` and
``_changes/<g>.json``.
Like ``SetFolder.claim``, ``write_set`` gives each set it makes a fresh ``token``. Vectors
are synthetic: clustered (for recall of approximate kinds) or exactly known.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def clustered(rows: int, dim: int, seed: int = 0, clusters: int = 64,
              spread: float = 0.35, normalize: bool = True) -> np.ndarray:
    """Gaussian blobs around random centres: a realistic shape for IVF/HNSW recall."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, dim)).astype(np.float32)
    which = rng.integers(0, clusters, rows)
    x = centres[which] + spread * rng.standard_normal((rows, dim)).astype(np.float32)
    if normalize:
        x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x.astype(np.float32)


def part_table(ids: list | np.ndarray, vectors: np.ndarray,
               id_type: pa.DataType | None = None) -> pa.Table:
    flat = pa.array(np.ascontiguousarray(vectors, np.float32).ravel(), pa.float32())
    emb = pa.FixedSizeListArray.from_arrays(flat, vectors.shape[1])
    return pa.table({"id": pa.array(ids, id_type), "embedding": emb})


def meta(name: str, dim: int, normalize: bool = True, generation: int = 1,
         fingerprint: str = "fp-test", id_type: str = "int64", **extra) -> dict:
    return {
        "name": name, "fingerprint": fingerprint, "model": "synthetic", "model_hash": "none",
        "encoder": {}, "pooler": {"name": name}, "dim": dim, "dtype": "fp32",
        "normalize": normalize, "max_length": 128, "window": None, "shards_done": 1,
        "rows_written": 0, "rows_skipped": {}, "generation": generation, "id_type": id_type,
        **extra,
    }


def write_set(out: Path, name: str, ids, vectors: np.ndarray, parts: int = 3,
              normalize: bool = True, generation: int = 1, changes: bool = True,
              row_group: int = 1000, **extra) -> list[str]:
    """Write a whole set (split into ``parts``) with a fresh token unless ``extra`` names
    one; returns the part names."""
    extra.setdefault("token", uuid.uuid4().hex)
    folder = out / "sets" / name
    folder.mkdir(parents=True, exist_ok=True)
    ids = list(ids)
    id_type = pa.array(ids).type if ids else pa.int64()  # what every part of it stores
    extra.setdefault("id_type", str(id_type))
    # as the run that wrote the parts recorded them at its end (read_set warns otherwise)
    extra.setdefault("shards_done", parts)
    extra.setdefault("rows_written", len(ids))
    names = []
    for i, chunk in enumerate(np.array_split(np.arange(len(ids)), parts)):
        part = f"part-{i:05d}.parquet"
        pq.write_table(part_table([ids[j] for j in chunk], vectors[chunk], id_type),
                       folder / part, row_group_size=row_group)
        write_marker(out, name, part, len(chunk), generation)
        names.append(part)
    write_meta(out, name, meta(name, vectors.shape[1], normalize, generation, **extra))
    if changes:
        write_changes(out, name, generation, names, [])
    return names


def write_part(out: Path, name: str, part: str, ids, vectors: np.ndarray) -> None:
    """A done part: the part, then its marker."""
    ids = list(ids)
    pq.write_table(part_table(ids, vectors), out / "sets" / name / part)
    write_marker(out, name, part, len(ids))


def write_marker(out: Path, name: str, part: str, rows: int, generation: int = 1) -> None:
    """``part``'s done marker (a ``pipeline.sets.ShardMarker``)."""
    shard = part.removeprefix("part-").removesuffix(".parquet")
    folder = out / "sets" / name / "_done"
    folder.mkdir(parents=True, exist_ok=True)
    marker = {"shard": shard, "file": "synthetic.parquet", "first_group": 0, "end_group": 1,
              "signature": "synthetic", "rows": rows, "generation": generation}
    (folder / f"{shard}.json").write_text(json.dumps(marker))


def write_meta(out: Path, name: str, payload: dict) -> None:
    (out / "sets" / name / "_SET.json").write_text(json.dumps(payload))


def bump(out: Path, name: str, parts: list[str], deleted: list, **changes) -> int:
    """Record a run: generation + 1, its changes file; returns the new generation."""
    path = out / "sets" / name / "_SET.json"
    payload = json.loads(path.read_text()) | changes
    payload["generation"] += 1
    path.write_text(json.dumps(payload))
    write_changes(out, name, payload["generation"], parts, deleted)
    return payload["generation"]


def write_changes(out: Path, name: str, generation: int, parts: list[str], deleted: list) -> None:
    folder = out / "sets" / name / "_changes"
    folder.mkdir(parents=True, exist_ok=True)
    body = {"generation": generation, "parts": parts, "deleted_ids": deleted}
    (folder / f"{generation:06d}.json").write_text(json.dumps(body))


def exact_top(vectors: np.ndarray, queries: np.ndarray, k: int, metric: str = "ip") -> np.ndarray:
    """Positions of the exact top-k by brute force in numpy (independent of FAISS)."""
    if metric == "ip":
        scores = queries @ vectors.T
        return np.argsort(-scores, axis=1, kind="stable")[:, :k]
    d = ((queries[:, None, :] - vectors[None, :, :]) ** 2).sum(-1)
    return np.argsort(d, axis=1, kind="stable")[:, :k]
