"""Learned pooling head vs fixed poolers on PyPI summaries (package name -> summary).

Packages are split by a stable hash: a test split never seen by training (not even for
early stopping), and a training pool from which ``--train-pairs`` pairs are written as
PAIRS.parquet for ``train``. Each head kind is trained, then every method embeds the test
queries and the distinct test texts through the Embedder (queries and texts through the
same pooler) and exact search gives MRR@10 and recall@10.

    python bench/learned_pooler.py --train-pairs 30000 --test-pairs 5000 \
        --kind adapter --kind attention+adapter --out /tmp/learned-bench
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

import pipeline  # noqa: F401  (caps oneDNN before torch runs)
from pipeline.config import EncoderConfig, PoolerSpec
from pipeline.embedder import Embedder
from pipeline.training import TrainConfig, train
from pipeline.training.metrics import retrieval_metrics
from pipeline.training.pairs import split_groups

DATA = Path(__file__).resolve().parents[1].parent / "shared/data/pypi_summaries_200k.parquet"


def split_corpus(path: str, train_pairs: int, test_pairs: int, seed: int):
    table = pq.read_table(path, columns=["package", "text"])
    packages = table.column("package").to_pylist()
    pool, test = split_groups(packages, 0.1)
    rng = np.random.default_rng(seed)
    pool = rng.permutation(pool)[:train_pairs]
    test = rng.permutation(test)[:test_pairs]
    return table.take(pool), table.take(test)


def evaluate(test: pa.Table, heads: dict[str, str], model: str | None) -> dict[str, dict]:
    specs = [PoolerSpec(name=n) for n in ("mean", "cls", "max")]
    specs += [PoolerSpec(name=n, strategy="learned", head=h) for n, h in heads.items()]
    emb = Embedder(EncoderConfig(model=model, dtype="fp32"), specs)
    queries = test.column("package").to_pylist()
    texts, gold = np.unique(np.array(test.column("text").to_pylist(), dtype=object),
                            return_inverse=True)
    q_vec = _embed(emb, queries)
    t_vec = _embed(emb, list(texts))
    return {name: retrieval_metrics(q_vec[name], t_vec[name], gold, 10) for name in q_vec}


def _embed(emb: Embedder, texts: list[str], chunk: int = 2048) -> dict[str, np.ndarray]:
    from pipeline.data import TextBatch

    parts = [emb.embed(TextBatch(list(range(s, s + len(texts[s:s + chunk]))),
                                 texts[s:s + chunk])).vectors
             for s in range(0, len(texts), chunk)]
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--out", default="/tmp/learned-bench")
    ap.add_argument("--train-pairs", type=int, default=30000)
    ap.add_argument("--test-pairs", type=int, default=5000)
    ap.add_argument("--kind", action="append", default=None,
                    help="attention|positional|layer_weights|adapter, '+adapter' adds one")
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train_table, test = split_corpus(args.data, args.train_pairs, args.test_pairs, args.seed)
    pairs = out / "pairs.parquet"
    pq.write_table(train_table.rename_columns(["query", "text"]).append_column(
        "package", train_table.column("package")), pairs)
    heads, report = {}, {"train_pairs": train_table.num_rows, "test_pairs": test.num_rows,
                         "threads": args.threads, "training": {}}
    for spec in args.kind or ["adapter"]:
        kind, _, extra = spec.partition("+")
        name = f"learned-{spec.replace('+', '-')}"
        cfg = TrainConfig(pairs=str(pairs), out=str(out / name), kind=kind,
                          adapter=extra == "adapter", group_column="package",
                          encoder=EncoderConfig(model=args.model, dtype="fp32"),
                          epochs=args.epochs, lr=args.lr, seed=args.seed, overwrite=True)
        started = time.perf_counter()
        result = train(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
        report["training"][name] = {**result.metrics,
                                    "seconds": round(time.perf_counter() - started, 1)}
        heads[name] = str(out / name)
    started = time.perf_counter()
    report["test"] = evaluate(test, heads, args.model)
    report["eval_seconds"] = round(time.perf_counter() - started, 1)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
