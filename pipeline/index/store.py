"""An index on disk: ``OUT/index/<set>/`` with versioned files and ``_INDEX.json`` naming them.

Publishing is atomic for readers on local disks and S3 alike: the FAISS file and the id map
of a build get fresh names (``index-<token>.faiss``, ``idmap-<token>.parquet``), each written
whole, and only then is ``_INDEX.json`` replaced to point at them. A reader that loaded the
previous ``_INDEX.json`` still finds its files: the previous version is kept, older ones
are pruned. Remote indexes are built locally, uploaded, and loaded through a local cache.

Nothing in ``_INDEX.json`` is trusted: the set name must be the folder's, the token a plain
name and the file names ``index-<token>.faiss`` / ``idmap-<token>.parquet``, so no path built
from it leaves ``OUT/index/<set>/`` or the cache; and the SHA-256 it records of each file is
checked before FAISS or Arrow reads a byte of it (a changed file fails, naming the file).
``next_label`` must lie between ``ntotal`` and ``MAX_LABEL``, and ``params`` may name only the
search parameters the loaded index takes, each within its bounds.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import faiss
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict

from pipeline import storage
from pipeline.errors import EmbedpipeError, FingerprintError, StorageError
from pipeline.index.handle import params_problem
from pipeline.index.idmap import IdMap
from pipeline.index.plan import NAMED_KINDS
from pipeline.lease import LeaseLost, check_held
from pipeline.names import file_name, set_name
from pipeline.settings import cache_root

if TYPE_CHECKING:
    from pipeline.sets import SetMeta

MARKER = "_INDEX.json"
ABANDONED_DOWNLOAD_S = 3600.0  # a cache download untouched this long was killed mid-way
MAX_LABEL = 1 << 62  # labels are int64: far below the overflow of any arithmetic on them


class IndexMeta(BaseModel):
    """``_INDEX.json``."""

    model_config = ConfigDict(extra="ignore")

    name: str
    kind: str
    factory: str
    metric: str
    dim: int
    fingerprint: str
    generation: int
    rows: int  # live rows (searchable)
    ntotal: int  # vectors in the FAISS index, masked ones included
    params: dict[str, int] = {}
    recall_at_10: float
    recall_target: float
    recall_queries: int
    tuning: list[dict] = []
    memory_budget: int
    memory_estimate: int
    index_file: str
    idmap_file: str
    token: str
    previous_token: str | None = None
    index_sha256: str | None = None  # set by ``publish``; required when read back
    idmap_sha256: str | None = None
    mode: str  # "full" or "catch-up"
    # the --kind the last full build was asked for ("auto", a kind, a factory string): what a
    # catch-up's fallback build asks for again; None: written before embedpipe recorded it
    asked_kind: str | None = None
    # the label high-water mark: one past every label ever put in the index (masked ones
    # too), so none is handed out twice; None: written before embedpipe recorded it
    next_label: int | None = None
    # the ``token`` of the set the index was built from (``SetMeta.token``): another one means
    # the set was removed and made again since
    set_token: str | None = None
    # whether the vectors were scaled to unit length as they went in (``SetMeta.unit_search``);
    # None: written before embedpipe recorded it
    unit: bool | None = None
    built_at: float
    build_seconds: float

    @property
    def masked(self) -> int:
        return self.ntotal - self.rows


def holds_set_vectors(meta: IndexMeta, info: SetMeta, out: str) -> None:
    """An index holds vectors of one fingerprint and dimension, ranked by one metric over
    vectors scaled one way: a set that says otherwise now (``_SET.json`` changed since) is
    refused with a rebuild hint, not searched or caught up with vectors of another kind."""
    found = (meta.fingerprint, meta.dim, meta.metric, meta.unit)
    wanted = (info.fingerprint, info.dim, info.metric,
              info.unit_search if meta.unit is not None else None)
    if found != wanted:
        raise FingerprintError(
            f"index {index_url(out, info.name)} holds vectors of fingerprint {meta.fingerprint} "
            f"(dim {meta.dim}, metric {meta.metric}{_scaled(meta.unit)}) but set "
            f"{info.name!r} now has {info.fingerprint} (dim {info.dim}, metric {info.metric}"
            f"{_scaled(wanted[3])}); rebuild it with `embedpipe index {out} --set {info.name} "
            "--rebuild`"
        )


def _scaled(unit: bool | None) -> str:
    return "" if unit is None else ", scaled to unit length" if unit else ", as stored"


def index_url(out: str, name: str) -> str:
    return storage.join(out, "index", name)


def read_meta(out: str, name: str) -> IndexMeta | None:
    """The validated ``_INDEX.json`` of set ``name``, or None when it has no index."""
    url = storage.join(index_url(out, set_name(name)), MARKER)
    meta = storage.read_model(url, IndexMeta, "an index description")
    return None if meta is None else _checked(meta, name, url)


def _checked(meta: IndexMeta, name: str, url: str) -> IndexMeta:
    """``meta`` if every name in it stays inside its folder and the checksums are there."""
    if meta.name != name:
        raise StorageError(f"{url} describes set {meta.name!r}, not {name!r}")
    file_name(meta.token, f"{url} (token)")
    if meta.previous_token is not None:
        file_name(meta.previous_token, f"{url} (previous_token)")
    files = (meta.index_file, meta.idmap_file)
    if files != (f"index-{meta.token}.faiss", f"idmap-{meta.token}.parquet"):
        raise StorageError(
            f"{url} names files {files[0]!r} and {files[1]!r}; expected "
            f"index-{meta.token}.faiss and idmap-{meta.token}.parquet"
        )
    if meta.next_label is not None and not meta.ntotal <= meta.next_label <= MAX_LABEL:
        raise StorageError(
            f"{url}: next_label {meta.next_label} is not between ntotal {meta.ntotal} and "
            f"{MAX_LABEL}; rebuild with `embedpipe index ... --set {name} --rebuild`"
        )
    if meta.asked_kind not in (None, "auto", *NAMED_KINDS, meta.factory):  # a build asks it
        raise StorageError(f"{url}: asked_kind {meta.asked_kind!r} is neither auto, "
                           f"{', '.join(NAMED_KINDS)} nor the index's own factory")
    if not (_is_sha256(meta.index_sha256) and _is_sha256(meta.idmap_sha256)):
        raise StorageError(
            f"{url} records no SHA-256 of its files (made by an older embedpipe?); rebuild "
            f"with `embedpipe index {url.rsplit('/index/', 1)[0]} --set {name} --rebuild`"
        )
    return meta


def missing_files(out: str, meta: IndexMeta) -> list[str]:
    """The files ``meta`` names that are not in the index folder (lost by the store, removed
    by hand or by a writer that lost OUT's lease): the index must be built again."""
    folder = index_url(out, meta.name)
    return [url for url in (storage.join(folder, meta.index_file),
                            storage.join(folder, meta.idmap_file)) if not storage.exists(url)]


def _is_sha256(value: str | None) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef"
                                                               for c in value)


def new_token() -> str:
    return f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"


def publish(out: str, index: faiss.Index, idmap: IdMap, meta: IndexMeta) -> IndexMeta:
    """Write the index files under new names, then ``_INDEX.json`` with their SHA-256; prune
    old versions. Returns ``meta`` with the checksums, as a reader will find it.

    A writer that lost OUT's lease while it built (paused past its TTL: another writer took
    OUT over and may have published since) publishes nothing: just before ``_INDEX.json`` is
    replaced, the lease is checked and ``_INDEX.json`` must still name the index this build
    replaced (``previous_token``); the prune then keeps every version ``_INDEX.json`` names."""
    dest = index_url(out, meta.name)
    check_held(out)  # nothing staged in OUT by a writer that lost it
    with _staging(dest, meta.token) as folder:
        meta = _stage(folder, index, idmap, meta)
        files = [meta.index_file, meta.idmap_file]
        _place(folder, dest, files, out)  # fresh names: no reader looks for them yet
        try:
            _check_replacing(out, meta)
        except EmbedpipeError:
            for name in files:
                storage.remove(storage.join(dest, name))
            raise
        _place(folder, dest, [MARKER], out)
    _prune(out, meta)
    return meta


@contextmanager
def _staging(dest: str, token: str) -> Iterator[Path]:
    """A local folder to write a build's files in: beside the index (a rename then moves
    each into place), or a temporary one to upload from (a remote OUT)."""
    if storage.is_remote(dest):
        with tempfile.TemporaryDirectory(prefix="embedpipe-index-") as tmp:
            yield Path(tmp)
        return
    staging = Path(storage.local_path(dest)) / f"{storage.STAGING_PREFIX}{token}"
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _stage(folder: Path, index: faiss.Index, idmap: IdMap, meta: IndexMeta) -> IndexMeta:
    files = folder / meta.index_file, folder / meta.idmap_file
    with storage.explained(str(folder), "write"):  # its mkdir too: OUT/index may be a file
        folder.mkdir(parents=True, exist_ok=True)
        faiss.write_index(index, str(files[0]))
        pq.write_table(idmap.to_table(), files[1], compression="zstd")
        meta = meta.model_copy(update={"index_sha256": storage.sha256(str(files[0])),
                                       "idmap_sha256": storage.sha256(str(files[1]))})
        (folder / MARKER).write_text(meta.model_dump_json(indent=2))
    return meta


def _place(folder: Path, dest: str, names: list[str], out: str) -> None:
    """Move (local) or upload (remote) the staged files ``names`` into ``dest``. A staged
    file gone from a local OUT was removed as a stale temporary by a writer that took OUT
    over: that is the lease lost (``check_held``), not a failed write."""
    for name in names:
        if storage.is_remote(dest):
            storage.put_file(folder / name, storage.join(dest, name))
            continue
        try:
            os.replace(folder / name, Path(storage.local_path(dest)) / name)
        except OSError:
            check_held(out)
            with storage.explained(storage.join(dest, name), "write"):
                raise


def _check_replacing(out: str, meta: IndexMeta) -> None:
    """Raise ``LeaseLost`` unless this process still holds OUT's lease and ``_INDEX.json``
    still names the index ``meta`` replaces (none: ``previous_token`` None)."""
    check_held(out)
    published = _named(out, meta.name, current_only=True)
    if published != ({meta.previous_token} - {None}):
        raise LeaseLost(
            f"the index of set {meta.name!r} in {out} was published by another writer while "
            f"this one built it (token {', '.join(sorted(published))}, not "
            f"{meta.previous_token}); it stopped before publishing: rerun to bring the index "
            "up to date"
        )


def _named(out: str, name: str, current_only: bool = False) -> set[str]:
    """The tokens ``_INDEX.json`` names now (its own and ``previous_token``, or its own only);
    none where it is missing or not a valid description (a rebuild replaces that)."""
    try:
        meta = read_meta(out, name)
    except StorageError:
        return set()
    if meta is None:
        return set()
    return {meta.token} if current_only else {meta.token, meta.previous_token} - {None}


def _prune(out: str, meta: IndexMeta) -> None:
    """Remove the index and id map files of versions other than ``meta``'s, the one it
    replaced and those ``_INDEX.json`` names as the prune starts (files only: a folder someone
    made there is theirs): a writer that lost OUT's lease after it published never removes
    what the writer that took OUT over published since."""
    check_held(out)
    dest = index_url(out, meta.name)
    keep = {meta.token, meta.previous_token} | _named(out, meta.name)
    for url in storage.list_regular_files(dest):
        name = url.rsplit("/", 1)[-1]
        if not name.startswith(("index-", "idmap-")):
            continue
        token = name.split("-", 1)[1].rsplit(".", 1)[0]
        if token not in keep:
            storage.remove(url)


def local_files(out: str, meta: IndexMeta) -> tuple[Path, Path]:
    """Local paths of the index and id map, checked against ``meta``'s SHA-256: the files
    themselves, or (remote OUT) downloads in the one cache, ``EMBEDPIPE_CACHE/index/...``."""
    src = index_url(out, set_name(meta.name))
    _checked(meta, meta.name, storage.join(src, MARKER))
    local = not storage.is_remote(src)
    folder = Path(storage.local_path(src)) if local else _cached(src, meta)
    for name, digest in ((meta.index_file, meta.index_sha256),
                         (meta.idmap_file, meta.idmap_sha256)):
        _verify(folder / name, digest, storage.join(src, name))
    return folder / meta.index_file, folder / meta.idmap_file


def _verify(path: Path, digest: str | None, shown: str) -> None:
    with storage.explained(shown, "read"):
        found = storage.sha256(str(path))
    if found != digest:
        raise StorageError(
            f"{shown} does not match the SHA-256 in its {MARKER} (changed or damaged since "
            "it was published); rebuild the index with `embedpipe index ... --rebuild`"
        )


def _cached(src: str, meta: IndexMeta) -> Path:
    """The cache folder of ``meta``'s version of remote index ``src``, downloaded if missing
    (into a hidden folder, checked, then renamed); versions other than it and the one it
    replaced are removed (a reader of that one, mid-swap, may be about to open it), and so are
    downloads a killed process left behind."""
    root = cache_root()
    parent = root / "index" / src.split("://", 1)[1].strip("/")
    target = parent / file_name(meta.token, "the index token")
    if not target.resolve().is_relative_to((root / "index").resolve()):
        raise StorageError(f"index {src} would be cached outside {root / 'index'}")
    if not (target / meta.idmap_file).exists():
        storage.remove_stale_temporaries(str(parent), older_than=ABANDONED_DOWNLOAD_S)
        _download(src, meta, parent, target)
    keep = {meta.token, meta.previous_token}
    for old in parent.iterdir():
        if old.is_dir() and old.name not in keep and not old.name.startswith("."):
            shutil.rmtree(old, ignore_errors=True)
    return target


def _download(src: str, meta: IndexMeta, parent: Path, target: Path) -> None:
    fs, path = storage.filesystem(src)
    partial = parent / f"{storage.STAGING_PREFIX}{uuid.uuid4().hex}"
    partial.mkdir(parents=True)
    try:
        for name, digest in ((meta.index_file, meta.index_sha256),
                             (meta.idmap_file, meta.idmap_sha256)):
            with storage.explained(storage.join(src, name), "download"):
                fs.get_file(f"{path.rstrip('/')}/{name}", str(partial / name))
            _verify(partial / name, digest, storage.join(src, name))
        if not target.exists():  # else another process finished the same download first
            try:
                os.replace(partial, target)
            except OSError as exc:  # ... between the check and the rename (not empty)
                if not (target / meta.idmap_file).exists():
                    raise StorageError(f"cannot cache index {src} in {target}: "
                                       f"{type(exc).__name__}: {exc}") from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def load(out: str, meta: IndexMeta) -> tuple[faiss.Index, IdMap]:
    """The index and id map of ``meta``, read only after their checksums matched; its
    ``params`` checked against the index they are for."""
    index_path, idmap_path = local_files(out, meta)
    with storage.explained(str(index_path), "read"):
        try:
            index = faiss.read_index(str(index_path))
        except RuntimeError as exc:
            raise StorageError(f"cannot read FAISS index {index_path}: {exc}") from None
        table = pq.read_table(idmap_path)
    params = params_problem(index, meta.params)
    problem = _shape_problem(index, table, meta) or (params and f"params: {params}")
    if problem:
        marker = storage.join(index_url(out, set_name(meta.name)), MARKER)
        raise StorageError(f"{marker}: {problem}; rebuild the index with "
                           f"`embedpipe index {out} --set {meta.name} --rebuild`")
    return index, IdMap.from_table(table, str(idmap_path))


def _shape_problem(index: faiss.Index, idmap: pa.Table, meta: IndexMeta) -> str | None:
    """Where the files, though their checksums match, disagree with ``meta``: a catch-up
    would hand out labels the index holds, a search compare vectors of another width or by
    another metric."""
    found = {"dim": int(index.d), "ntotal": int(index.ntotal), "rows": idmap.num_rows,
             "metric": "ip" if index.metric_type == faiss.METRIC_INNER_PRODUCT else "l2"}
    for key, value in found.items():
        if value != getattr(meta, key):
            return f"{key} {getattr(meta, key)}, but its files hold {value}"
    return None
