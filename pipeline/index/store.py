"""An index on disk: ``OUT/index/<set>/`` with versioned files and ``_INDEX.json`` naming them.

Publishing is atomic for readers on local disks and S3 alike: the FAISS file and the id map
of a build get fresh names (``index-<token>.faiss``, ``idmap-<token>.parquet``), each written
whole, and only then is ``_INDEX.json`` replaced to point at them. A reader that loaded the
previous ``_INDEX.json`` still finds its files: the previous version is kept, older ones
are pruned. Remote indexes are built locally, uploaded, and loaded through a local cache.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import faiss
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, ValidationError

from pipeline import storage
from pipeline.errors import StorageError
from pipeline.index.idmap import IdMap

MARKER = "_INDEX.json"


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
    mode: str  # "full" or "catch-up"
    built_at: float
    build_seconds: float

    @property
    def masked(self) -> int:
        return self.ntotal - self.rows


def index_url(out: str, name: str) -> str:
    return storage.join(out, "index", name)


def read_meta(out: str, name: str) -> IndexMeta | None:
    url = storage.join(index_url(out, name), MARKER)
    if not storage.exists(url):
        return None
    try:
        return IndexMeta.model_validate(storage.read_json(url))
    except ValidationError as exc:
        raise StorageError(f"{url} is not an index description: {exc.errors()[0]['msg']}") from None


def new_token() -> str:
    return f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"


def publish(out: str, index: faiss.Index, idmap: IdMap, meta: IndexMeta) -> None:
    """Write the index files under new names, then ``_INDEX.json``; prune old versions."""
    dest = index_url(out, meta.name)
    if storage.is_remote(dest):
        with tempfile.TemporaryDirectory(prefix="embedpipe-index-") as tmp:
            _stage(Path(tmp), index, idmap, meta)
            storage.upload_dir(tmp, dest)  # files whose names start with "_" go last
    else:
        folder = Path(dest.removeprefix("file://"))
        staging = folder / f".staging-{meta.token}"
        try:
            _stage(staging, index, idmap, meta)
            for name in (meta.index_file, meta.idmap_file, MARKER):
                os.replace(staging / name, folder / name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    _prune(dest, keep={meta.token, meta.previous_token})


def _stage(folder: Path, index: faiss.Index, idmap: IdMap, meta: IndexMeta) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with storage.explained(str(folder), "write"):
        faiss.write_index(index, str(folder / meta.index_file))
        pq.write_table(idmap.to_table(), folder / meta.idmap_file, compression="zstd")
        (folder / MARKER).write_text(meta.model_dump_json(indent=2))


def _prune(dest: str, keep: set[str | None]) -> None:
    for url in storage.list_files(dest):
        name = url.rsplit("/", 1)[-1]
        if not name.startswith(("index-", "idmap-")):
            continue
        token = name.split("-", 1)[1].rsplit(".", 1)[0]
        if token not in keep:
            storage.remove(url)


def local_files(out: str, meta: IndexMeta) -> tuple[Path, Path]:
    """Local paths of the index and id map: the files themselves, or cached downloads."""
    src = index_url(out, meta.name)
    if not storage.is_remote(src):
        folder = Path(src.removeprefix("file://"))
        return folder / meta.index_file, folder / meta.idmap_file
    root = Path(os.environ.get("EMBEDPIPE_CACHE", Path.home() / ".cache/embedpipe"))
    target = root / "index" / src.split("://", 1)[1].strip("/") / meta.token
    if not (target / meta.idmap_file).exists():
        fs, path = storage.filesystem(src)
        partial = target.parent / f".partial-{uuid.uuid4().hex}"
        partial.mkdir(parents=True)
        try:
            for name in (meta.index_file, meta.idmap_file):
                with storage.explained(storage.join(src, name), "download"):
                    fs.get_file(f"{path.rstrip('/')}/{name}", str(partial / name))
            if not target.exists():
                os.replace(partial, target)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    for old in target.parent.iterdir():
        if old.is_dir() and old.name != meta.token and not old.name.startswith("."):
            shutil.rmtree(old, ignore_errors=True)
    return target / meta.index_file, target / meta.idmap_file


def load(out: str, meta: IndexMeta) -> tuple[faiss.Index, IdMap]:
    index_path, idmap_path = local_files(out, meta)
    with storage.explained(str(index_path), "read"):
        try:
            index = faiss.read_index(str(index_path))
        except RuntimeError as exc:
            raise StorageError(f"cannot read FAISS index {index_path}: {exc}") from None
        table = pq.read_table(idmap_path)
    return index, IdMap.from_table(table, str(idmap_path))
