"""Index benchmark: ``auto`` on N x D synthetic clustered vectors within a memory budget.

Writes a set following the on-disk contract (parts of 100k rows), builds the index with
``index_set`` (kind ``auto``), then measures, against exact search (FAISS IndexFlat over the
same vectors): recall@10 on fresh queries, queries/s batched and one at a time, build time,
index size on disk and the build's peak memory. Prints a table and writes JSON.

    python bench/index_1m.py                         # 1,000,000 x 384, budget 2GB
    python bench/index_1m.py --rows 200000 --budget 1GB --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import faiss
import numpy as np
import pyarrow as pa

from pipeline.index import IndexRequest, index_set, open_index, read_meta
from pipeline.index.setdata import SetVectors
from pipeline.sets import SetFolder, SetMeta, ShardMarker

PART_ROWS = 100_000


def centres(dim: int, clusters: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((clusters, dim)).astype(np.float32)


def sample(c: np.ndarray, rows: int, rng: np.random.Generator, spread: float) -> np.ndarray:
    x = c[rng.integers(0, len(c), rows)]
    x = x + spread * rng.standard_normal(x.shape, dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


def write_set(out: Path, rows: int, dim: int, c: np.ndarray, spread: float) -> None:
    """A done set through the library's own writer (``SetFolder``): each part with its done
    marker (readers take marked parts only), then ``_SET.json``."""
    folder = SetFolder(str(out), "bench")
    rng = np.random.default_rng(1)
    for n, start in enumerate(range(0, rows, PART_ROWS)):
        x = sample(c, min(PART_ROWS, rows - start), rng, spread)
        shard = f"{n:05d}"
        folder.write_part(shard, pa.array(np.arange(start, start + len(x), dtype=np.int64)), x)
        folder.write_marker(ShardMarker(shard=shard, file="synthetic", first_group=n,
                                        end_group=n + 1, signature="synthetic", rows=len(x),
                                        generation=1))
    folder.write_meta(SetMeta(
        name="bench", fingerprint="synthetic", model="synthetic", model_hash="none",
        encoder={}, pooler={"name": "bench"}, dim=dim, dtype="fp32", normalize=True,
        max_length=0, id_type="int64", shards_done=-(-rows // PART_ROWS), rows_written=rows,
        generation=1, token=uuid.uuid4().hex))


def qps(search, queries: np.ndarray, one_at_a_time: int) -> tuple[float, float]:
    """(batched queries/s over all queries, single-query queries/s over the first few)."""
    t = time.perf_counter()
    search(queries)
    batched = len(queries) / (time.perf_counter() - t)
    t = time.perf_counter()
    for q in queries[:one_at_a_time]:
        search(q[None, :])
    single = one_at_a_time / (time.perf_counter() - t)
    return batched, single


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--budget", default="2GB")
    ap.add_argument("--clusters", type=int, default=2_000)
    ap.add_argument("--spread", type=float, default=0.5,
                    help="noise per dimension around a centre (0.5: cosine ~0.8 within a cluster)")
    ap.add_argument("--queries", type=int, default=1_000)
    ap.add_argument("--single", type=int, default=200, help="queries timed one at a time")
    ap.add_argument("--work", help="folder for the set (default: a temporary one)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    work = Path(args.work or tempfile.mkdtemp(prefix="embedpipe-bench-"))
    out = work / "out"
    shutil.rmtree(out, ignore_errors=True)
    c = centres(args.dim, args.clusters, 0)
    t = time.perf_counter()
    write_set(out, args.rows, args.dim, c, args.spread)
    print(f"wrote {args.rows:,} x {args.dim} in {time.perf_counter() - t:.1f}s")
    queries = sample(c, args.queries, np.random.default_rng(2), args.spread)

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t = time.perf_counter()
    result = index_set(IndexRequest(out=str(out), set_name="bench", kind="auto",
                                    memory_budget=args.budget), say=print)
    build_s = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    meta = read_meta(str(out), "bench")
    folder = out / "index" / "bench"
    size = (folder / meta.index_file).stat().st_size + (folder / meta.idmap_file).stat().st_size
    handle = open_index(str(out), meta)
    found = handle.search_labels(queries, 10)[1]
    approx_qps = qps(lambda q: handle.search_labels(q, 10), queries, args.single)

    # Exact search over the same vectors (outside the budget: it holds every vector).
    flat = faiss.IndexFlatIP(args.dim)
    bench_set = SetFolder(str(out), "bench")
    for _, x in SetVectors.of(bench_set, bench_set.meta()).iter_batches(65_536):
        flat.add(x)
    exact_qps = qps(lambda q: flat.search(q, 10), queries, args.single)
    truth = flat.search(queries, 10)[1]  # labels are row numbers = ids = FAISS labels here
    pairs = zip(found, truth, strict=True)
    recall = float(np.mean([len(np.intersect1d(f, t)) / 10 for f, t in pairs]))

    report = {
        "rows": args.rows, "dim": args.dim, "budget": args.budget, "cpus": os.cpu_count(),
        "faiss_threads": faiss.omp_get_max_threads(), "kind": meta.kind,
        "factory": meta.factory, "params": meta.params,
        "tuned_recall_at_10": meta.recall_at_10, "fresh_query_recall_at_10": round(recall, 4),
        "build_seconds": round(build_s, 1), "index_bytes": size,
        "exact_bytes": args.rows * args.dim * 4, "build_peak_rss_bytes": peak,
        "rss_before_build_bytes": rss0,
        "qps_batched": round(approx_qps[0], 1), "qps_single": round(approx_qps[1], 1),
        "exact_qps_batched": round(exact_qps[0], 1), "exact_qps_single": round(exact_qps[1], 1),
        "summary": result.summary(),
    }
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
