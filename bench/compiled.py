"""`--compile` (torch.compile, pipeline/compiled.py) against the eager model, measured in one run.

    python bench/compiled.py --docs 3000 --long 300

For fp32 and for what ``--dtype auto`` picks here (bf16 where it wins), embeds the same PyPI
summaries (and ``--long`` texts of 20 summaries each, which MiniLM truncates at 256 tokens)
with the packaged MiniLM eagerly and compiled, and prints per text set and dtype: docs/s of each
(best of ``--rounds``, after a warm-up), the compile's cost (seconds of the first batch, and
whether TorchInductor's kernel cache under EMBEDPIPE_CACHE already held this model's kernels:
``--cold-cache`` compiles into an empty folder), the share of that dtype's measured matmul
peak (real tokens' FLOPs, as bench/encode_bench.py counts them), the documents a run must embed
for the compile to pay (compile seconds / seconds saved per document), and the lowest cosine
of compiled to eager vectors and of each to fp32. CPU flags printed beside.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.speed import DATA, cpu_flags  # noqa: E402

TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def docs_per_s(embedder, texts: list[str], rounds: int) -> tuple[float, np.ndarray]:
    best, vectors = float("inf"), None
    for _ in range(rounds):
        started = time.perf_counter()
        vectors = embedder.encode(texts)
        best = min(best, time.perf_counter() - started)
    return len(texts) / best, vectors


def measure(dtype: str, texts: list[str], rounds: int) -> dict:
    import torch

    from bench.encode_bench import encoder_flops, ffn_shape, min_cosine, real_lengths
    from bench.peak import matmul_peak
    from pipeline.config import EncoderConfig, PoolerSpec
    from pipeline.embedder import Embedder
    from pipeline.torch_thread import on_torch_thread

    row: dict = {}
    vectors = {}
    for compiled in (False, True):
        embedder = Embedder(EncoderConfig(dtype=dtype, device="cpu", compile=compiled),
                            [PoolerSpec(name="mean")])
        tag = "compiled" if compiled else "eager"
        started = time.perf_counter()
        embedder.encode(texts[:64])  # compiled: the compile happens here
        row[f"{tag}_first_batch_s"] = round(time.perf_counter() - started, 2)
        embedder.encode(texts)  # every batch shape once (eager: oneDNN's kernels)
        rate, vectors[tag] = docs_per_s(embedder, texts, rounds)
        row[f"{tag}_docs_per_s"] = round(rate, 1)
    row["dtype"] = embedder.info.dtype
    config = embedder.encoder.model.config
    flops = encoder_flops(real_lengths(embedder, texts), config)
    torch_dtype = getattr(torch, TORCH_DTYPES[row["dtype"]])
    # on the torch thread: a kernel on this one would slow the next measure's (torch_thread.py)
    peak = on_torch_thread(matmul_peak, torch_dtype, *ffn_shape(config))
    row["matmul_peak_gflops"] = round(peak, 1)
    for tag in ("eager", "compiled"):
        row[f"{tag}_of_peak"] = round(flops * row[f"{tag}_docs_per_s"] / len(texts) / 1e9 / peak, 3)
    row["speedup"] = round(row["compiled_docs_per_s"] / row["eager_docs_per_s"], 2)
    saved = 1 / row["eager_docs_per_s"] - 1 / row["compiled_docs_per_s"]
    compile_s = row["compiled_first_batch_s"] - row["eager_first_batch_s"]
    row["break_even_docs"] = round(compile_s / saved) if saved > 0 else None
    row["min_cos_compiled_eager"] = round(min_cosine(vectors["compiled"], vectors["eager"]), 7)
    row["vectors"] = vectors
    return row


def main() -> int:
    import polars as pl

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=3000)
    parser.add_argument("--long", type=int, default=0, help="long texts (0: none)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cold-cache", action="store_true",
                        help="compile into an empty kernel cache (a first run on a machine)")
    args = parser.parse_args()
    if args.cold_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    from bench.encode_bench import min_cosine  # torch after the kernel cache is placed
    from pipeline.settings import cache_root

    kernels = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR", cache_root() / "inductor"))
    report: dict = {"cpu_flags": cpu_flags(), "docs": args.docs,
                    "kernel_cache_had_files": kernels.is_dir() and any(kernels.iterdir())}
    pool = pl.read_parquet(DATA).sample(args.docs + 20 * args.long, seed=0)["text"].to_list()
    sets = {"short": pool[:args.docs]}
    if args.long:
        rest = pool[args.docs:]
        sets["long"] = [" ".join(rest[i * 20:(i + 1) * 20]) for i in range(args.long)]
    for name, texts in sets.items():
        rows = {dtype: measure(dtype, texts, args.rounds) for dtype in ("fp32", "auto")}
        reference = rows["fp32"]["vectors"]["eager"]
        for row in rows.values():
            vectors = row.pop("vectors")
            row["min_cos_to_fp32"] = {t: round(min_cosine(v, reference), 7)
                                      for t, v in vectors.items()}
        report[name] = rows
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
