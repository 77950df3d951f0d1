"""Helpers for the corpus, set and flow tests: write corpora, read sets back, run the library."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import EmbedJob, parse
from pipeline.embedder import get_embedder
from pipeline.job import embed_shard
from pipeline.run import RunSummary, finalize, prepare

WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "paper", "engine"]


def text_for(i: int, salt: str = "") -> str:
    words = [WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(3 + i % 9)]
    return f"{salt}doc {i} " + " ".join(words)


def write_corpus(
    path: Path, ids: list, texts: list, row_group_size: int = 10, **columns: list
) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": ids, "text": texts, **columns}), path,
                   row_group_size=row_group_size)
    return path


def job(corpus: Path | str, out: Path | str, model: Path, **kw) -> dict:
    base = {
        "corpus": str(corpus),
        "out": str(out),
        "encoder": {"model": str(model), "dtype": "fp32", "device": "cpu"},
        "poolers": [{"name": "mean"}],
        "rows_per_shard": 20,
    }
    return base | kw


def read_set(out: Path | str, name: str) -> dict:
    """id -> vector over all parts of a set; fails if an id is in two parts."""
    found: dict = {}
    for part in sorted((Path(out) / "sets" / name).glob("part-*.parquet")):
        table = pq.read_table(part)
        column = table.column("embedding").combine_chunks()
        vectors = column.values.to_numpy().reshape(-1, column.type.list_size)
        for i, vec in zip(table.column("id").to_pylist(), vectors, strict=True):
            assert i not in found, f"id {i!r} is in two parts"
            found[i] = vec
    return found


def same_vectors(a: dict, b: dict, atol: float = 0.0) -> bool:
    return a.keys() == b.keys() and all(np.allclose(a[k], b[k], atol=atol, rtol=0) for k in a)


def tree_digest(folder: Path | str) -> dict[str, str]:
    """File name -> sha256 of every file under ``folder``."""
    root = Path(folder)
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def out_digest(out: Path | str) -> dict[str, str]:
    """``tree_digest`` of an OUT without its writer lease, which every writer run renews."""
    from pipeline.lease import LEASE_FILE

    return {k: v for k, v in tree_digest(out).items() if k not in (LEASE_FILE, ".lease.lock")}


def run_library(job_dict: dict, verify: bool = False) -> RunSummary:
    """What the flows do, without Prefect: prepare, every shard in turn, finalize."""
    spec = parse(EmbedJob, job_dict, "job")
    plan = prepare(spec, lambda: get_embedder(spec.encoder, spec.poolers), verify=verify)
    results = [embed_shard(r) for r in plan.requests]
    return finalize(plan, results, 1.0)
