"""All file IO goes through here: local paths and ``s3://`` URLs alike, via fsspec.

Writes are atomic for readers: locally a temporary file is renamed into place; on S3 an
object becomes visible only when its single PUT (or multipart completion) succeeds, so a
crash mid-upload leaves nothing behind that looks finished.
"""

from __future__ import annotations

import io
import json
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.core import url_to_fs

from pipeline.errors import StorageError

_ENDPOINT_VARS = ("EMBEDPIPE_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")


def storage_options(url: str) -> dict:
    """Options for the filesystem of ``url``; S3 endpoint from the environment if set."""
    if not url.startswith(("s3://", "s3a://")):
        return {}
    for var in _ENDPOINT_VARS:
        if os.environ.get(var):
            return {"client_kwargs": {"endpoint_url": os.environ[var]}}
    return {}


def is_remote(url: str) -> bool:
    return "://" in url and not url.startswith("file://")


def filesystem(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem for ``url`` and the path inside it."""
    try:
        return url_to_fs(url, **storage_options(url))
    except (ImportError, ValueError) as exc:
        raise StorageError(f"cannot open {url}: {exc}") from None


def join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *(p.strip("/") for p in parts)])


@contextmanager
def explained(url: str, action: str) -> Iterator[None]:
    """Turn low-level IO errors into one-line StorageErrors naming the URL."""
    try:
        yield
    except StorageError:
        raise
    except FileNotFoundError as exc:
        raise StorageError(f"cannot {action} {url}: not found ({_short(exc)})") from None
    except PermissionError as exc:
        raise StorageError(f"cannot {action} {url}: access denied ({_short(exc)})") from None
    except OSError as exc:
        raise StorageError(f"cannot {action} {url}: {_short(exc)}") from None
    except Exception as exc:  # botocore raises its own types (NoCredentialsError, ...)
        if type(exc).__module__.startswith(("botocore", "aiobotocore", "s3fs")):
            raise StorageError(f"cannot {action} {url}: {_short(exc)}") from None
        raise


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def exists(url: str) -> bool:
    fs, path = filesystem(url)
    with explained(url, "check"):
        return fs.exists(path)


def read_bytes(url: str) -> bytes:
    fs, path = filesystem(url)
    with explained(url, "read"):
        return fs.cat_file(path)


def write_bytes(url: str, data: bytes) -> None:
    """Write ``data`` so that readers see either nothing or the whole object."""
    fs, path = filesystem(url)
    with explained(url, "write"):
        if is_remote(url):
            fs.pipe_file(path, data)
            return
        parent = os.path.dirname(path)
        os.makedirs(parent, exist_ok=True)
        tmp = os.path.join(parent, f".tmp-{uuid.uuid4().hex}-{os.path.basename(path)}")
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)


def read_json(url: str) -> dict:
    raw = read_bytes(url)
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise StorageError(f"{url} is not valid JSON: {exc}") from None


def write_json(url: str, payload: dict) -> None:
    write_bytes(url, json.dumps(payload, indent=2, sort_keys=True, default=str).encode())


def write_parquet(url: str, table: pa.Table) -> None:
    """Serialise ``table`` in memory, then write it atomically."""
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    write_bytes(url, sink.getvalue())


def read_parquet(url: str, columns: list[str] | None = None) -> pa.Table:
    fs, path = filesystem(url)
    with explained(url, "read"):
        return pq.read_table(path, columns=columns, filesystem=fs)


def parquet_file(url: str) -> pq.ParquetFile:
    """Open a Parquet file lazily (metadata only) for streaming row groups."""
    fs, path = filesystem(url)
    with explained(url, "open"):
        try:
            return pq.ParquetFile(fs.open(path, "rb"))
        except pa.ArrowInvalid as exc:
            raise StorageError(f"{url} is not a readable Parquet file: {exc}") from None


def list_files(url: str, suffix: str = "") -> list[str]:
    """Files directly under folder ``url`` whose names end with ``suffix``, sorted, as URLs."""
    fs, path = filesystem(url)
    with explained(url, "list"):
        if not fs.exists(path):
            return []
        names = fs.ls(path, detail=False)
    return sorted(
        _as_url(url, path, name) for name in names
        if name.rstrip("/").endswith(suffix) and not os.path.basename(name).startswith(".")
    )


def _as_url(base_url: str, base_path: str, found: str) -> str:
    """Map a path returned by fs.ls/glob back onto the scheme of ``base_url``."""
    if not is_remote(base_url):
        return found
    scheme = base_url.split("://", 1)[0]
    return f"{scheme}://{found.lstrip('/')}"


def expand_parquet(url: str) -> list[str]:
    """A corpus given as a file, a folder or a glob, as a sorted list of Parquet file URLs."""
    fs, path = filesystem(url)
    with explained(url, "list"):
        if any(ch in path for ch in "*?["):
            found = [p for p in fs.glob(path) if fs.isfile(p)]
        elif fs.isdir(path):
            found = [p for p in fs.find(path) if p.endswith(".parquet")]
        elif fs.exists(path):
            found = [path]
        else:
            raise StorageError(f"corpus not found: {url}")
    found = [p for p in found if not os.path.basename(p).startswith((".", "_"))]
    if not found:
        raise StorageError(f"no Parquet files under {url}")
    return sorted(_as_url(url, path, p) for p in found)


def remove(url: str, recursive: bool = False) -> None:
    fs, path = filesystem(url)
    with explained(url, "remove"):
        if fs.exists(path):
            fs.rm(path, recursive=recursive)


def local_dir(url: str, cache_root: str | Path | None = None) -> Path:
    """A local folder holding the contents of ``url``: the path itself, or a download of it."""
    if not is_remote(url):
        return Path(url.removeprefix("file://"))
    root = Path(cache_root or os.environ.get("EMBEDPIPE_CACHE", Path.home() / ".cache/embedpipe"))
    target = root / "remote" / url.split("://", 1)[1].strip("/")
    fs, path = filesystem(url)
    with explained(url, "download"):
        target.mkdir(parents=True, exist_ok=True)
        fs.get(path.rstrip("/") + "/", str(target) + "/", recursive=True)
    return target


def upload_dir(local: str | Path, url: str) -> None:
    """Copy a local folder to ``url`` (a no-op when ``url`` is that folder)."""
    if not is_remote(url):
        return
    fs, path = filesystem(url)
    with explained(url, "upload to"):
        fs.put(str(local).rstrip("/") + "/", path.rstrip("/") + "/", recursive=True)
