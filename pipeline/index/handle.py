"""A loaded index: FAISS index + id map + search parameters, searched with dead rows hidden.

The tuned parameters (``nprobe``, ``efSearch``) are set on the index once, when the handle is
made. Each search then passes its own FAISS ``SearchParameters``, raised where k needs more
than recall@10 did: ``efSearch`` at least the rows fetched, ``nprobe`` enough that any probed
lists hold them. Searches never change the shared index, so threads may search one handle at
once; ``tune`` (builds only) does change it.
"""

from __future__ import annotations

import faiss
import numpy as np

from pipeline.index.idmap import IdMap

MAX_EF_SEARCH = 1 << 16  # the largest efSearch _INDEX.json may ask for


def ivf_of(index: faiss.Index) -> faiss.IndexIVF | None:
    try:
        return faiss.extract_index_ivf(index)
    except RuntimeError:
        return None


def unwrapped(index: faiss.Index) -> faiss.Index:
    """The index inside ``index``'s IDMap and transform wrappers, as its own class."""
    inner = faiss.downcast_index(index)
    while isinstance(inner, faiss.IndexIDMap | faiss.IndexPreTransform):
        inner = faiss.downcast_index(inner.index)
    return inner


def hnsw_of(index: faiss.Index) -> faiss.IndexHNSW | None:
    inner = unwrapped(index)
    return inner if isinstance(inner, faiss.IndexHNSW) else None


def with_ids(index: faiss.Index) -> faiss.Index:
    """Wrap ``index`` in an IDMap unless it takes its own ids (IVF kinds do)."""
    return index if ivf_of(index) is not None else faiss.IndexIDMap(index)


def param_bounds(index: faiss.Index) -> dict[str, int]:
    """The search parameters ``index`` takes, each with its largest sane value (the least: 1)."""
    bounds = {}
    ivf = ivf_of(index)
    if ivf is not None:
        bounds["nprobe"] = int(ivf.nlist)
    if hnsw_of(index) is not None:
        bounds["efSearch"] = MAX_EF_SEARCH
    return bounds


def params_problem(index: faiss.Index, params: dict) -> str | None:
    """What is wrong with ``params`` for ``index`` (an unknown name, a value out of bounds)."""
    bounds = param_bounds(index)
    for name, value in params.items():
        if name not in bounds:
            takes = ", ".join(bounds) or "none"
            return f"unknown search parameter {str(name)[:40]!r} (this index takes: {takes})"
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= bounds[name]:
            return (f"search parameter {name}={str(value)[:40]} is not an integer in "
                    f"1..{bounds[name]}")
    return None


def set_params(index: faiss.Index, params: dict[str, int]) -> None:
    space = faiss.ParameterSpace()
    for name, value in params.items():
        space.set_index_parameter(index, name, int(value))


def search_parameters(index: faiss.Index, nprobe: int,
                      ef_search: int) -> faiss.SearchParameters | None:
    """Per-call parameters for the IVF or HNSW inside ``index`` (through IDMap and pre-transform
    wrappers); None for other structures, which search with what ``set_params`` set."""
    inner = faiss.downcast_index(index)
    if isinstance(inner, faiss.IndexIDMap):  # passes the parameters on to the index it wraps
        return search_parameters(inner.index, nprobe, ef_search)
    if isinstance(inner, faiss.IndexPreTransform):
        nested = search_parameters(inner.index, nprobe, ef_search)
        if nested is None:
            return None
        outer = faiss.SearchParametersPreTransform()
        outer.index_params = nested
        outer.referenced_objects = [nested]  # FAISS holds a bare pointer: keep it alive
        return outer
    if isinstance(inner, faiss.IndexIVF):
        return faiss.SearchParametersIVF(nprobe=nprobe)
    if isinstance(inner, faiss.IndexHNSW):
        return faiss.SearchParametersHNSW(efSearch=ef_search)
    return None


def _list_capacity(ivf: faiss.IndexIVF | None) -> np.ndarray:
    """Running totals of the inverted lists' sizes, smallest first: the rows that any
    ``n + 1`` probed lists hold at least."""
    if ivf is None:
        return np.zeros(0, np.int64)
    sizes = np.array([ivf.invlists.list_size(i) for i in range(ivf.nlist)], np.int64)
    return np.cumsum(np.sort(sizes))


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
        self._ivf = ivf_of(index)
        self._hnsw = hnsw_of(index)
        self._capacity = _list_capacity(self._ivf)

    @property
    def masked(self) -> int:
        return int(self.index.ntotal) - len(self.idmap)

    def tune(self, params: dict[str, int]) -> None:
        self.params = dict(params)
        set_params(self.index, self.params)

    def effective(self, fetch: int, widen: int = 1) -> tuple[int, int]:
        """(nprobe, efSearch) for a search of ``fetch`` rows: the tuned values, raised so the
        probed lists (IVF) or the candidate list (HNSW) can hold ``fetch`` rows, times
        ``widen``; 0 for what the index does not have."""
        nprobe = ef_search = 0
        if self._ivf is not None:
            tuned = self.params.get("nprobe", int(self._ivf.nprobe))
            holds = int(np.searchsorted(self._capacity, fetch)) + 1  # any `holds` lists
            nprobe = min(int(self._ivf.nlist), max(tuned, holds) * widen)
        if self._hnsw is not None:
            wanted = max(self.params.get("efSearch", int(self._hnsw.hnsw.efSearch)), fetch)
            ef_search = min(wanted * widen, max(wanted, int(self.index.ntotal)))
        return nprobe, ef_search

    def settings_for(self, k: int) -> dict[str, int]:
        """The tuned parameters as a search for ``k`` rows runs them (``effective``: an nprobe
        too small for the probed lists to hold k rows runs raised). Not raised for the masked
        rows: each search raises for those it meets (``_fetch``), and an index recording
        ``k + masked`` (an efSearch past what a load takes, after 65,526 masked rows) could
        not be loaded."""
        nprobe, ef_search = self.effective(max(min(int(self.index.ntotal), k), 1))
        ran = {"nprobe": nprobe, "efSearch": ef_search}
        return {name: ran[name] for name in self.params}

    def _fetch(self, k: int) -> int:
        """Rows to ask FAISS for, first, for k live ones: masked rows may take places."""
        return max(min(int(self.index.ntotal), k + self.masked), 1)

    def _search(self, vectors: np.ndarray, fetch: int,
                widen: int) -> tuple[np.ndarray, np.ndarray]:
        params = search_parameters(self.index, *self.effective(fetch, widen))
        if params is None:
            return self.index.search(vectors, fetch)
        return self.index.search(vectors, fetch, params=params)

    def search_labels(self, vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k (scores, labels) over live rows only; label -1 where fewer than k exist."""
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        n = len(vectors)
        total = int(self.index.ntotal)
        want = min(k, len(self.idmap))
        fetch = self._fetch(k)
        scores = np.full((n, k), np.nan, np.float32)
        labels = np.full((n, k), -1, np.int64)
        if n == 0 or want == 0:
            return scores, labels
        widen = 1
        while True:
            dist, found = self._search(vectors, fetch, widen)
            _, live = self.idmap.lookup(found)
            short = live.sum(axis=1) < want
            if not short.any():
                break
            if ((found >= 0) & ~live)[short].any() and fetch < total:  # masked rows took places
                fetch = min(total, fetch * 2)
            elif (found < 0)[short].any() and self.effective(fetch, widen * 2) != self.effective(
                    fetch, widen):  # the index found fewer rows than asked: look wider
                widen *= 2
            else:
                break
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
