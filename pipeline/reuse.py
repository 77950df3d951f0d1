"""A set's stored vectors, found again by (id, content hash) for the rows a shard reads.

Where a shard looks first: its own part and any older part of an overlapping range of the same
file (``SetWork.previous``). A row that is not there may have moved: a file renamed, rows
reordered or merged into other files by a compaction. The run's planner names the shards whose
rows may have left them (``SetWork.moved``: shards gone from the plan or whose file changed),
and the keys those shards held are read once per run and process (``_moved_keys``). A part
found there is read again with its hashes between two reads of its done marker: its rows are
taken only if that marker stood unchanged throughout, so a part another worker is rewriting
is never mixed with the hashes of its last version.
"""

from __future__ import annotations

import threading

import numpy as np
import polars as pl
import pyarrow as pa

from pipeline.errors import StorageError
from pipeline.sets import SetFolder

# whole parts a shard takes in, in rows per row of the shard: beyond this, only the rows a
# slice asks for are taken (a corpus shuffled across files would otherwise hold all of it)
ABSORB_PER_ROW = 2


class StoredVectors:
    """The vectors of one set that a shard may reuse, numbered in the order they were read."""

    def __init__(self, out: str, name: str, dim: int, id_type: pa.DataType, previous: list[str],
                 moved: str = "", generation: int = 0, shard_rows: int = 0) -> None:
        self.folder = SetFolder(out, name)
        self.dim = dim  # the set's (``_SET.json``, as the run claimed it): what is stored must be
        self.id_type = id_type  # the set's too
        self._blocks: list[np.ndarray] = []
        self._born: list[np.ndarray] = []  # each stored vector's generation (``ShardHashes``)
        self._starts: list[int] = []
        self._frames: list[pl.DataFrame] = []
        self._keys: pl.DataFrame | None = None  # the frames as one, made when asked
        self.size = 0
        for shard in previous:
            found = self._read_part(shard)
            if found is not None:
                self._add(*found)
        self._moved = moved  # the digest of the run's list (``SetFolder.write_moved``)
        self._previous = set(previous)  # read above: never again as moved-from ones
        self._spent: set[int] = set()  # moved-from shards (by index) taken in whole
        self._generation = generation
        self._budget = ABSORB_PER_ROW * shard_rows
        self._spent_files: set[str] = set()  # leftover files taken in whole
        self._leftover_keys: dict[str, pl.DataFrame] = {}  # the others' keys, read once
        self._lock = threading.Lock()

    def lookup(self, ids: pa.Array, hashes: np.ndarray) -> np.ndarray:
        """Stored row of each (id, hash), taking in the parts and leftovers its rows moved
        from; -1 where nothing stored matches."""
        found = self.find(ids, hashes)
        if self._moved and (found < 0).any():
            with self._lock:
                if self._take_moved(ids, hashes, found < 0):
                    found = self.find(ids, hashes)
        return found

    def find(self, ids: pa.Array, hashes: np.ndarray) -> np.ndarray:
        """Stored row of each (id, hash) among the vectors read so far; -1 where none."""
        found = np.full(len(ids), -1, np.int64)
        if not self._frames or not len(ids):
            return found
        if self._keys is None:
            self._keys = pl.concat(self._frames)
        hits = _keys(ids, hashes).with_row_index("pos").join(self._keys, on=["id", "hash"])
        found[hits["pos"].to_numpy()] = hits["at"].to_numpy()
        return found

    def take(self, rows: np.ndarray) -> np.ndarray:
        """The stored vectors of ``rows`` (all found by ``lookup``)."""
        return self._gather(self._blocks, rows)

    def born(self, rows: np.ndarray) -> np.ndarray:
        """The generation that made each of the stored vectors of ``rows``."""
        return self._gather(self._born, rows)

    def _gather(self, blocks: list[np.ndarray], rows: np.ndarray) -> np.ndarray:
        if len(blocks) == 1:
            return blocks[0][rows]
        block = np.searchsorted(self._starts, rows, side="right") - 1
        out = np.empty((len(rows), *blocks[0].shape[1:]), blocks[0].dtype)
        for b in np.unique(block):
            at = block == b
            out[at] = blocks[b][rows[at] - self._starts[b]]
        return out

    def _add(self, keys: pl.DataFrame, vectors: np.ndarray, born: np.ndarray,
             source: str = "") -> None:
        """Append ``vectors`` with their (id, hash) ``keys`` and generations: rows ``size``
        on."""
        if vectors.shape[1] != self.dim:
            raise StorageError(f"{source or self.folder}: vectors of {vectors.shape[1]} "
                               f"dimensions in a set of {self.dim}")
        self._frames.append(keys.with_columns(at=np.arange(self.size, self.size + len(keys))))
        self._keys = None
        self._starts.append(self.size)
        self._blocks.append(vectors)
        self._born.append(born)
        self.size += len(keys)

    def _take_moved(self, ids: pa.Array, hashes: np.ndarray, missing: np.ndarray) -> bool:
        """Take in the stored rows that ``missing`` rows moved from: the parts of the run's
        moved-from shards, then the rows that left shards this run already rewrote; whether
        any were taken."""
        wanted = _keys(ids, hashes).filter(pl.Series(missing))
        taken = self._take_parts(wanted)
        if taken:
            wanted = wanted.filter(pl.Series(self.find(*_columns(wanted)) < 0))
        return self._take_leftovers(wanted) or taken

    def _take_leftovers(self, wanted: pl.DataFrame) -> bool:
        """Rows of ``wanted`` among the leftovers of this generation not taken in whole."""
        taken = False
        for url in self.folder.leftovers_urls(self._generation):
            if url in self._spent_files:
                continue
            found = self._read_leftovers(url, wanted)
            if found is not None and len(found[0]):
                self._add(*found, url)
                taken = True
        return taken

    def _read_leftovers(self, url: str, wanted: pl.DataFrame
                        ) -> tuple[pl.DataFrame, np.ndarray, np.ndarray] | None:
        """A leftovers file's keys, vectors and their generations: whole while the budget
        lasts, then only the rows of ``wanted``, read where its keys (read once) hold any."""
        whole = self._budget > 0
        if not whole:
            if url not in self._leftover_keys:
                stored, _ = self.folder.read_leftovers(url, self._generation, self.id_type,
                                                       vectors=False)
                self._leftover_keys[url] = _keys(stored.ids, stored.hashes)
            if not len(_rows_in(self._leftover_keys[url], wanted)):
                return None
        stored, vectors = self.folder.read_leftovers(url, self._generation, self.id_type)
        keys = _keys(stored.ids, stored.hashes)
        if whole:  # taken in whole: never read again
            self._spent_files.add(url)
            self._budget -= len(keys)
            return keys, vectors, stored.born
        rows = _rows_in(keys, wanted)
        return keys[rows], vectors[rows], stored.born[rows]

    def _take_parts(self, wanted: pl.DataFrame) -> bool:
        """Rows of ``wanted`` in the parts of the run's moved-from shards."""
        shards, known = _moved_keys(self.folder, self.id_type, self._generation, self._moved)
        if known is None:
            return False
        hits = wanted.join(known, on=["id", "hash"])
        taken = False
        for index in hits["shard"].unique().sort().to_list():
            if index in self._spent or shards[index] in self._previous:
                continue
            whole = self._budget > 0
            found = self._read_moved(shards[index], None if whole else wanted)
            if whole:  # taken in whole (or unusable): never read again
                self._spent.add(index)
            if found is None:
                continue
            keys, vectors, born = found
            self._budget -= len(keys) if whole else 0
            if len(keys):
                self._add(keys, vectors, born)
                taken = True
        return taken

    def _read_moved(self, shard: str, wanted: pl.DataFrame | None
                    ) -> tuple[pl.DataFrame, np.ndarray, np.ndarray] | None:
        """A moved-from shard's keys, vectors and their generations (only those in ``wanted``
        if given), or None
        if its marker changed or went while they were read, or part and hashes disagree."""
        before = self.folder.read_marker(shard)
        if before is None:
            return None
        try:
            found = self._read_part(shard)
        except StorageError:
            if self.folder.read_marker(shard) == before:
                raise
            return None  # another worker rewrote it meanwhile: its files came and went
        if found is None or self.folder.read_marker(shard) != before:
            return None
        if wanted is None:
            return found
        keys, vectors, born = found
        rows = _rows_in(keys, wanted)
        return keys[rows], vectors[rows], born[rows]

    def _read_part(self, shard: str) -> tuple[pl.DataFrame, np.ndarray, np.ndarray] | None:
        """A shard's stored keys, vectors and their generations; None where it has no rows,
        or its part and hashes disagree (trust neither)."""
        stored = self.folder.read_hashes(shard, self.id_type)
        if not len(stored.ids) or not self.folder.has_part(shard):
            return None
        part_ids, vectors = self.folder.read_part(shard)
        if not part_ids.equals(stored.ids):
            return None
        return _keys(stored.ids, stored.hashes), vectors, stored.born


def _keys(ids: pa.Array, hashes: np.ndarray) -> pl.DataFrame:
    return pl.DataFrame({"id": pl.from_arrow(ids), "hash": pl.Series(hashes, dtype=pl.UInt64)})


def _rows_in(keys: pl.DataFrame, wanted: pl.DataFrame) -> np.ndarray:
    """Positions in ``keys`` of the (id, hash) pairs ``wanted`` holds."""
    return keys.with_row_index("row").join(wanted, on=["id", "hash"])["row"].to_numpy()


def _columns(keys: pl.DataFrame) -> tuple[pa.Array, np.ndarray]:
    return keys["id"].to_arrow(), keys["hash"].to_numpy()


# ---- the keys of the shards rows may have moved from, once per run and process -------------

_Moved = tuple[list[str], pl.DataFrame | None]
_MOVED: dict[tuple[str, str], tuple[tuple[int, str], _Moved]] = {}
_MOVED_SETS = 8  # sets whose keys a process keeps (a long-lived worker serves many runs)
_MOVED_LOCK = threading.Lock()


def _moved_keys(folder: SetFolder, id_type: pa.DataType, generation: int, digest: str
                ) -> _Moved:
    """The run's moved-from shards (``SetFolder.read_moved``) and the (id, hash, shard) of
    every row they held when first asked in this run (None if none): ``shard`` is the index
    in the list (a stale answer only misses: each part is read again before its rows are
    taken)."""
    key = (generation, digest)
    with _MOVED_LOCK:
        cached = _MOVED.get((folder.out, folder.name))
        if cached is not None and cached[0] == key:
            return cached[1]
        shards = folder.read_moved(generation, digest)
        frames = []
        for index, shard in enumerate(shards):
            stored = folder.read_hashes(shard, id_type)
            if len(stored.ids):
                frames.append(_keys(stored.ids, stored.hashes)
                              .with_columns(shard=pl.lit(index, pl.Int32)))
        found = (shards, pl.concat(frames) if frames else None)
        if len(_MOVED) >= _MOVED_SETS:
            _MOVED.clear()
        _MOVED[(folder.out, folder.name)] = (key, found)
        return found
