"""Choosing an index: pure functions from (rows, dim, metric, budget, kind) to a plan. No IO.

``auto`` walks a ladder from exact to compressed and takes the first rung that fits the
memory budget (index + id map + the build's working set, with headroom):

- ``flat``  exact search, for up to ``FLAT_MAX_ROWS`` rows;
- ``hnsw``  graph search (fast queries, no training), up to ``HNSW_MAX_ROWS`` rows, where
  building the graph on a few cores still takes minutes, not hours;
- ``ivf``   inverted lists over full vectors;
- ``ivfsq`` inverted lists over 8-bit scalar-quantised vectors (a quarter of the memory,
  recall close to ``ivf``);
- ``ivfpq`` inverted lists over product-quantised codes, the largest code that fits.

Any other ``kind`` is taken as a FAISS factory string.
"""

from __future__ import annotations

import math
import re

from pydantic import BaseModel, ConfigDict

from pipeline.errors import ConfigError

NAMED_KINDS = ("flat", "hnsw", "ivf", "ivfsq", "ivfpq")
FLAT_MAX_ROWS = 50_000
HNSW_MAX_ROWS = 300_000
HNSW_M = 32
HEADROOM = 0.8  # share of the budget a plan may use; the rest is Python, arrow, the OS
ROW_OVERHEAD = 32  # bytes per row: FAISS id, label, id-map entry
BATCH_ROWS = 32_768
QUERY_SAMPLE = 1_000
_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "M": 1e6, "MB": 1e6, "G": 1e9, "GB": 1e9,
          "T": 1e12, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


class IndexPlan(BaseModel):
    """What to build: the FAISS factory string and the sizes the build works with."""

    model_config = ConfigDict(frozen=True)

    kind: str  # one of NAMED_KINDS, or "factory"
    factory: str
    metric: str  # "ip" or "l2"
    nlist: int | None = None
    train_rows: int = 0  # 0: the kind needs no training
    memory_estimate: int


def parse_bytes(text: str | int) -> int:
    """``"4GB"``, ``"512MiB"``, ``"1.5G"`` or a plain number of bytes, as an int > 0 (not a
    bool, an int to Python: True would be a budget of 1 byte)."""
    if isinstance(text, bool) or not isinstance(text, str | int):
        raise ConfigError(f"memory budget {text!r} is not a size like 4GB, 512MB or 2GiB, "
                          "nor a number of bytes")
    if isinstance(text, int):
        value = text
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
        unit = match.group(2).upper() if match else None
        if not match or unit not in _UNITS:
            raise ConfigError(
                f"memory budget {text!r} is not a size like 4GB, 512MB or 2GiB"
            )
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ConfigError(f"memory budget must be positive, got {text!r}")
    return value


def nlist_for(rows: int) -> int:
    """Inverted lists: about 2 * sqrt(rows), a power of two, with >= 39 training rows each."""
    target = 2 ** round(math.log2(max(2 * math.sqrt(rows), 1)))
    cap = max(rows // 39, 1)
    nlist = min(max(target, 16), 65_536, cap)
    return 2 ** int(math.log2(nlist))


def train_rows_for(kind: str, rows: int, nlist: int) -> int:
    """Rows to train on: 64 per list (and PQ's 256 centroids need ~10k), never all of a big set."""
    wanted = 64 * nlist
    if kind == "ivfpq":
        wanted = max(wanted, 10_000)
    return min(rows, wanted)


def pq_size(dim: int, rows: int, room: int) -> int | None:
    """The largest PQ code fitting ``room``: bytes per vector, dividing ``dim``, <= dim / 4.

    Sub-vectors of fewer than 4 dimensions train very slowly in FAISS and gain little.
    """
    fitting = [m for m in range(1, dim // 4 + 1) if dim % m == 0 and m * rows <= room]
    return max(fitting) if fitting else None


def _index_bytes(kind: str, rows: int, dim: int, nlist: int, pq_m: int = 0) -> int:
    vectors = rows * dim * 4
    centroids = nlist * dim * 4
    if kind == "flat":
        return vectors
    if kind == "hnsw":
        return vectors + int(rows * HNSW_M * 2 * 4 * 1.1)
    if kind == "ivf":
        return vectors + centroids
    if kind == "ivfsq":
        return rows * dim + centroids
    return rows * pq_m + centroids + 256 * dim * 4


def _estimate(kind: str, rows: int, dim: int, nlist: int, pq_m: int = 0) -> int:
    train = train_rows_for(kind, rows, nlist) * dim * 4 if kind.startswith("ivf") else 0
    working = min(rows, BATCH_ROWS) * dim * 4 * 2 + train + QUERY_SAMPLE * dim * 4
    return _index_bytes(kind, rows, dim, nlist, pq_m) + rows * ROW_OVERHEAD + working


def factory_for(kind: str, dim: int, nlist: int, pq_m: int = 0, pq_bits: int = 8) -> str:
    return {
        "flat": "Flat",
        "hnsw": f"HNSW{HNSW_M}",
        "ivf": f"IVF{nlist},Flat",
        "ivfsq": f"IVF{nlist},SQ8",
        "ivfpq": f"IVF{nlist},PQ{pq_m}x{pq_bits}",
    }[kind]


MIN_ROWS_PER_CENTROID = 39  # FAISS's k-means warns below it, and its centroids are poor


def pq_bits_for(rows: int) -> int:
    """Bits per PQ sub-code: 8 (256 centroids per codebook, trained on 9,984 rows) where the
    set has the rows, else as many as its rows train (8 on 800 rows trained codebooks for
    204 s and kept recall@10 under 0.91)."""
    return min(8, max(1, (rows // MIN_ROWS_PER_CENTROID).bit_length() - 1))


def index_kind(kind: object) -> str:
    """``kind`` as ``plan_index`` reads it: ``auto`` and the named kinds in any case (``Flat``
    is FAISS's own name of the flat index too), else a FAISS factory string, stripped."""
    if not isinstance(kind, str) or not kind.strip():
        raise ConfigError(f"index kind {kind!r} is not auto, {', '.join(NAMED_KINDS)} or a "
                          "FAISS factory string")
    name = kind.strip()
    return name.lower() if name.lower() in ("auto", *NAMED_KINDS) else name


def plan_index(rows: int, dim: int, metric: str, budget: int, kind: str = "auto") -> IndexPlan:
    """The index to build for ``rows`` vectors of ``dim`` within ``budget`` bytes."""
    if rows <= 0:
        raise ConfigError("cannot index an empty set")
    kind = index_kind(kind)
    if kind == "auto":
        return _auto(rows, dim, metric, budget)
    if kind in NAMED_KINDS:
        return _named(kind, rows, dim, metric, budget, enforce=False)
    return IndexPlan(kind="factory", factory=kind, metric=metric,
                     memory_estimate=_estimate("ivf", rows, dim, nlist_for(rows)),
                     train_rows=min(rows, max(64 * nlist_for(rows), 10_000)))


def _named(kind: str, rows: int, dim: int, metric: str, budget: int,
           enforce: bool) -> IndexPlan | None:
    nlist = nlist_for(rows) if kind.startswith("ivf") else 0
    pq_m = 0
    if kind == "ivfpq":
        fixed = _estimate("ivfpq", rows, dim, nlist, 0)
        pq_m = pq_size(dim, rows, int(budget * HEADROOM) - fixed) or (None if enforce else 1)
        if pq_m is None:
            return None
    estimate = _estimate(kind, rows, dim, nlist, pq_m)
    if enforce and estimate > budget * HEADROOM:
        return None
    return IndexPlan(
        kind=kind, factory=factory_for(kind, dim, nlist, pq_m, pq_bits_for(rows)),
        metric=metric,
        nlist=nlist or None,
        train_rows=train_rows_for(kind, rows, nlist) if nlist else 0,
        memory_estimate=estimate,
    )


def _auto(rows: int, dim: int, metric: str, budget: int) -> IndexPlan:
    ladder = []
    if rows <= FLAT_MAX_ROWS:
        ladder.append("flat")
    elif rows <= HNSW_MAX_ROWS:
        ladder.append("hnsw")
    ladder += ["ivf", "ivfsq", "ivfpq"]
    for kind in ladder:
        plan = _named(kind, rows, dim, metric, budget, enforce=True)
        if plan is not None:
            return plan
    need = _estimate("ivfpq", rows, dim, nlist_for(rows), 1) / HEADROOM
    raise ConfigError(
        f"memory budget {budget:,} bytes is too small for {rows:,} x {dim} vectors "
        f"(the smallest index needs about {math.ceil(need / 1e6):,} MB); raise --memory-budget"
    )
