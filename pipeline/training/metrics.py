"""Exact retrieval metrics: rank of each query's own text among a corpus of texts."""

from __future__ import annotations

import numpy as np


def gold_ranks(queries: np.ndarray, corpus: np.ndarray, gold: np.ndarray,
               chunk: int = 2048) -> np.ndarray:
    """1-based rank of ``corpus[gold[i]]`` for ``queries[i]`` by inner product.

    Ties count in the query's favour (only strictly better texts rank above the gold one),
    so the result does not depend on corpus order.
    """
    ranks = np.empty(len(queries), np.int64)
    for start in range(0, len(queries), chunk):
        q = queries[start : start + chunk]
        scores = q @ corpus.T
        own = scores[np.arange(len(q)), gold[start : start + chunk]]
        ranks[start : start + chunk] = (scores > own[:, None]).sum(axis=1) + 1
    return ranks


def mrr_at(ranks: np.ndarray, k: int) -> float:
    """Mean reciprocal rank, counting ranks beyond ``k`` as 0."""
    return float(np.where(ranks <= k, 1.0 / ranks, 0.0).mean()) if len(ranks) else 0.0


def recall_at(ranks: np.ndarray, k: int) -> float:
    return float((ranks <= k).mean()) if len(ranks) else 0.0


def retrieval_metrics(queries: np.ndarray, corpus: np.ndarray, gold: np.ndarray,
                      k: int = 10) -> dict[str, float]:
    """``{"mrr@k", "recall@k"}`` of exact search over ``corpus``."""
    ranks = gold_ranks(queries, corpus, gold)
    return {f"mrr@{k}": mrr_at(ranks, k), f"recall@{k}": recall_at(ranks, k)}
