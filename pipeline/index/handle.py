"""A loaded index: FAISS index + id map + search parameters, searched with dead rows hidden."""

from __future__ import annotations

import faiss
import numpy as np

from pipeline.index.idmap import IdMap


def ivf_of(index: faiss.Index) -> faiss.IndexIVF | None:
    try:
        return faiss.extract_index_ivf(index)
    except RuntimeError:
        return None


def hnsw_of(index: faiss.Index) -> faiss.IndexHNSW | None:
    inner = index
    while True:
        inner = faiss.downcast_index(inner)
        if isinstance(inner, faiss.IndexHNSW):
            return inner
        if isinstance(inner, faiss.IndexIDMap | faiss.IndexPreTransform):
            inner = inner.index
            continue
        return None


def with_ids(index: faiss.Index) -> faiss.Index:
    """Wrap ``index`` in an IDMap unless it takes its own ids (IVF kinds do)."""
    return index if ivf_of(index) is not None else faiss.IndexIDMap(index)


def set_params(index: faiss.Index, params: dict[str, int]) -> None:
    space = faiss.ParameterSpace()
    for name, value in params.items():
        space.set_index_parameter(index, name, int(value))


def remove(index: faiss.Index, labels: np.ndarray) -> bool:
    """Remove ``labels`` from the index; False where the kind cannot (HNSW): they are masked."""
    if not len(labels):
        return True
    if hnsw_of(index) is not None:
        return False
    try:
        index.remove_ids(faiss.IDSelectorBatch(np.asarray(labels, np.int64)))
    except RuntimeError:
        return False
    return True


class IndexHandle:
    """Search by vectors; results are positions into ``idmap.ids`` plus scores."""

    def __init__(self, index: faiss.Index, idmap: IdMap, params: dict[str, int]) -> None:
        self.index = index
        self.idmap = idmap
        self.params = dict(params)
        set_params(index, self.params)

    @property
    def masked(self) -> int:
        return int(self.index.ntotal) - len(self.idmap)

    def tune(self, params: dict[str, int]) -> None:
        self.params = dict(params)
        set_params(self.index, self.params)

    def search_labels(self, vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k (scores, labels) over live rows only; label -1 where fewer than k exist."""
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        n = len(vectors)
        total = int(self.index.ntotal)
        want = min(k, len(self.idmap))
        fetch = min(total, k + self.masked) if self.masked else min(total, k)
        scores = np.full((n, k), np.nan, np.float32)
        labels = np.full((n, k), -1, np.int64)
        if n == 0 or want == 0:
            return scores, labels
        while True:
            dist, found = self.index.search(vectors, max(fetch, 1))
            _, live = self.idmap.lookup(found)
            short = (live.sum(axis=1) < want) & ((found >= 0) & ~live).any(axis=1)
            if not short.any() or fetch >= total:  # only masked rows can make a query short
                break
            fetch = min(total, fetch * 2)
        for row in range(n):
            keep = np.flatnonzero(live[row])[:k]
            scores[row, : len(keep)] = dist[row, keep]
            labels[row, : len(keep)] = found[row, keep]
        return scores, labels

    def search(self, vectors: np.ndarray, k: int) -> list[list[tuple[object, float]]]:
        """Per query, up to k (corpus id, score) pairs, best first."""
        scores, labels = self.search_labels(vectors, k)
        pos, live = self.idmap.lookup(labels)
        ids = self.idmap.ids
        out = []
        for row in range(len(labels)):
            hits = [(ids[int(pos[row, j])].as_py(), float(scores[row, j]))
                    for j in range(labels.shape[1]) if live[row, j]]
            out.append(hits)
        return out
