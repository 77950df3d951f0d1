"""S3 requests and seconds of a run's reads, on a real S3 API (moto in server mode on loopback)
with a store's latency added to every request: a first embed, a rerun with nothing to do (a
nightly run of an unchanged corpus), ``read_set`` and an index build, on one tree or on two
(``--before`` and ``--after``, each run in a process of its own, in one invocation).

    python bench/s3_requests.py --rows 20000 --rows-per-shard 500 --latency 0.02 \\
        --before /tmp/wt-before --after .

Each step prints its seconds and its requests by method (the first run's are made without the
added latency: it is the set-up). Moto answers in well under a millisecond here, so the
latency stands for a distant store's (S3: tens of ms to first byte).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "pypi_summaries_200k.parquet"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--rows-per-shard", type=int, default=500)
    parser.add_argument("--latency", type=float, default=0.02, help="seconds per request")
    parser.add_argument("--before", help="another tree to measure first (e.g. a worktree)")
    parser.add_argument("--after", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--data", default=str(DATA))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a tree, measured in this process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(_measure(args)))
        return
    cpu = _cpu_flags()
    print(f"CPU flags: {cpu}; {args.rows:,} rows, {args.rows_per_shard} per shard, 2 sets, "
          f"{args.latency * 1000:.0f} ms a request")
    results = {}
    for label, tree in (("before", args.before), ("after", args.after)):
        if tree:
            done = subprocess.run([sys.executable, __file__, "--one", tree, "--rows",
                                   str(args.rows), "--rows-per-shard", str(args.rows_per_shard),
                                   "--latency", str(args.latency), "--data", args.data],
                                  capture_output=True, text=True, check=True)
            results[label] = json.loads(done.stdout.strip().splitlines()[-1])
    steps = next(iter(results.values()))
    print(f"{'step':<16}" + "".join(f"{label:>34}" for label in results))
    for step in steps:
        row = "".join(f"{_cell(results[label][step]):>34}" for label in results)
        print(f"{step:<16}{row}")


def _cell(result: dict) -> str:
    requests = " ".join(f"{k} {v}" for k, v in sorted(result["requests"].items()))
    return f"{result['seconds']:.2f} s ({requests})"


def _measure(args: argparse.Namespace) -> dict:
    tree = Path(args.one).resolve()
    sys.path[:0] = [str(tree / "tests"), str(tree)]
    import _s3

    counts: collections.Counter = collections.Counter()
    latency = [0.0]
    wrap = _s3.Faults.wrap

    def counting(self, app):
        inner = wrap(self, app)

        def middleware(environ, start_response):
            counts[environ["REQUEST_METHOD"]] += 1
            time.sleep(latency[0])
            return inner(environ, start_response)

        return middleware

    _s3.Faults.wrap = counting
    server = _s3.S3Server()
    os.environ.update(AWS_ACCESS_KEY_ID=_s3.TEST_KEY, AWS_SECRET_ACCESS_KEY=_s3.TEST_SECRET,
                      AWS_DEFAULT_REGION=_s3.REGION, EMBEDPIPE_S3_ENDPOINT=server.endpoint,
                      AWS_EC2_METADATA_DISABLED="true")
    server.client().create_bucket(Bucket="bench-bucket")
    import pyarrow.parquet as pq
    from conftest import build_tiny_bert

    import embedpipe

    tmp = Path(tempfile.mkdtemp(prefix="embedpipe-s3-bench-"))
    model = build_tiny_bert(tmp / "model")
    corpus = tmp / "corpus.parquet"
    table = pq.read_table(args.data, columns=["id", "text"]).slice(0, args.rows)
    pq.write_table(table, corpus, row_group_size=args.rows_per_shard)
    out = "s3://bench-bucket/out"
    options = {"poolers": ["mean", "cls"], "model": str(model),
               "rows_per_shard": args.rows_per_shard}
    steps = {
        "first run": lambda: embedpipe.embed(str(corpus), out, **options),
        "nothing to do": lambda: embedpipe.embed(str(corpus), out, **options),
        "read_set": lambda: embedpipe.read_set(out, "mean").collect().height,
        "index": lambda: embedpipe.index(out, "mean"),
    }
    results = {}
    for name, step in steps.items():
        latency[0] = 0.0 if name == "first run" else args.latency
        counts.clear()
        started = time.perf_counter()
        step()
        results[name] = {"seconds": time.perf_counter() - started, "requests": dict(counts)}
    server.stop()
    return results


def _cpu_flags() -> str:
    flags = set()
    with open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("flags"):
                flags |= set(line.split(":", 1)[1].split())
    return " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)


if __name__ == "__main__":
    main()
