"""Exact top-k for fixed queries, streamed over a set's vectors in batches."""

from __future__ import annotations

import faiss
import numpy as np


def faiss_metric(metric: str) -> int:
    return faiss.METRIC_INNER_PRODUCT if metric == "ip" else faiss.METRIC_L2


TIE = 1e-5  # scores this close (relative, at least absolute) rank alike: float32 rounding


class ExactTopK:
    """Running exact nearest neighbours of fixed queries over batches of (labels, vectors).

    ``ties``: as many more are kept, so that ``truth`` can name the rows that score as the
    k-th does (which of them is the k-th is float rounding's choice, an index's may be
    another)."""

    def __init__(self, queries: np.ndarray, k: int, metric: str, ties: int = 0) -> None:
        self.queries = np.ascontiguousarray(queries, dtype=np.float32)
        self.k = k + ties
        self.top = k
        self.metric = metric
        self.heap = faiss.ResultHeap(len(queries), self.k, keep_max=metric == "ip")
        self.done = False

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
        return self._finalized()[1][:, : self.top]

    def truth(self) -> np.ndarray:
        """The exact top-k's labels (as ``result``), then those of the kept rows past the
        k-th that score as it does (-1 elsewhere): shape (queries, k + ties)."""
        scores, labels = self._finalized()
        kth = scores[:, self.top - 1 : self.top]
        tied = np.abs(scores - kth) <= TIE * np.maximum(1.0, np.abs(kth))
        tied[:, : self.top] = True
        return np.where(tied & np.isfinite(scores), labels, -1)

    def _finalized(self) -> tuple[np.ndarray, np.ndarray]:
        if not self.done:
            self.heap.finalize()
            self.done = True
        return self.heap.D, self.heap.I

