"""`--dtype int8` against fp32 with the packaged MiniLM, measured in one run.

    python bench/int8.py --docs 1000

Embeds the same PyPI summaries with fp32, with what ``--dtype auto`` picks here (bf16 where
it is faster on the model and close to fp32) and with int8 (the encoder in ONNX Runtime with int8
MatMul weights, see pipeline/quantize.py), prints the docs/s ratio, the seconds the first
batch took (for int8 with an empty cache: export, fusion and quantization), the cosine between
the two vectors of each document (min / mean), and recall@10 of a retrieval task on the same
data with each dtype: the query is the package name, the relevant document its summary.
CPU flags printed beside.
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
    from pipeline.ranking import score_gold_ranks

    scores = queries @ docs.T
    gold = scores[np.arange(len(scores)), np.arange(len(scores))]
    ranks = 1 + (scores > gold[:, None]).sum(axis=1)  # 1-based rank of the relevant doc
    return score_gold_ranks(ranks, 10)["recall@10"]


def main() -> int:
    import polars as pl

    from pipeline.config import EncoderConfig, PoolerSpec
    from pipeline.embedder import Embedder

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=1000)
    args = parser.parse_args()
    frame = pl.read_parquet(DATA).unique("package", keep="first", maintain_order=True)
    frame = frame.head(args.docs)
    texts, names = frame["text"].to_list(), frame["package"].to_list()
    peak = matmul_gflops()
    result: dict = {"cpu_flags": cpu_flags(), "fp32_matmul_gflops": round(peak, 1),
                    "docs": len(texts)}
    vectors = {}
    for dtype in ("fp32", "auto", "int8"):  # auto: what a run without --dtype gets here
        embedder = Embedder(EncoderConfig(dtype=dtype, device="cpu"), [PoolerSpec(name="mean")])
        started = time.perf_counter()
        embedder.encode(texts[:16])  # warm-up (int8: the ONNX model is built or loaded here)
        result[f"{dtype}_first_batch_s"] = round(time.perf_counter() - started, 2)
        started = time.perf_counter()
        docs = embedder.encode(texts)
        seconds = time.perf_counter() - started
        vectors[dtype] = (docs, embedder.encode(names))
        result[f"{dtype}_docs_per_s"] = round(len(texts) / seconds, 1)
        result[f"{dtype}_recall_at_10"] = recall_at_10(vectors[dtype][1], docs)
        result[f"{dtype}_fingerprint"] = embedder.fingerprint("mean")
        result[f"{dtype}_resolved"] = embedder.info.dtype
    cos = np.sum(vectors["fp32"][0] * vectors["int8"][0], axis=1)
    result["cosine_int8_fp32_min"] = round(float(cos.min()), 4)
    result["cosine_int8_fp32_mean"] = round(float(cos.mean()), 4)
    result["speed_ratio_int8_over_fp32"] = round(
        result["int8_docs_per_s"] / result["fp32_docs_per_s"], 2)
    result["speed_ratio_int8_over_auto"] = round(
        result["int8_docs_per_s"] / result["auto_docs_per_s"], 2)
    result["recall_at_10_change"] = round(
        result["int8_recall_at_10"] - result["fp32_recall_at_10"], 4)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
