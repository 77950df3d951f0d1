"""Embed one shard into every set that needs it: the unit of work a flow task runs.

For each set the shard's stored vectors (``pipeline.reuse``: its own part and any older
overlapping range of the same file, then the parts its rows may have moved from) are looked up
by id and content hash: unchanged rows reuse their vector, new or changed rows are embedded,
rows gone from the shard are recorded as removed. All sets share ONE forward pass over the rows
any of them needs, and identical texts share one forward pass. A set's part and hashes are
written first, its done marker last; a set whose rows and hashes are unchanged is not
rewritten. What the shard did goes into one ``ShardStats``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict

from pipeline import faults, storage
from pipeline.batching import SLICE_ROWS, slice_length, text_lengths
from pipeline.config import EmbedJob
from pipeline.corpus import Chunk, arrow_id_type, read_shard
from pipeline.errors import FingerprintError, ModelError, NonFiniteVectors
from pipeline.models.hashing import int8_hint
from pipeline.reuse import StoredVectors
from pipeline.sets import SetFolder, ShardHashes, ShardMarker, quarantine_url
from pipeline.shards import Shard
from pipeline.stages import prefetch
from pipeline.stats import ShardStats

if TYPE_CHECKING:
    from pipeline.embedder import Embedder


class SetWork(BaseModel):
    """What one set needs from a shard: which stored shards to reuse, its own last marker."""

    name: str
    previous: list[str] = []
    # digest of the run's list of shards whose rows may have moved (``SetFolder.write_moved``,
    # ``pipeline.reuse``); "": none
    moved: str = ""
    dim: int  # the set's vector width, as claimed: what is reused must have it
    prior: ShardMarker | None = None
    fingerprint: str | None = None  # the set's, as claimed: the worker's model must make it


class ShardRequest(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)

    job: EmbedJob
    shard: Shard
    signature: str  # the shard's signature, plus the duplicate rows it drops
    id_type: str
    generation: dict[str, int]
    sets: list[SetWork]
    drop_rows: list[int] = []
    lease: str | None = None  # the run's writer lease token: checked before each set's writes


class SetOutcome(BaseModel):
    name: str
    rows: int
    embedded: int
    reused: int
    removed: int
    written: bool


class ShardResult(BaseModel):
    shard: str
    sets: list[SetOutcome]
    stats: ShardStats
    seconds: float

    @property
    def rows(self) -> int:  # valid rows in the shard
        return self.stats.rows

    @property
    def embedded(self) -> int:  # rows whose vector came from the encoder
        return self.stats.embedded

    @property
    def skipped(self) -> dict[str, int]:
        return self.stats.skipped


# ---- the stages of a shard -----------------------------------------------------------------


@dataclass
class _Slice:
    """The next ``_Model.slice_end`` valid rows of a chunk, with what each set reuses and what
    to encode."""

    ids: pa.Array
    hashes: np.ndarray
    found: dict[str, np.ndarray]  # set -> row in its stored vectors, -1 = embed
    need: np.ndarray  # rows some set must embed
    unique: np.ndarray  # rows to encode: the first of each text not encoded yet in the shard
    source: np.ndarray  # for each row of ``need``: its row in the shard's encoded store
    tokens: Any  # embedder Tokens of the ``unique`` rows (they fill the next store rows), or None


class _Seen:
    """Content hashes encoded so far in a shard -> row of the shard's store of encoded vectors,
    so identical texts anywhere in the shard share one forward pass."""

    def __init__(self) -> None:
        self.keys = np.zeros(0, np.uint64)  # sorted
        self.rows = np.zeros(0, np.int64)
        self.size = 0

    def assign(self, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(store row of each hash, positions in ``hashes`` of the texts to encode now)."""
        distinct, first, inverse = np.unique(hashes, return_index=True, return_inverse=True)
        at = np.minimum(np.searchsorted(self.keys, distinct), max(len(self.keys) - 1, 0))
        known = (self.keys[at] == distinct) if len(self.keys) else np.zeros(len(distinct), bool)
        rows = np.empty(len(distinct), np.int64)
        rows[known] = self.rows[at[known]]
        fresh = np.flatnonzero(~known)
        rows[fresh] = self.size + np.arange(len(fresh))
        self.size += len(fresh)
        keys = np.concatenate([self.keys, distinct[fresh]])
        order = np.argsort(keys, kind="stable")
        self.keys, self.rows = keys[order], np.concatenate([self.rows, rows[fresh]])[order]
        return rows[inverse.reshape(-1)], first[fresh]


def embed_shard(request: ShardRequest) -> ShardResult:
    """Read, embed and write one shard for the sets in ``request``; returns what it did.

    Stages: a reader thread reads, validates, looks up stored vectors and tokenizes the next
    slice while this thread encodes the current one; the parts are written at the end.
    """
    started = time.perf_counter()
    stats, reader = ShardStats(), ShardStats()  # the reader thread keeps its own, added last
    previous = {w.name: StoredVectors(request.job.out, w.name, w.dim, _id_type(request),
                                      w.previous, w.moved, request.generation[w.name],
                                      request.shard.rows)
                for w in request.sets}
    quarantine: list[pa.Table] = []
    faults.hit("read_shard", request.shard.id)
    model = _Model(request)
    encoded = _Encoded(list(previous), request.shard.rows)
    collected = _Collected(list(previous))
    for piece in prefetch(_read_slices(request, model, previous, reader, quarantine), depth=2):
        if len(piece.unique):
            _encode(model, piece, encoded, stats, request.shard.id)
        stats.encoded += len(piece.unique)
        stats.duplicates += len(piece.need) - len(piece.unique)
        stats.embedded += len(piece.need)
        collected.add(piece, encoded, previous, request.generation)
    # rows every set took from its stored vectors: with ``embedded`` (rows some set encoded)
    # never more than the rows read, when one set is new and another done
    stats.reused = min(collected.reused.values(), default=0)
    if model.load_seconds:
        stats.add_seconds("load", model.load_seconds)
    stats = ShardStats.total([stats, reader])
    tick = time.perf_counter()
    _write_quarantine(request, quarantine)
    outcomes = _write_sets(request, collected, previous, stats.skipped)
    stats.add_seconds("write", time.perf_counter() - tick)
    release_freed_memory()
    return ShardResult(shard=request.shard.id, sets=outcomes, stats=stats,
                       seconds=time.perf_counter() - started)


def _encode(model: _Model, piece: _Slice, encoded: _Encoded, stats: ShardStats, shard: str
            ) -> None:
    """Stage 2: a slice's distinct new texts through the model, into the shard's store."""
    tick = time.perf_counter()
    try:
        out = model.embedder.encode_tokens(piece.unique.tolist(), piece.tokens)
    except NonFiniteVectors as exc:  # named by the row's id, in its shard
        first = piece.ids[int(piece.unique[exc.row])].as_py()
        raise ModelError(f"shard {shard}, not written: {exc.explain(f'id {first!r}')}"
                         ) from exc
    stats.add_seconds("encode", time.perf_counter() - tick)
    stats.add(out.stats)
    encoded.add(out.vectors)


def _write_sets(request: ShardRequest, collected: _Collected,
                previous: dict[str, StoredVectors], skipped: dict[str, int]
                ) -> list[SetOutcome]:
    """Stage 3: each set's part, hashes and marker (see ``_write_set``)."""
    ids, hashes = collected.id_array(_id_type(request)), collected.hash_array()
    outcomes = []
    for work in request.sets:
        rows = ShardHashes(ids, hashes, request.generation[work.name],
                           collected.born_array(work.name))
        written, removed = _write_set(request, work, rows, collected.matrix(work.name),
                                      previous[work.name], skipped)
        outcomes.append(SetOutcome(
            name=work.name, rows=len(ids), embedded=collected.embedded[work.name],
            reused=collected.reused[work.name], removed=removed, written=written))
    return outcomes


class _Encoded:
    """Each set's vectors of the shard's distinct encoded texts, in the order ``_Seen``
    assigns them rows (room for the whole shard, made when the first slice is encoded)."""

    def __init__(self, names: list[str], shard_rows: int) -> None:
        self.names, self.shard_rows = names, shard_rows
        self.store: dict[str, np.ndarray] = {}
        self.filled = 0

    def add(self, vectors: dict[str, np.ndarray]) -> None:
        """The next rows: ``vectors`` holds every pooler the embedder ran, this shard's sets
        among them (a set already done here is not stored)."""
        count = len(next(iter(vectors.values())))
        if not self.store:
            self.store = {name: np.empty((self.shard_rows, vectors[name].shape[1]), np.float32)
                          for name in self.names}
        for name, matrix in self.store.items():
            matrix[self.filled : self.filled + count] = vectors[name]
        self.filled += count

    def of(self, name: str) -> np.ndarray:
        return self.store.get(name, np.empty((0, 0), np.float32))


class _Collected:
    """The shard's ids, text hashes and each set's vectors slice by slice, in row order, and
    the rows each set embedded and reused."""

    def __init__(self, names: list[str]) -> None:
        self.ids: list[pa.Array] = []
        self.hashes: list[np.ndarray] = []
        self.vectors: dict[str, list[np.ndarray]] = {name: [] for name in names}
        self.born: dict[str, list[np.ndarray]] = {name: [] for name in names}
        self.embedded = dict.fromkeys(names, 0)
        self.reused = dict.fromkeys(names, 0)

    def add(self, piece: _Slice, encoded: _Encoded, previous: dict[str, StoredVectors],
            generation: dict[str, int]) -> None:
        for name, found in piece.found.items():
            self.vectors[name].append(
                _assemble(piece, found, encoded.of(name), previous[name]))
            born, hit = np.full(len(found), generation[name], np.int64), found >= 0
            if hit.any():
                born[hit] = previous[name].born(found[hit])
            self.born[name].append(born)
            reused = int(hit.sum())
            self.embedded[name] += len(found) - reused
            self.reused[name] += reused
        self.ids.append(piece.ids)
        self.hashes.append(piece.hashes)

    def id_array(self, id_type: pa.DataType) -> pa.Array:
        return pa.concat_arrays(self.ids) if self.ids else pa.array([], id_type)

    def hash_array(self) -> np.ndarray:
        return np.concatenate(self.hashes) if self.hashes else np.zeros(0, np.uint64)

    def matrix(self, name: str) -> np.ndarray | None:
        return np.concatenate(self.vectors[name]) if self.vectors[name] else None

    def born_array(self, name: str) -> np.ndarray:
        """The generation that made each row's vector of set ``name``: this run's where it
        embedded the row, the stored vector's own where it reused one."""
        return np.concatenate(self.born[name]) if self.born[name] else np.zeros(0, np.int64)


class _Model:
    """The worker's embedder, loaded when a shard first has a text to encode: a shard whose
    rows all reuse stored vectors (a nightly run over an unchanged corpus) loads no model."""

    def __init__(self, request: ShardRequest) -> None:
        self.job = request.job
        self.sets = request.sets
        self._embedder = None
        self._lock = threading.Lock()
        self.load_seconds = 0.0  # where this shard loaded the model (a worker's first shard)

    @property
    def embedder(self):
        with self._lock:  # the reader thread and the encoder ask for it
            if self._embedder is None:
                asked = time.perf_counter()
                from pipeline.embedder import get_embedder  # torch only where work happens
                from pipeline.torch_thread import on_torch_thread

                on_torch_thread(limit_threads, self.job)
                embedder = get_embedder(self.job.encoder, self.job.poolers)
                _check_fingerprints(embedder, self.sets)
                self._embedder = embedder
                if embedder.loaded_at > asked:  # not the worker's model of an earlier shard
                    self.load_seconds = time.perf_counter() - asked
            return self._embedder

    def slice_end(self, texts: list[str], start: int) -> int:
        """End of the next slice of ``texts`` from ``start``: ``SLICE_ROWS`` texts at most
        until a slice needed the model, then ``Embedder.slice_end`` (a GPU's batches hold more
        rows; deciding sooner would import torch for shards whose rows all reuse stored
        vectors); fewer where their characters pass ``SLICE_CHARS``."""
        embedder = self._embedder
        if embedder is not None:
            return embedder.slice_end(texts, start)
        return start + slice_length(text_lengths(texts[start : start + SLICE_ROWS]))


def _check_fingerprints(embedder: Embedder, sets: list[SetWork]) -> None:
    """This worker's model makes the vectors each set was claimed for (a long-lived worker
    whose model files changed under it would otherwise write another model's vectors)."""
    for work in sets:
        made = work.fingerprint and embedder.fingerprint(work.name)
        if made != work.fingerprint:
            raise FingerprintError(
                f"set {work.name!r}: this worker's model makes fingerprint {made}, the run "
                f"planned {work.fingerprint} (model files or a pooling head changed during "
                "the run?); rerun"
                + int8_hint(None, embedder.info.model_hash)
            )


def _id_type(request: ShardRequest) -> pa.DataType:
    return arrow_id_type(request.id_type)


def _read_slices(request: ShardRequest, model: _Model, previous: dict[str, StoredVectors],
                 stats: ShardStats, quarantine: list[pa.Table]) -> Iterator[_Slice]:
    """Stage 1 (runs ahead in a thread): read, validate, look up, dedupe and tokenize."""
    job, shard = request.job, request.shard
    chunks = read_shard(
        shard, job.id_column, job.text_column, request.id_type, frozenset(request.drop_rows)
    )
    seen = _Seen()
    while True:
        tick = time.perf_counter()
        chunk = next(chunks, None)
        if chunk is None:
            return
        stats.add_skipped(chunk.skipped)
        stats.rows += len(chunk.ids)
        if chunk.skipped_rows:  # kept apart: written with --quarantine, or where a file is
            quarantine.append(_quarantine_table(shard, chunk))
        stats.add_seconds("read", time.perf_counter() - tick)
        start = 0
        while start < len(chunk.ids):
            tick = time.perf_counter()
            end = model.slice_end(chunk.texts, start)
            ids = chunk.ids.slice(start, end - start)
            hashes = chunk.hashes[start:end]
            found = {name: prev.lookup(ids, hashes) for name, prev in previous.items()}
            need = np.flatnonzero(np.logical_or.reduce([f < 0 for f in found.values()]))
            source, encode = seen.assign(hashes[need])
            unique = need[encode]
            stats.add_seconds("read", time.perf_counter() - tick)
            tokens = None
            if len(unique):
                texts = [chunk.texts[start + r] for r in unique.tolist()]
                embedder = model.embedder  # the first ask loads it: the stage "load"
                tick = time.perf_counter()
                tokens = embedder.tokenize(texts)
                stats.add_seconds("tokenize", time.perf_counter() - tick)
            yield _Slice(ids, hashes, found, need, unique, source, tokens)
            start = end


def _assemble(piece: _Slice, found: np.ndarray, encoded: np.ndarray, previous: StoredVectors
              ) -> np.ndarray:
    """A slice's vectors for one set: stored ones where found, else the encoded ones."""
    hit = found >= 0
    width = previous.dim if hit.any() else encoded.shape[1]
    matrix = np.empty((len(found), width), np.float32)
    if len(piece.need):
        matrix[piece.need] = encoded[piece.source]
    if hit.any():
        matrix[hit] = previous.take(found[hit])
    return matrix


# ---- set IO: writing -----------------------------------------------------------------------


def _write_set(request: ShardRequest, work: SetWork, rows: ShardHashes,
               matrix: np.ndarray | None, stored: StoredVectors, skipped: dict[str, int]
               ) -> tuple[bool, int]:
    """Removals (and the vectors of the rows that left, for the run's other shards), the old
    marker, part, hashes, then the new marker; only the marker if the rows are unchanged.

    Returns (part written, rows removed from this shard).
    """
    out, shard = request.job.out, request.shard
    ids, hashes, generation = rows.ids, rows.hashes, rows.generation
    folder = SetFolder(out, work.name)
    _fence(request)
    old_ids, old_hashes, written_in, _ = folder.read_hashes(shard.id, _id_type(request))
    marker = ShardMarker(
        shard=shard.id,
        file=shard.file,
        first_group=shard.first_group,
        end_group=shard.end_group,
        signature=request.signature,
        content=shard.content,
        rows=len(ids),
        skipped=skipped,
        generation=generation,
        writer=request.lease,
    )
    unchanged = (
        work.prior is not None
        and (len(old_ids) == len(ids) == 0 or old_ids.equals(ids))
        and np.array_equal(old_hashes, hashes)
        and (len(ids) == 0 or folder.has_part(shard.id))
    )
    if unchanged:  # same rows: at most new signature or skip counts to record; a shard
        # without rows has no hashes to date it: it keeps its marker's generation
        kept = written_in if written_in >= 0 else work.prior.generation
        refreshed = marker.model_copy(update={"generation": kept,
                                              "writer": work.prior.writer})
        if refreshed != work.prior:
            folder.write_marker(refreshed)
        return False, 0
    left = (pc.invert(pc.is_in(old_ids, value_set=ids)).to_numpy(zero_copy_only=False)
            if len(old_ids) else np.zeros(0, bool))  # no stored ids: an array of null type
    removed = old_ids.filter(left)
    folder.record_removed(generation, shard.id, removed)
    if len(removed) and work.moved:
        _keep_leftovers(folder, generation, shard.id, removed, old_hashes[left],
                        stored)
    # its rows change: not done until the new marker (a run that dies in between must not
    # leave the old one on them); none planned: none there but this run's own (a retry's)
    def ours(found: ShardMarker | None) -> bool:
        return _ours(found, work, request)

    _fence(request)
    if not (folder.remove_marker(shard.id, only_if=ours) if work.prior is not None
            else ours(folder.read_marker(shard.id))):
        _taken(request, work)
    faults.hit("write_part", f"{shard.id}/{work.name}")
    if len(ids):
        folder.write_part(shard.id, ids, matrix)
        folder.write_hashes(shard.id, ids, hashes, generation, rows.born)
    else:
        folder.remove_part(shard.id)
    faults.hit("write_marker", f"{shard.id}/{work.name}")
    _fence(request)  # the marker makes the part the set's: only while OUT is still this run's
    folder.write_marker(marker)
    return True, len(removed)


def _keep_leftovers(folder: SetFolder, generation: int, shard: str, ids: pa.Array,
                    hashes: np.ndarray, stored: StoredVectors) -> None:
    """The stored vectors of rows that left ``shard``, kept until the run's end: another
    shard of the run may have received them (``SetFolder.write_leftovers``)."""
    rows = stored.find(ids, hashes)
    kept = np.flatnonzero(rows >= 0)
    if len(kept):
        at = rows[kept]
        folder.write_leftovers(generation, shard, ShardHashes(
            ids.take(pa.array(kept)), hashes[kept], generation, stored.born(at)),
            stored.take(at))


def _fence(request: ShardRequest) -> None:
    """Stop before writing into OUT if the run's writer lease is no longer held by it
    (``lease.check_holder``); a request without a lease (a library caller's) writes as it is."""
    if request.lease is not None:
        from pipeline.lease import check_holder

        check_holder(request.job.out, request.lease)


def _ours(found: ShardMarker | None, work: SetWork, request: ShardRequest) -> bool:
    """Whether the shard's marker ``found`` leaves its files to this run: none, the one the
    run planned from, or one the run wrote itself (a retry of the shard), or any where the run
    holds no lease (a library caller's: no other writer to keep apart from)."""
    return (request.lease is None or found is None or found == work.prior
            or found.writer == request.lease)


def _taken(request: ShardRequest, work: SetWork) -> NoReturn:
    """Stop: the shard's done marker is not the one this run planned from (or removed), so
    a writer that took OUT over while this one stalled has redone the shard since."""
    from pipeline.lease import LeaseLost

    _fence(request)  # the lease lost, where the run holds one: its own line
    raise LeaseLost(
        f"shard {request.shard.id} of set {work.name!r} in {request.job.out} was done by "
        "another writer while this run worked on it; this run stopped before writing it: "
        "rerun to resume"
    )


def _write_quarantine(request: ShardRequest, tables: list[pa.Table]) -> None:
    """The shard's skipped rows, before any marker (with --quarantine a done shard always has
    its file). Without --quarantine a file an earlier run wrote is kept up to date: a backfill
    or a nightly run deleted the record of rows the sets still skip. A shard that skips
    nothing now has none: an earlier run's file would list rows the set now holds."""
    url = quarantine_url(request.job.out, request.shard.id)
    if not tables:
        storage.remove(url)
    elif request.job.quarantine or storage.exists(url):
        storage.write_parquet(url, pa.concat_tables(tables))


def _quarantine_table(shard: Shard, chunk: Chunk) -> pa.Table:
    n = len(chunk.skipped_rows)
    return pa.table(
        {
            "id": chunk.skipped_ids,
            "file": pa.array([shard.file] * n, pa.string()),
            "row": pa.array(chunk.skipped_rows, pa.int64()),
            "reason": pa.array(chunk.skipped_reasons, pa.string()),
        }
    )


def limit_threads(job: EmbedJob) -> None:
    """Share the cores between the job's worker processes: torch threads = cores // processes
    (``workers``; on a Dask cluster at an address, the worker processes of each machine).

    A threads runner's shards share one process, whose forward passes all run on its one torch
    thread (``pipeline.torch_thread``), each with every core. Called on that thread (torch's
    count is per thread), for every shard, not once per process: a process that runs several
    jobs (a test run, a notebook) must not keep an earlier job's count, or the same job's
    vectors would differ in their last bits between a fresh process and a used one."""
    import torch

    processes = 1 if job.runner == "threads" else job.workers
    wanted = max(1, (os.cpu_count() or 1) // max(1, processes))
    if torch.get_num_threads() != wanted:
        torch.set_num_threads(wanted)


def release_freed_memory() -> None:
    """Hand memory freed by a finished shard back to the OS (glibc's heap and Arrow's mimalloc
    pool keep it otherwise): on 200,000 rows in 10 shards, peak RSS 694 -> 677 MB with Arrow's
    pool released too (library calls, tiny encoder).

    What still grows from shard to shard is glibc's heap: it raises its mmap threshold as large
    blocks are freed, and the encoder's tensors of varying batch shapes then fragment the heap.
    A fixed 128 KiB threshold kept the peak within 1.06x of one shard's but made the encoder
    ~70% slower (every batch's tensors freshly mapped and zeroed), so it is not set.
    """
    pa.default_memory_pool().release_unused()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass
