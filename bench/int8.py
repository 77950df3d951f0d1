"""`--dtype int8` against fp32 with the packaged MiniLM, measured in one run.

    python bench/int8.py --docs 1000 [--rounds 3]

Embeds the same PyPI summaries with fp32, with what ``--dtype auto`` picks here (bf16 where
it is faster on the model and close to fp32) and with int8 through each int8 kernel that runs
here: ``onednn`` (the fused forward's int8 products, pipeline/int8_linear.py; where this CPU
runs them and bf16 natively) and ``onnxruntime`` (the encoder in ONNX Runtime with int8 MatMul
weights, pipeline/quantize.py). Prints the docs/s ratios, the seconds the first batch took (for
ONNX Runtime with an empty cache: export, fusion and quantization), the cosine between each
document's int8 and fp32 vectors (min / mean), and recall@10 of a retrieval task on the same
data with each: the query is the package name, the relevant document its summary; and how far
a text's vector moves with its batch-mates (the same texts encoded again in a shuffled order:
min / mean cosine of each text's two vectors: 1.0 where a vector depends on its text alone,
as it should with each kernel's input scales fixed at load or build). CPU flags printed
beside. Each is timed over ``--rounds`` interleaved rounds, the best counting (the machine is
shared). ``int8`` in the output is what ``--dtype int8`` runs here by default.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.speed import DATA, cpu_flags, matmul_gflops  # noqa: E402


def recall_at_10(queries: np.ndarray, docs: np.ndarray) -> float:
    """Query i's relevant doc is doc i: recall@10 by exact inner-product search."""
    from pipeline.training.metrics import retrieval_metrics

    return retrieval_metrics(queries, docs, np.arange(len(queries)))["recall@10"]


def batch_mates_cosine(embedder, texts: list[str], docs: np.ndarray) -> tuple[float, float]:
    """(min, mean) cosine between each text's vector in ``docs`` and its vector when the same
    texts are encoded in a shuffled order (other batch-mates, other padding)."""
    from pipeline.vectors import row_cosines

    order = np.random.default_rng(0).permutation(len(texts))
    shuffled = np.empty_like(docs)
    shuffled[order] = embedder.encode([texts[i] for i in order])
    cos = row_cosines(docs, shuffled)
    return round(float(cos.min()), 4), round(float(cos.mean()), 5)


def main() -> int:
    import polars as pl

    from pipeline.config import EncoderConfig, PoolerSpec
    from pipeline.embedder import Embedder
    from pipeline.int8_linear import onednn_int8_available
    from pipeline.torch_thread import on_torch_thread
    from pipeline.vectors import row_cosines

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (best counts)")
    args = parser.parse_args()
    frame = pl.read_parquet(DATA).unique("package", keep="first", maintain_order=True)
    frame = frame.head(args.docs)
    texts, names = frame["text"].to_list(), frame["package"].to_list()
    peak = on_torch_thread(matmul_gflops)  # torch on one thread only: see pipeline/torch_thread.py
    result: dict = {"cpu_flags": cpu_flags(), "fp32_matmul_gflops": round(peak, 1),
                    "docs": len(texts)}
    runs = {"fp32": EncoderConfig(dtype="fp32", device="cpu"),
            "auto": EncoderConfig(device="cpu"),  # what a run without --dtype gets here
            "int8": EncoderConfig(dtype="int8", device="cpu")}
    if onednn_int8_available():  # int8 above ran oneDNN's kernel: ONNX Runtime's beside it
        runs["int8_onnx"] = EncoderConfig(dtype="int8", int8_kernel="onnxruntime", device="cpu")
    embedders = {}
    for dtype, config in runs.items():
        embedders[dtype] = embedder = Embedder(config, [PoolerSpec(name="mean")])
        started = time.perf_counter()
        embedder.encode(texts[:16])  # warm-up (int8: the ONNX model is built or loaded here)
        result[f"{dtype}_first_batch_s"] = round(time.perf_counter() - started, 2)
        result[f"{dtype}_resolved"] = embedder.info.dtype
        result[f"{dtype}_hash_suffix"] = embedder.info.model_hash.removeprefix(
            embedder.encoder.files_hash)
        result[f"{dtype}_fingerprint"] = embedder.fingerprint("mean")
    best, docs = dict.fromkeys(runs, float("inf")), {}
    for _ in range(args.rounds):  # interleaved: a load that comes and goes reaches each alike
        for dtype, embedder in embedders.items():
            started = time.perf_counter()
            docs[dtype] = embedder.encode(texts)
            best[dtype] = min(best[dtype], time.perf_counter() - started)
    for dtype, embedder in embedders.items():  # untimed: the queries, once
        result[f"{dtype}_docs_per_s"] = round(len(texts) / best[dtype], 1)
        result[f"{dtype}_recall_at_10"] = recall_at_10(embedder.encode(names), docs[dtype])
        result[f"{dtype}_batch_mates_cosine_min_mean"] = batch_mates_cosine(
            embedder, texts, docs[dtype])
    for int8 in (name for name in runs if name.startswith("int8")):
        cos = row_cosines(docs["fp32"], docs[int8])
        result[f"cosine_{int8}_fp32_min"] = round(float(cos.min()), 4)
        result[f"cosine_{int8}_fp32_mean"] = round(float(cos.mean()), 4)
        for base in ("fp32", "auto"):
            result[f"speed_ratio_{int8}_over_{base}"] = round(
                result[f"{int8}_docs_per_s"] / result[f"{base}_docs_per_s"], 2)
        result[f"recall_at_10_change_{int8}"] = round(
            result[f"{int8}_recall_at_10"] - result["fp32_recall_at_10"], 4)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
