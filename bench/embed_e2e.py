"""End-to-end `embedpipe embed` on a corpus: wall time, docs/s and peak memory, sampled.

    python bench/embed_e2e.py /work/shared/data/pypi_summaries_200k.parquet /tmp/out200k

Runs the real command line (default model, Prefect's ephemeral API) in a child process and
samples the resident memory of it and its children every second, so a flat curve over the
run shows that memory does not grow with the corpus. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import time

import psutil


def rss_tree(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus")
    parser.add_argument("out")
    parser.add_argument("extra", nargs="*", help="more flags for embedpipe embed")
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    cmd = ["embedpipe", "embed", args.corpus, args.out, *args.extra]
    started = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    proc = psutil.Process(child.pid)
    samples = []
    while child.poll() is None:
        samples.append(rss_tree(proc))
        time.sleep(1.0)
    wall = time.perf_counter() - started
    line = child.stdout.read().strip()
    rows = int(line.split()[1].replace(",", "")) if line.startswith("embedded") else 0
    quarter = max(1, len(samples) // 4)
    print(json.dumps({
        "command": " ".join(cmd),
        "exit": child.returncode,
        "wall_s": round(wall, 1),
        "rows": rows,
        "docs_per_s_end_to_end": round(rows / wall, 1) if wall else None,
        "peak_rss_mb": round(max(samples, default=0) / 2**20),
        "rss_mb_second_quarter": round(max(samples[quarter : 2 * quarter], default=0) / 2**20),
        "rss_mb_last_quarter": round(max(samples[-quarter:], default=0) / 2**20),
        "summary": line,
    }))
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
