"""Building and updating a set's index: full builds, incremental catch-up, tuning, publish.

A full build reads the set twice, streaming: once for a sample (training rows for kinds
that train, held-back query rows for tuning), once to add every row in batches while the
exact top-10 of the query rows is accumulated on the same batches. Catch-up applies the
set's ``_changes`` files since the index's generation (drop deleted ids, and the ids of the
listed parts' rows whose vectors are newer than the index; add those rows), then re-measures
recall and re-tunes.

New rows get labels from the index's high-water mark (``IndexMeta.next_label``), never from
the id map alone: a row an HNSW index cannot remove stays in it, masked, under its label.
An index of a set that was since removed and made again (another ``SetMeta.token``) is
rebuilt, never caught up.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable

import faiss
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from pipeline.config import LeaseWait, Location
from pipeline.corpus import arrow_id_type
from pipeline.errors import ConfigError, StorageError
from pipeline.index import setdata, store
from pipeline.index.exact import ExactTopK, faiss_metric
from pipeline.index.handle import IndexHandle, ivf_of, remove, unwrapped, with_ids
from pipeline.index.idmap import IdMap
from pipeline.index.plan import (
    BATCH_ROWS,
    MIN_ROWS_PER_CENTROID,
    NAMED_KINDS,
    QUERY_SAMPLE,
    IndexPlan,
    factory_for,
    index_kind,
    parse_bytes,
    plan_index,
    pq_bits_for,
)
from pipeline.index.setdata import SetVectors
from pipeline.index.tune import tune
from pipeline.sets import SetChanges, SetFolder, SetMeta, list_sets, repeated_ids, shard_of

log = logging.getLogger("embedpipe.index")
TIES = 10  # exact rows kept past the 10th, for those that tie with it (ExactTopK.truth)
MAX_MASKED_SHARE = 0.2  # above this share of dead rows in an index that cannot delete: rebuild


class IndexRequest(BaseModel):
    """What ``embedpipe index`` asks for one set."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    out: Location
    set_name: str
    kind: str = "auto"
    memory_budget: str = "4GB"
    rebuild: bool = False
    recall_target: float = Field(default=0.95, gt=0, le=1)
    queries: int = Field(default=QUERY_SAMPLE, gt=0)
    batch_rows: int = Field(default=BATCH_ROWS, gt=0)
    seed: int = 0

    @field_validator("kind")
    @classmethod
    def _kind(cls, kind: str) -> str:
        return index_kind(kind)  # "FLAT" is flat: a catch-up compares it with the built kind


def index_targets(out: str, set_name: str | None, kind: str, memory_budget: str | int,
                  lease_wait: float) -> list[str]:
    """The sets an `index` run works on, its options checked first (each a one-line error,
    before any orchestration or lease): the named set, which must be there, or every set."""
    parse_bytes(memory_budget)
    index_kind(kind)
    try:
        TypeAdapter(LeaseWait).validate_python(lease_wait, strict=True)  # as an embed job's
    except ValidationError:
        raise ConfigError(f"lease_wait {lease_wait!r} is not a number of seconds >= 0") from None
    if set_name is not None:
        if not isinstance(set_name, str):
            raise ConfigError(f"set_name {set_name!r} is not a set's name")
        SetFolder(out, set_name).meta()  # a set not there fails in one line, OUT untouched
        names = [set_name]
    else:
        names = list_sets(out)
    if not names:
        raise StorageError(f"no sets under {out}/sets to index; run `embedpipe embed` first")
    if index_kind(kind) not in ("auto", *NAMED_KINDS):  # a factory string: FAISS builds it
        for meta in (SetFolder(out, name).meta() for name in names):
            _factory_index(index_kind(kind), meta.dim, meta.metric)
    return names


class IndexResult(BaseModel):
    meta: store.IndexMeta
    action: str  # "built", "caught up", "up to date"
    reason: str = ""

    def summary(self) -> str:
        m = self.meta
        params = (", ".join(f"{k}={v}" for k, v in m.params.items())
                  or ("exact" if m.kind == "flat" else "no search parameters"))  # PQ4: lossy
        why = f" ({self.reason})" if self.reason else ""
        short = (f", BELOW the target {m.recall_target:.2f}: try a larger --memory-budget "
                 "or another --kind" if m.recall_at_10 < m.recall_target else "")
        return (f"index {m.name}: {self.action}{why}; {m.kind} [{m.factory}] {m.rows:,} rows, "
                f"recall@10 {m.recall_at_10:.3f} ({params}{short}), generation "
                f"{m.generation}, {m.build_seconds:.1f}s")


def index_set(req: IndexRequest, say: Callable[[str], None] = log.info) -> IndexResult:
    """Bring ``OUT/index/<set>`` up to date with the set: nothing, a catch-up or a full build."""
    try:
        return _index_set(req, say)
    except MemoryError:
        raise ConfigError(
            f"out of memory building the index of set {req.set_name!r} with --memory-budget "
            f"{req.memory_budget}: this machine has less free memory than that budget; pass "
            "a smaller --memory-budget (a more compact index kind) or free memory"
        ) from None


def _index_set(req: IndexRequest, say: Callable[[str], None]) -> IndexResult:
    info = SetFolder(req.out, req.set_name).meta()
    budget = parse_bytes(req.memory_budget)
    current = _current(req)
    if current is None or req.rebuild:
        reason = "asked to rebuild" if current is not None else "no index yet"
        return IndexResult(meta=_full(req, info, budget, current, say), action="built",
                           reason=reason)
    replaced = _replaced(current, info)
    if replaced:
        return IndexResult(meta=_full(req, info, budget, current, say), action="built",
                           reason=replaced)
    store.holds_set_vectors(current, info, req.out)
    if req.kind not in ("auto", current.kind, current.factory):
        return IndexResult(meta=_full(req, info, budget, current, say), action="built",
                           reason=f"kind changed from {current.kind} to {req.kind}")
    changes = SetFolder(req.out, info.name).changes_since(current.generation, info)
    lost = "a changes file is missing" if changes is None else _lost(req.out, current)
    if lost:
        return IndexResult(meta=_full(req, info, budget, current, say, _kept_kind(req, current)),
                           action="built", reason=lost)
    if not changes:
        return IndexResult(meta=current, action="up to date")
    meta, reason = _catch_up(req, info, budget, current, changes, say)
    if meta is None:
        return IndexResult(meta=_full(req, info, budget, current, say, _kept_kind(req, current)),
                           action="built", reason=reason)
    return IndexResult(meta=meta, action="caught up", reason=reason)


def _kept_kind(req: IndexRequest, current: store.IndexMeta) -> str:
    """The kind a full build that stands in for a catch-up asks for: ``--kind`` where given,
    else the kind ``current`` was built for (an index made ``--kind hnsw`` stays HNSW; one
    made ``auto`` chooses again for the rows it has now)."""
    return current.asked_kind if req.kind == "auto" and current.asked_kind else req.kind


def _current(req: IndexRequest) -> store.IndexMeta | None:
    """The published index's description; with --rebuild a damaged one is simply replaced."""
    try:
        return store.read_meta(req.out, req.set_name)
    except StorageError:
        if req.rebuild:
            return None
        raise


def _replaced(current: store.IndexMeta, info: SetMeta) -> str:
    """Why the index is of an earlier set of this name ("" when it is of this one)."""
    if current.set_token != info.token:
        return "the set was replaced"
    if current.generation > info.generation:  # a set made before sets had tokens
        return (f"the set was replaced (the index is at generation {current.generation}, "
                f"the set at {info.generation})")
    return ""


def _lost(out: str, current: store.IndexMeta) -> str:
    """Why the published index cannot be caught up from ("" when it can): its files went."""
    missing = store.missing_files(out, current)
    return f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing" \
        if missing else ""


# ---- full build ----------------------------------------------------------------------------


def _full(req: IndexRequest, info: SetMeta, budget: int, previous: store.IndexMeta | None,
          say: Callable[[str], None], kind: str | None = None) -> store.IndexMeta:
    """A new index of every row of the set, of ``kind`` (default: ``--kind``)."""
    kind = kind or req.kind
    started = time.perf_counter()
    data = SetVectors.of(SetFolder(req.out, info.name), info)
    rows = data.rows
    if rows == 0 and previous is not None:
        return _empty(req, info, budget, previous, started, say)
    if rows == 0:
        raise StorageError(f"set {info.name!r} in {req.out} has no rows to index")
    plan = plan_index(rows, info.dim, info.metric, budget, kind)
    say(f"index {info.name}: {rows:,} x {info.dim} -> {plan.kind} [{plan.factory}], "
        f"estimated {plan.memory_estimate / 1e6:,.0f} MB of {budget / 1e6:,.0f} MB")
    index = _new_index(plan, info.dim)
    rng = np.random.default_rng(req.seed)
    query_pos, train_pos = _sample_positions(rng, rows, req.queries, plan.train_rows)
    query_ids, queries = data.gather(query_pos)
    if not index.is_trained:
        _, train = data.gather(train_pos)
        say(f"index {info.name}: training on {len(train):,} rows")
        _train(index, train, plan.factory, rows)
        del train
    idmap = IdMap.empty(arrow_id_type(info.id_type))  # every part's (checked_parts)
    exact = ExactTopK(queries, 10, info.metric, ties=TIES)
    # the query sample is held back while tuning, as real queries are no rows of the set (a
    # row searched for itself is its own nearest, and HNSW finds the rest through it: on
    # 20,000 MiniLM summaries 0.95 was measured where summaries not in the set got 0.85); a
    # set too small to spare them tunes on them in place
    held = query_pos if rows >= 2 * len(query_pos) else query_pos[:0]
    _add_rows(data, index, plan.factory, idmap, exact, held, req.batch_rows)
    params, recall, tried = tune(IndexHandle(index, idmap, {}), queries, exact.truth(),
                                 req.recall_target)
    if len(held):  # then they join the index
        _append(index, plan.factory, idmap, query_ids, queries)
    _refuse_duplicates(idmap, info, req.out)
    handle = IndexHandle(index, idmap, params)
    meta = _meta(req, info, budget, plan.memory_estimate, handle, previous, started,
                 kind=plan.kind, factory=plan.factory, mode="full", next_label=idmap.next_label,
                 asked_kind=plan.factory if plan.kind == "factory" else kind)
    meta = meta.model_copy(update={"params": params, "recall_at_10": recall, "tuning": tried,
                                   "recall_queries": len(queries)})
    meta = store.publish(req.out, index, idmap, meta)
    return meta


def _empty(req: IndexRequest, info: SetMeta, budget: int, previous: store.IndexMeta,
           started: float, say: Callable[[str], None]) -> store.IndexMeta:
    """A set whose rows all left it: an empty flat index replaces the published one, which
    would go on answering with ids no longer in the set (a kind that cannot delete rows
    falls back to a full build, and there is nothing to build one from)."""
    say(f"index {info.name}: the set has no rows left; an empty index replaces generation "
        f"{previous.generation}")
    factory = factory_for("flat", info.dim, 0)
    index = _new_index(IndexPlan(kind="flat", factory=factory, metric=info.metric,
                                 memory_estimate=0), info.dim)
    handle = IndexHandle(index, IdMap.empty(arrow_id_type(info.id_type)), {})
    meta = _meta(req, info, budget, 0, handle, previous, started, kind="flat", factory=factory,
                 mode="full", next_label=previous.next_label or 0,
                 asked_kind=previous.asked_kind)
    return store.publish(req.out, index, handle.idmap, meta)


def _new_index(plan: IndexPlan, dim: int) -> faiss.Index:
    index = _factory_index(plan.factory, dim, plan.metric)
    if plan.kind == "hnsw":
        index.hnsw.efConstruction = 80
    return with_ids(index)


def _factory_index(factory: str, dim: int, metric: str) -> faiss.Index:
    """FAISS's index of ``factory``; a string FAISS cannot build in one line."""
    try:
        return faiss.index_factory(dim, factory, faiss_metric(metric))
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
        raise ConfigError(f"FAISS cannot build index {factory!r} for dim {dim}: {first}") \
            from None


def _train(index: faiss.Index, train: np.ndarray, factory: str, rows: int) -> None:
    """Train ``index`` on ``train`` (sampled from a set of ``rows``); too few rows for its
    lists, or what else FAISS refuses, in one line."""
    ivf = ivf_of(index)
    if ivf is not None and len(train) < ivf.nlist:
        raise ConfigError(
            f"index {factory!r} has {ivf.nlist:,} lists: training needs at least as many rows "
            f"(39 per list for good ones), it has {len(train):,} of the set's {rows:,}; use "
            "fewer lists or --kind auto"
        )
    pq = _product_quantizer(index)
    if pq is not None and len(train) < MIN_ROWS_PER_CENTROID * pq.ksub:
        raise ConfigError(
            f"index {factory!r} has codebooks of {pq.ksub:,} centroids: training them needs "
            f"{MIN_ROWS_PER_CENTROID * pq.ksub:,} rows ({MIN_ROWS_PER_CENTROID} per centroid), "
            f"it has {len(train):,} of the set's {rows:,}; use fewer bits per code (PQ{pq.M}x"
            f"{pq_bits_for(len(train))}), another kind, or --kind auto")
    try:
        index.train(train)
    except RuntimeError as exc:
        raise ConfigError(f"FAISS cannot train index {factory!r} on {len(train):,} rows: "
                          f"{_faiss_reason(exc)}") from None


def _product_quantizer(index: faiss.Index) -> faiss.ProductQuantizer | None:
    """The product quantizer of a PQ index (``PQ…``, ``IVF…,PQ…``, behind an IDMap or a
    transform), or None."""
    ivf = ivf_of(index)
    return getattr(unwrapped(ivf if ivf is not None else index), "pq", None)


def _add(index: faiss.Index, vectors: np.ndarray, labels: np.ndarray, factory: str) -> None:
    """Add rows under their labels; what FAISS refuses (a factory that takes no ids of ours,
    ``IDMap,Flat``; one that cannot add after building, ``NSG``) in one line."""
    try:
        index.add_with_ids(vectors, labels)
    except RuntimeError as exc:
        raise ConfigError(f"FAISS cannot add rows to index {factory!r}: {_faiss_reason(exc)}; "
                          "use another --kind") from None


def _faiss_reason(exc: RuntimeError) -> str:
    """The last line of a FAISS error, without its C++ location."""
    reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    reason = re.sub(r"^Error in .*? at \S+:\d+: ", "", reason)  # FAISS's C++ location
    return reason.split("failed: ", 1)[-1]


def _add_rows(data: SetVectors, index: faiss.Index, factory: str, idmap: IdMap,
              exact: ExactTopK, held: np.ndarray, batch_rows: int) -> None:
    """Every row of ``data`` into ``index``, ``idmap`` and ``exact``, but those at the sorted
    positions ``held`` (the tuning sample, added once the index is tuned)."""
    offset = 0
    for ids, vectors in data.iter_batches(batch_rows):
        lo, hi = np.searchsorted(held, [offset, offset + len(ids)])
        keep = np.ones(len(ids), bool)
        keep[held[lo:hi] - offset] = False
        offset += len(ids)
        if not keep.all():
            ids, vectors = ids.filter(pa.array(keep)), vectors[keep]
        exact.add(_append(index, factory, idmap, ids, vectors), vectors)


def _append(index: faiss.Index, factory: str, idmap: IdMap, ids: pa.Array,
            vectors: np.ndarray) -> np.ndarray:
    """``vectors`` into ``index`` under the next labels, ``ids`` into ``idmap``; the labels."""
    labels = np.arange(idmap.next_label, idmap.next_label + len(ids), dtype=np.int64)
    _add(index, vectors, labels, factory)
    idmap.append(labels, ids)
    return labels


def _sample_positions(rng: np.random.Generator, rows: int, queries: int,
                      train: int) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint sorted row positions: held-back queries, and training rows (where possible)."""
    order = rng.permutation(rows) if rows <= 5_000_000 else None
    if order is None:  # a huge set: sample without materialising a permutation
        picked = np.unique(rng.integers(0, rows, size=queries + train))
        order = rng.permutation(picked)
    q = order[: min(queries, rows)]
    rest = order[len(q):]
    t = rest[:train] if len(rest) >= train else order[:train]
    return np.sort(q), np.sort(t)


def _refuse_duplicates(idmap: IdMap, info: SetMeta, out: str) -> None:
    repeated_ids([idmap.ids], info.name, out, then=", then index")


def _meta(req: IndexRequest, info: SetMeta, budget: int, estimate: int, handle: IndexHandle,
          previous: store.IndexMeta | None, started: float, kind: str, factory: str,
          mode: str, next_label: int, asked_kind: str | None) -> store.IndexMeta:
    token = store.new_token()
    return store.IndexMeta(
        name=info.name, kind=kind, factory=factory, metric=info.metric, dim=info.dim,
        fingerprint=info.fingerprint, generation=info.generation, rows=len(handle.idmap),
        ntotal=int(handle.index.ntotal), params=handle.params, recall_at_10=1.0,
        recall_target=req.recall_target, recall_queries=0, memory_budget=budget,
        memory_estimate=estimate, index_file=f"index-{token}.faiss",
        idmap_file=f"idmap-{token}.parquet", token=token,
        previous_token=previous.token if previous else None, mode=mode, built_at=time.time(),
        build_seconds=round(time.perf_counter() - started, 3), next_label=next_label,
        set_token=info.token, asked_kind=asked_kind, unit=info.unit_search,
    )


# ---- catch-up ------------------------------------------------------------------------------


def _catch_up(req: IndexRequest, info: SetMeta, budget: int, current: store.IndexMeta,
              changes: list[SetChanges], say: Callable[[str], None]
              ) -> tuple[store.IndexMeta | None, str]:
    """Apply changes to the current index; (None, why) when a full build is the better path."""
    started = time.perf_counter()
    index, idmap = store.load(req.out, current)
    first = _first_free_label(current, index, idmap)
    if first is None:
        return None, (f"the index holds {int(index.ntotal) - len(idmap):,} masked rows but no "
                      "label high-water mark (an older embedpipe made it): their labels could "
                      "be handed out again")
    folder = SetFolder(req.out, info.name)
    names = sorted({name for change in changes for name in change.parts})
    deleted = [i for change in changes for i in change.deleted_ids]
    data = SetVectors.of(folder, info)  # the markers and footers read once, for both
    touched = data.only(names)
    gone = idmap.drop_ids(pa.array(deleted, idmap.ids.type))
    fresh = _fresh_ids(folder, touched, idmap, current.generation)
    dropped = np.concatenate([gone, idmap.drop_ids(fresh)])
    removed = remove(index, dropped)
    added = 0
    for ids, vectors in touched.iter_batches(req.batch_rows):
        new = pc.is_in(ids.cast(fresh.type), value_set=fresh)
        ids, vectors = ids.filter(new), vectors[new.to_numpy(zero_copy_only=False)]
        labels = np.arange(first + added, first + added + len(ids), dtype=np.int64)
        _add(index, vectors, labels, current.factory)
        idmap.append(labels, ids)
        added += len(ids)
    expected = data.rows
    if len(idmap) != expected:
        return None, f"catch-up left {len(idmap):,} rows but the set has {expected:,}"
    masked = int(index.ntotal) - len(idmap)
    if masked > MAX_MASKED_SHARE * index.ntotal:
        return None, f"{masked:,} deleted rows are masked, more than {MAX_MASKED_SHARE:.0%}"
    _refuse_duplicates(idmap, info, req.out)
    say(f"index {info.name}: generation {current.generation} -> {info.generation}: "
        f"-{len(dropped):,} ({'removed' if removed else 'masked'}) +{added:,} rows")
    handle = IndexHandle(index, idmap, current.params)
    rng = np.random.default_rng(req.seed + info.generation)
    query_pos, _ = _sample_positions(rng, expected, req.queries, 0)
    _, queries = data.gather(query_pos)
    truth = _exact_truth(data, info, queries, idmap, req.batch_rows)
    # its queries are rows the index holds (each finds itself): it never tunes below the
    # setting the build chose on queries it did not hold
    params, recall, tried = tune(handle, queries, truth, req.recall_target,
                                 floor=current.params)
    if recall < req.recall_target <= current.recall_at_10 and ivf_of(index) is not None:
        return None, f"recall@10 fell to {recall:.3f} after catch-up; retraining"
    meta = _meta(req, info, budget, current.memory_estimate, handle, current, started,
                 kind=current.kind, factory=current.factory, mode="catch-up",
                 next_label=first + added, asked_kind=current.asked_kind)
    meta = meta.model_copy(update={"params": params, "recall_at_10": recall, "tuning": tried,
                                   "recall_queries": len(queries)})
    meta = store.publish(req.out, index, idmap, meta)
    return meta, f"+{added:,} -{len(dropped):,} rows"


def _fresh_ids(folder: SetFolder, touched: SetVectors, idmap: IdMap, generation: int
               ) -> pa.Array:
    """Ids of the rewritten parts whose vectors the index (of ``generation``) may not hold.

    A row whose vector was made in ``generation`` or before (its ``born``, in the part's
    hashes) was reused since, unchanged, from the set the index was made of: where the index
    holds its id, it holds that vector, and the row keeps its place (rows reordered or moved
    between files cost nothing). Every other row is new: made after the index, or in a part
    whose hashes do not describe it.
    """
    fresh = []
    for part in touched.parts:
        ids = setdata.read_ids(part.url).cast(idmap.ids.type)
        shard = shard_of(part.name)
        keys = folder.read_hashes(shard, idmap.ids.type) if shard is not None else None
        held = (keys.born <= generation if keys is not None and keys.ids.equals(ids)
                else np.zeros(len(ids), bool))
        held &= pc.is_in(ids, value_set=idmap.ids).to_numpy(zero_copy_only=False)
        fresh.append(ids.filter(~held))
    return pa.concat_arrays(fresh) if fresh else pa.array([], idmap.ids.type)


def _first_free_label(current: store.IndexMeta, index: faiss.Index, idmap: IdMap) -> int | None:
    """The first label above every one in the index, masked ones too; None where unknown (an
    index from before the high-water mark was recorded that holds masked rows)."""
    if current.next_label is not None:
        return max(current.next_label, idmap.next_label)
    return idmap.next_label if int(index.ntotal) == len(idmap) else None


def _exact_truth(data: SetVectors, info: SetMeta, queries: np.ndarray, idmap: IdMap,
                 batch_rows: int) -> np.ndarray:
    """Exact top-10 labels of ``queries`` over the set's current rows."""
    exact = ExactTopK(queries, 10, info.metric, ties=TIES)
    lookup = pa.array(idmap.labels)
    for ids, vectors in data.iter_batches(batch_rows):
        pos = pc.index_in(ids.cast(idmap.ids.type), value_set=idmap.ids)
        labels = pc.take(lookup, pos).to_numpy(zero_copy_only=False)
        exact.add(np.asarray(labels, np.int64), vectors)
    return exact.truth()
