"""Start-up, tiny-encoder throughput and peak memory of `embedpipe embed`: two code trees, one run.

    python bench/speed.py --before /work/main --after . --rows 20000 200000

Runs the real command line (``python -m flows.cli embed``) in child processes with
``PYTHONPATH`` set to each tree, so both are measured on the same machine in the same minutes
and the ratios between them hold even where the machine is shared and noisy. For each tree:

* start-up: a 300-row corpus end to end (the fixed cost of a run), then a rerun with nothing
  to do; the "after" tree also once with its local Prefect server already running;
* tiny encoder (2 layers, 32 wide): wall seconds, docs/s end to end and peak RSS (the
  child's ``ru_maxrss``) at each row count, and the 200k/20k peak ratio (flat memory);
* ``--long N ...``: the same for the default model (packaged MiniLM) over long texts (PyPI
  summaries joined to 1,200-3,000 characters, ~250 tokens after truncation): the memory of
  a real encoder's forward passes over many batch shapes;
* ``--documents N ...``: the same over whole documents of 20,000-200,000 characters (the
  model reads their first 256 tokens): the cost of a document's tail;
* the fp32 matmul GFLOP/s of this machine, measured in the same run, and the CPU flags.

Prints one JSON object per measurement and a summary table. Never a timed test: a script.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "pypi_summaries_200k.parquet"


def cpu_flags() -> str:
    text = Path("/proc/cpuinfo").read_text()
    names = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    found = {f for f in names if re.search(rf"\b{f}\b", text)}
    return " ".join(sorted(found)) or "none of avx2/avx512f/avx512_bf16/amx_bf16"


def matmul_gflops() -> float:
    """fp32 GFLOP/s of this machine's best matmul kernel (bench/peak.py)."""
    import torch

    from bench.peak import matmul_peak

    return matmul_peak(torch.float32)


def tiny_model(folder: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import build_tiny_bert

    return build_tiny_bert(folder)


def corpus(folder: Path, rows: int) -> Path:
    import pyarrow.parquet as pq

    path = folder / f"corpus_{rows}.parquet"
    if not path.exists():
        table = pq.read_table(DATA).slice(0, rows)
        pq.write_table(table, path, row_group_size=min(rows, 20_000))
    return path


# runs the command as its own child and reports its wall seconds and peak RSS (wait4): from a
# small process, since a child's ru_maxrss starts at the RSS of the process it was forked from
# (a bench holding 1.8 GB saw 1.8 GB for every command it ran)
_MEASURE = """
import json, os, subprocess, sys, time
started = time.perf_counter()
proc = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(proc.pid, 0)
report = {"seconds": time.perf_counter() - started, "peak_rss_kib": usage.ru_maxrss,
          "exit": os.waitstatus_to_exitcode(status)}
open(sys.argv[1], "w").write(json.dumps(report))
"""


def long_corpus(folder: Path, rows: int, seed: int = 0) -> Path:
    """``rows`` texts of 1,200-3,000 characters (MiniLM truncates them at 256 tokens)."""
    return joined_corpus(folder / f"long_{rows}.parquet", rows, (1_200, 3_001), seed, None)


DOCUMENT_CHARS = (20_000, 200_001)  # whole documents: the model reads their first tokens


def documents_corpus(folder: Path, rows: int, seed: int = 0) -> Path:
    """``rows`` whole documents of 20,000-200,000 characters."""
    return joined_corpus(folder / f"documents_{rows}.parquet", rows, DOCUMENT_CHARS, seed, 500)


def joined_corpus(path: Path, rows: int, chars: tuple[int, int], seed: int,
                  row_group: int | None) -> Path:
    """A corpus of ``rows`` texts of ``chars`` (low, high) characters (``joined``), in row
    groups of ``row_group`` rows (None: pyarrow's default, one group up to a million)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.exists():
        return path
    summaries = pq.read_table(DATA, columns=["text"]).column("text").to_pylist()
    texts = joined(summaries, np.random.default_rng(seed).integers(*chars, rows))
    pq.write_table(pa.table({"id": np.arange(rows), "text": texts}), path,
                   row_group_size=row_group)
    return path


def joined(texts: list[str], sizes) -> list[str]:
    """One text per size: consecutive ``texts`` joined until it is that many characters long
    (from the first again once all are used)."""
    pool = itertools.cycle(texts)
    out = []
    for target in sizes:
        parts, size = [], 0
        while size < target:
            parts.append(next(pool))
            size += len(parts[-1]) + 1
        out.append(" ".join(parts))
    return out


def measured_run(cmd: list[str], cwd: Path, env: dict | None = None
                 ) -> tuple[int, float, float, str, str]:
    """Run ``cmd``: (exit code, wall seconds, its peak RSS in MiB, stdout, stderr). Nothing
    polls it meanwhile (a poll of the process tree every 20 ms slowed a cold `embedpipe embed`
    on 2 cores by 12-16%): the peak comes from ``wait4`` when it ends."""
    with tempfile.TemporaryDirectory(prefix="bench-run-") as tmp:
        folder = Path(tmp)
        report = folder / "report.json"
        with open(folder / "out", "w+") as so, open(folder / "err", "w+") as se:
            subprocess.run([sys.executable, "-c", _MEASURE, str(report), *cmd], cwd=cwd,
                           env=env, stdout=so, stderr=se, check=False)
            so.seek(0)
            se.seek(0)
            out, err = so.read(), se.read()
        measured = json.loads(report.read_text())
    return measured["exit"], measured["seconds"], measured["peak_rss_kib"] / 1024, out, err


def embed(tree: Path, corpus_path: Path, out: Path, model: Path | None, env: dict) -> dict:
    """One CLI run (``model`` None: the default model): wall seconds, docs/s, peak RSS of the
    CLI process, its summary."""
    cmd = [sys.executable, "-m", "flows.cli", "embed", str(corpus_path), str(out),
           *(["--model", str(model)] if model else [])]
    code, wall, rss, line, err = measured_run(cmd, tree, env | {"PYTHONPATH": str(tree)})
    line, err = line.strip(), err.strip()
    rows = int(line.split()[1].replace(",", "")) if line.startswith("embedded") else 0
    return {"exit": code, "wall_s": round(wall, 2), "rows": rows,
            "docs_per_s": round(rows / wall, 1) if wall else 0.0,
            "peak_rss_mb": round(rss), "line": line[-300:],
            "error": err[-300:] if code else ""}


def main() -> int:
    sys.path.insert(0, str(ROOT))  # run as a script: the repo's packages
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="code tree to compare to")
    parser.add_argument("--after", type=Path, default=Path("."), help="code tree measured")
    parser.add_argument("--rows", type=int, nargs="*", default=[20_000, 200_000])
    parser.add_argument("--long", type=int, nargs="*", default=[],
                        help="also MiniLM over this many long texts (e.g. 1000 8000)")
    parser.add_argument("--documents", type=int, nargs="*", default=[],
                        help="also MiniLM over this many whole documents of 20-200 KB")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder")
    parser.add_argument("--no-startup", action="store_true", help="skip the start-up runs")
    args = parser.parse_args()
    # the environment as the user has it, before this process imports anything that sets
    # variables of its own (the tiny model's builder sets oneDNN's cache bounds): each tree's
    # runs must get only what that tree sets itself
    base_env = dict(os.environ) | {"HF_HUB_OFFLINE": "1"}  # tokenizers as the CLI has them
    base_env.pop("PREFECT_API_URL", None)
    work = args.work or Path(tempfile.mkdtemp(prefix="embedpipe-speed-"))
    work.mkdir(parents=True, exist_ok=True)
    model = work / "tiny"
    if not (model / "config.json").exists():
        tiny_model(model)
    flags = cpu_flags()
    peak = matmul_gflops()
    report: dict = {"cpu_flags": flags, "fp32_matmul_gflops": round(peak, 1),
                    "cores": os.cpu_count(), "load_avg": os.getloadavg()}
    print(json.dumps(report), flush=True)
    envs = {  # a cache dir per tree: each first run pays its own CPU probe and model hash
        label: base_env | {"EMBEDPIPE_CACHE": str(work / f"cache-{label}")}
        for label in ("before", "after")
    }
    small = corpus(work, 300)
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    for label, tree in trees.items() if not args.no_startup else []:
        out = work / f"out-{label}-300"
        shutil.rmtree(out, ignore_errors=True)
        env = envs[label]
        runs = {"first": embed(tree, small, out, model, env)}
        runs["nothing_to_do"] = embed(tree, small, out, model, env)
        if label == "after":  # the server the first run started is reused now
            shutil.rmtree(out, ignore_errors=True)
            runs["server_reused"] = embed(tree, small, out, model, env)
        report[f"startup_{label}"] = runs
        print(json.dumps({f"startup_{label}": runs}), flush=True)
    runs = [("tiny", rows, corpus(work, rows), model) for rows in args.rows]
    runs += [("long", rows, long_corpus(work, rows), None) for rows in args.long]
    runs += [("documents", rows, documents_corpus(work, rows), None) for rows in args.documents]
    for kind, rows, path, run_model in runs:
        for label, tree in trees.items():
            out = work / f"out-{label}-{kind}-{rows}"
            shutil.rmtree(out, ignore_errors=True)
            result = embed(tree, path, out, run_model, envs[label])
            shutil.rmtree(out, ignore_errors=True)
            report[f"{kind}_{label}_{rows}"] = result
            print(json.dumps({f"{kind}_{label}_{rows}": result}), flush=True)
    from flows.runtime import stop_local_server

    for label in trees:  # the local Prefect APIs the runs started
        stop_local_server(work / f"cache-{label}")
    print(summary(report, trees, {"tiny": args.rows, "long": args.long,
                                  "documents": args.documents}, flags,
                  not args.no_startup))
    (work / "speed.json").write_text(json.dumps(report, indent=1))
    return 0


def summary(report: dict, trees: dict, rows: dict[str, list[int]], flags: str, startup: bool
            ) -> str:
    lines = [f"CPU flags: {flags}; fp32 matmul {report['fp32_matmul_gflops']} GFLOP/s; "
             f"load average at start {report['load_avg'][0]:.1f} on {report['cores']} cores"]
    for label in trees if startup else []:
        s = report[f"startup_{label}"]
        lines.append(f"{label:6} start-up: 300 rows {s['first']['wall_s']}s, nothing to do "
                     f"{s['nothing_to_do']['wall_s']}s"
                     + (f", server reused {s['server_reused']['wall_s']}s" if "server_reused" in s
                        else ""))
    for kind, counts in rows.items():
        for n in counts:
            b, a = report[f"{kind}_before_{n}"], report[f"{kind}_after_{n}"]
            ratio = a["docs_per_s"] / b["docs_per_s"] if b["docs_per_s"] else float("nan")
            lines.append(f"{kind} {n:>7} rows: before {b['docs_per_s']} docs/s "
                         f"{b['peak_rss_mb']} MB; after {a['docs_per_s']} docs/s "
                         f"{a['peak_rss_mb']} MB; speed x{ratio:.2f}")
        if len(counts) >= 2:
            lo, hi = min(counts), max(counts)
            for label in trees:
                r = (report[f"{kind}_{label}_{hi}"]["peak_rss_mb"]
                     / report[f"{kind}_{label}_{lo}"]["peak_rss_mb"])
                lines.append(f"{label:6} {kind} peak RSS {hi}/{lo} rows: x{r:.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
