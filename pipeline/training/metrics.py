"""Exact retrieval for training: rank of each query's own text among a corpus of texts.

The metrics themselves are ``pipeline.ranking``'s, the same that eval and index tuning use.
"""

from __future__ import annotations

import numpy as np

from pipeline.ranking import score_gold_ranks


def gold_ranks(queries: np.ndarray, corpus: np.ndarray, gold: np.ndarray,
               chunk: int = 2048) -> np.ndarray:
    """1-based rank of ``corpus[gold[i]]`` for ``queries[i]`` by inner product.

    Ties count in the query's favour (only strictly better texts rank above the gold one),
    so the result does not depend on corpus order. A query with a score that is not finite
    ranks its text last (NaN compares as no better: every query of a diverged head was 1st).
    """
    ranks = np.empty(len(queries), np.int64)
    for start in range(0, len(queries), chunk):
        q = queries[start : start + chunk]
        scores = q @ corpus.T
        own = scores[np.arange(len(q)), gold[start : start + chunk]]
        found = (scores > own[:, None]).sum(axis=1) + 1
        ranks[start : start + chunk] = np.where(np.isfinite(scores).all(axis=1), found,
                                                len(corpus))
    return ranks


def retrieval_metrics(queries: np.ndarray, corpus: np.ndarray, gold: np.ndarray,
                      k: int = 10) -> dict[str, float]:
    """Recall@1, recall@k, MRR@k and nDCG@k of exact search over ``corpus``."""
    return score_gold_ranks(gold_ranks(queries, corpus, gold), k)
