"""Exact top-k for fixed queries, streamed over a set's vectors in batches."""

from __future__ import annotations

import faiss
import numpy as np


def faiss_metric(metric: str) -> int:
    return faiss.METRIC_INNER_PRODUCT if metric == "ip" else faiss.METRIC_L2


class ExactTopK:
    """Running exact nearest neighbours of fixed queries over batches of (labels, vectors)."""

    def __init__(self, queries: np.ndarray, k: int, metric: str) -> None:
        self.queries = np.ascontiguousarray(queries, dtype=np.float32)
        self.k = k
        self.metric = metric
        self.heap = faiss.ResultHeap(len(queries), k, keep_max=metric == "ip")

    def add(self, labels: np.ndarray, vectors: np.ndarray) -> None:
        if not len(self.queries) or not len(vectors):
            return
        kk = min(self.k, len(vectors))
        dist, idx = faiss.knn(self.queries, vectors, kk, metric=faiss_metric(self.metric))
        found = np.where(idx >= 0, np.asarray(labels, np.int64)[np.maximum(idx, 0)], -1)
        if kk < self.k:  # pad to k columns with empty results
            pad = self.k - kk
            worst = -np.inf if self.metric == "ip" else np.inf
            dist = np.hstack([dist, np.full((len(dist), pad), worst, np.float32)])
            found = np.hstack([found, np.full((len(found), pad), -1, np.int64)])
        self.heap.add_result(np.ascontiguousarray(dist, np.float32),
                             np.ascontiguousarray(found, np.int64))

    def result(self) -> np.ndarray:
        """Labels of the exact top-k, shape (queries, k); -1 where the set has fewer rows."""
        self.heap.finalize()
        return self.heap.I

