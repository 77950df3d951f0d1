"""Incremental runs after rows moved: what is embedded again, and the time, against the first run.

    python bench/moved_rows.py --rows 20000

Writes ``--rows`` rows of the corpus as ``--files`` files, embeds them (the default model,
``--incremental`` runs through the Python API, one process), then changes the corpus the ways
a nightly export does and reruns incrementally after each: every file rewritten in another
row order; the files compacted into two new files; nothing changed. Prints one JSON line per
run with the rows embedded and reused and the wall time, and the CPU flags. With ``--index
KIND`` each run is followed by ``embedpipe.index`` (a KIND index built after the first run, a
catch-up after the others): its action, the rows it holds masked, and its time.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import embedpipe  # noqa: E402
from bench.speed import DATA, cpu_flags  # noqa: E402


def write_files(folder: Path, table: pa.Table, files: int, prefix: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    step = -(-table.num_rows // files)
    for k in range(files):
        pq.write_table(table.slice(k * step, step), folder / f"{prefix}{k:03d}.parquet",
                       row_group_size=1000)


def shuffled(table: pa.Table, seed: int) -> pa.Table:
    order = list(range(table.num_rows))
    random.Random(seed).shuffle(order)
    return table.take(pa.array(order))


def run(step: str, corpus: Path, out: Path, rows_per_shard: int, index: str | None) -> dict:
    started = time.perf_counter()
    summary = embedpipe.embed(str(corpus), str(out), incremental=True,
                              rows_per_shard=rows_per_shard)
    seconds = time.perf_counter() - started
    result = {"step": step, "embedded": summary["embedded"], "reused": summary["reused"],
              "rows": summary["rows"], "seconds": round(seconds, 2)}
    if index:
        started = time.perf_counter()
        [built] = embedpipe.index(str(out), kind=index)
        result["index"] = {"action": built.action, "reason": built.reason,
                           "kind": built.meta.kind, "rows": built.meta.rows,
                           "masked": built.meta.masked,
                           "seconds": round(time.perf_counter() - started, 2)}
    print(json.dumps(result), flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default=str(DATA))
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--rows-per-shard", type=int, default=2_000)
    parser.add_argument("--index", metavar="KIND", help="index after each run (flat, hnsw, ...)")
    args = parser.parse_args()
    per_shard, index = args.rows_per_shard, args.index
    table = pq.read_table(args.corpus).slice(0, args.rows).select(["id", "text"])
    work = Path(tempfile.mkdtemp(prefix="moved-rows-"))
    corpus, out = work / "corpus", work / "out"
    print(json.dumps({"cpu_flags": cpu_flags(), "rows": table.num_rows, "files": args.files,
                      "rows_per_shard": args.rows_per_shard}), flush=True)
    try:
        write_files(corpus, table, args.files, "part-")
        first = run("first run", corpus, out, per_shard, index)
        write_files(corpus, shuffled(table, 0), args.files, "part-")
        steps = [run("every file rewritten in another row order", corpus, out, per_shard, index)]
        write_files(corpus, shuffled(table, 1), 2, "compacted-")
        steps.append(run("compacted into 2 new files", corpus, out, per_shard, index))
        steps.append(run("nothing changed", corpus, out, per_shard, index))
        for s in steps:
            print(json.dumps({"step": s["step"], "time_vs_first_run":
                              round(s["seconds"] / first["seconds"], 3)}))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
