"""All file IO goes through here: local paths and ``s3://`` URLs alike, via fsspec.

Writes are atomic for readers: locally a temporary file is renamed into place; on S3 an
object becomes visible only when its single PUT (or multipart completion) succeeds, and s3fs
aborts a failed multipart upload, so a crash mid-upload leaves nothing behind that looks
finished.

S3 specifics handled here, so callers can treat every URL alike:

- Credentials come from the standard AWS chain (env vars, ``AWS_PROFILE``, config files,
  instance roles). They are never logged, and error messages are scrubbed of them.
- The endpoint of an S3-compatible store (MinIO, a test server) comes from
  ``EMBEDPIPE_S3_ENDPOINT`` (or ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``); a custom
  endpoint uses path-style addressing, which every S3-compatible store understands.
- Listings are never cached: other processes (Dask workers, a previous run) write to the
  same prefixes, and a stale listing would hide finished parts or show deleted ones.
- Filesystem objects are cached per process and per credential environment, so a change of
  ``AWS_*`` variables (another profile, a test fixture) never reuses a stale client.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, TypeVar
from urllib.parse import urlsplit

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.core import url_to_fs
from pydantic import BaseModel, ValidationError

from pipeline.errors import ConfigError, StorageError
from pipeline.names import QUARANTINE

M = TypeVar("M", bound=BaseModel)

_S3_SCHEMES = ("s3://", "s3a://")
GLOB_CHARS = "*?["  # a corpus URL holding one is a glob, unless it names a file or folder
_ENDPOINT_VARS = ("EMBEDPIPE_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
# Everything in the environment that changes which credentials or endpoint a client uses.
_CLIENT_ENV_VARS = (
    *_ENDPOINT_VARS,
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
    "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_REGION", "AWS_DEFAULT_REGION",
    "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_EC2_METADATA_DISABLED",
    "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE",
)
_SECRET_VARS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
_HIDDEN_PREFIXES = (".", "_")

_fs_cache: dict[tuple, fsspec.AbstractFileSystem] = {}
_fs_lock = threading.Lock()


def is_s3(url: str) -> bool:
    return url.startswith(_S3_SCHEMES)


# the spellings of a local path that fsspec's LocalFileSystem reads (it strips each): every
# check of where a path lies must read them as the file system does, or a path spelled
# ``file:/…`` would pass for one outside OUT and still be written inside it
_LOCAL_SCHEMES = ("file://", "local://", "file:", "local:")


def is_remote(url: str) -> bool:
    """Whether ``url`` names a store rather than a local path (however that is spelled)."""
    return ("://" in url or "::" in url) and not url.startswith(_LOCAL_SCHEMES)


def local_path(url: str) -> str:
    """The path a local ``url`` names: its scheme (``file://``, ``file:``, ``local://``,
    ``local:``) removed as fsspec removes it."""
    for scheme in _LOCAL_SCHEMES:
        if url.startswith(scheme):
            return url[len(scheme):]
    return url


def _refuse_chained(url: str) -> None:
    """A chained URL (``simplecache::file://…``) is one line: what it names, and so whether
    it lies inside OUT or a corpus, is another file system's to say."""
    if "::" in url:
        raise StorageError(f"cannot open {url}: chained URLs are not supported; give a local "
                           "path or an s3:// URL")


def canonical(url: str) -> str:
    """One spelling per place: ``s3a://`` as ``s3://``, a local path as its real absolute
    path (its scheme, ``./`` and links resolved), no trailing slash. A chained URL names no
    place of its own: refused (``_refuse_chained``)."""
    _refuse_chained(url)
    if is_s3(url):
        return "s3://" + url.split("://", 1)[1].strip("/")
    if is_remote(url):
        return url.rstrip("/")
    return os.path.realpath(local_path(url))


def is_under(url: str, folder: str) -> bool:
    """Whether ``url`` is ``folder`` or lies inside it, however either is spelled."""
    path, base = canonical(url), canonical(folder)
    return path == base or path.startswith(base + "/")


def endpoint_url() -> str | None:
    """The S3 endpoint from the environment, or None for AWS itself; one that is not an
    http(s) URL with a host (``minio:9000``, a common spelling) is a one-line ConfigError, not
    the traceback of the S3 client's ``ValueError: Invalid endpoint``."""
    for var in _ENDPOINT_VARS:
        endpoint = os.environ.get(var)
        if endpoint:
            parts = urlsplit(endpoint)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConfigError(f"{var}={endpoint!r} is not an S3 endpoint URL: expected "
                                  "http(s)://host[:port]")
            return endpoint
    return None


def storage_options(url: str) -> dict:
    """fsspec options for ``url``: for S3, the endpoint (if any) and no listings cache."""
    if not is_s3(url):
        return {}
    options: dict = {"use_listings_cache": False}
    endpoint = endpoint_url()
    if endpoint:
        options["client_kwargs"] = {"endpoint_url": endpoint}
        options["config_kwargs"] = {"s3": {"addressing_style": "path"}}
    return options


def _env_token() -> str:
    """A digest (not the values: they include secrets) of the client-relevant environment."""
    raw = json.dumps([os.environ.get(v) for v in _CLIENT_ENV_VARS])
    return hashlib.sha256(raw.encode()).hexdigest()


def filesystem(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem for ``url`` and the path inside it (a chained URL refused)."""
    _refuse_chained(url)
    if not is_s3(url):
        try:
            return url_to_fs(url)
        except (ImportError, ValueError) as exc:
            raise StorageError(f"cannot open {url}: {exc}") from None
    options = storage_options(url)
    key = (os.getpid(), _env_token(), json.dumps(options, sort_keys=True))
    with _fs_lock:
        fs = _fs_cache.get(key)
        if fs is None:
            # Drop clients made for another environment: they would hold stale credentials.
            for old in [k for k in _fs_cache if k[:2] != key[:2]]:
                del _fs_cache[old]
            fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
            _fs_cache[key] = fs
    return fs, fs._strip_protocol(url)


def join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *(p.strip("/") for p in parts)])


def _bucket(url: str) -> str:
    return url.split("://", 1)[1].split("/", 1)[0]


@contextmanager
def explained(url: str, action: str) -> Iterator[None]:
    """Turn low-level IO errors into one-line StorageErrors naming the URL."""
    try:
        yield
    except StorageError:
        raise
    except FileNotFoundError as exc:
        if is_s3(url) and "bucket does not exist" in str(exc).lower():
            raise _error(url, action, f"bucket '{_bucket(url)}' does not exist") from None
        raise _error(url, action, f"not found ({_short(exc)})") from None
    except PermissionError as exc:
        raise _error(url, action, f"access denied ({_short(exc)})") from None
    except OSError as exc:
        raise _error(url, action, _short(exc)) from None
    except Exception as exc:  # botocore / aiohttp raise their own types
        module = type(exc).__module__
        if type(exc).__name__ == "NoCredentialsError":
            reason = ("no AWS credentials found (set AWS_ACCESS_KEY_ID and "
                      "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)")
            raise _error(url, action, reason) from None
        if module.startswith(("botocore", "aiobotocore", "s3fs", "aiohttp")):
            raise _error(url, action, _short(exc)) from None
        raise


def _error(url: str, action: str, reason: str) -> StorageError:
    return StorageError(_scrub(f"cannot {action} {url}: {reason}"))


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _scrub(message: str) -> str:
    """Mask any secret from the environment that a library echoed into ``message``."""
    for var in _SECRET_VARS:
        secret = os.environ.get(var)
        if secret and len(secret) >= 4:
            message = message.replace(secret, "***")
    return message


def _require_bucket(fs: fsspec.AbstractFileSystem, url: str, action: str) -> None:
    """On S3, fail clearly when the bucket of ``url`` is missing or not ours to read."""
    if not is_s3(url):
        return
    with explained(url, action):
        fs.call_s3("list_objects_v2", Bucket=_bucket(url), MaxKeys=1)


def exists(url: str) -> bool:
    fs, path = filesystem(url)
    with explained(url, "check"):
        return fs.exists(path)


def is_dir(url: str) -> bool:
    fs, path = filesystem(url)
    with explained(url, "check"):
        return fs.isdir(path)


def size(url: str) -> int:
    """Bytes in the file at ``url`` (read before reading a file whose size must be bounded)."""
    fs, path = filesystem(url)
    with explained(url, "read"):
        return int(fs.size(path))


def open_file(url: str) -> IO[bytes]:
    """The file at ``url`` opened for reading. A local one is opened without blocking and
    only if it is a regular file: a FIFO or device in its place (``_INDEX.json``, a part, a
    corpus file) would hang the reader for good. Call inside ``explained``."""
    fs, path = filesystem(url)
    if is_remote(url):
        return fs.open(path, "rb")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise StorageError(f"cannot read {url}: not a regular file")
    return os.fdopen(fd, "rb")


def read_bytes(url: str, limit: int | None = None) -> bytes:
    """The file's bytes; more than ``limit`` of them is one line (a file that would fill
    memory is not read)."""
    with explained(url, "read"), open_file(url) as fh:
        if limit is None:
            return fh.read()
        if _file_size(fh) > limit or len(data := fh.read(limit + 1)) > limit:
            raise StorageError(f"cannot read {url}: larger than {limit:,} bytes")
    return data


def read_files(urls: Sequence[str]) -> list[bytes | None]:
    """Each file's bytes (``read_bytes``), None for one that is not there (removed since it
    was listed). On a remote store they are fetched at once, each with one request: a set's
    done markers on S3 are read in about the time of one, not one after another."""
    if not urls or not is_remote(urls[0]):
        return [_bytes_if_there(url) for url in urls]
    fs, _ = filesystem(urls[0])  # a folder's files: one store, one client
    paths = [fs._strip_protocol(url) for url in urls]
    # max_concurrency=1: one GET per file (s3fs asks each file's size first otherwise)
    options = {"max_concurrency": 1} if is_s3(urls[0]) else {}
    with explained(urls[0], "read"):  # cat_ranges: the paths as they are, never globbed
        found = fs.cat_ranges(paths, None, None, on_error="return", **options)
    read = []
    for url, data in zip(urls, found, strict=True):
        if isinstance(data, FileNotFoundError):
            read.append(None)
            continue
        if isinstance(data, BaseException):
            with explained(url, "read"):
                raise data
        read.append(data)
    return read


def _bytes_if_there(url: str) -> bytes | None:
    try:
        return read_bytes(url)
    except StorageError:
        if exists(url):
            raise
        return None


def _file_size(fh: IO[bytes]) -> int:
    """Bytes in an open file, from the file system (a local file) or the store (S3)."""
    try:
        return os.fstat(fh.fileno()).st_size
    except (OSError, io.UnsupportedOperation, AttributeError):
        return int(getattr(fh, "size", 0) or 0)


def sha256(url: str) -> str:
    """SHA-256 (hex) of the file at ``url``, read in 4 MiB pieces."""
    digest = hashlib.sha256()
    with explained(url, "read"), open_file(url) as fh:
        for piece in iter(lambda: fh.read(1 << 22), b""):
            digest.update(piece)
    return digest.hexdigest()


def write_bytes(url: str, data: bytes) -> None:
    """Write ``data`` so that readers see either nothing or the whole object."""
    fs, path = filesystem(url)
    with explained(url, "write"):
        if is_remote(url):
            fs.pipe_file(path, data)
            return
        _write_local_atomic(path, lambda fh: fh.write(data))


def _write_local_atomic(path: str, fill) -> None:
    """Write via a hidden temporary file in the same folder, then rename into place, and
    make the rename durable before returning (the folder synced): a power loss can then never
    keep a later file (a done marker) and lose an earlier one (its part)."""
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f"{TMP_PREFIX}{uuid.uuid4().hex}-{os.path.basename(path)}")
    try:
        with open(tmp, "wb") as fh:
            fill(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _sync_folder(parent)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


TMP_PREFIX, STAGING_PREFIX = ".tmp-", ".staging-"  # a local write's file, an index's folder


def remove_stale_temporaries(url: str, older_than: float) -> int:
    """Remove what writers killed mid-write left in local folder ``url`` and below: hidden
    ``.tmp-*`` files and ``.staging-*`` folders untouched for ``older_than`` seconds (no
    listing shows them, so nothing else ever would). On S3 an object appears whole or not at
    all: nothing to do. Returns how many went."""
    if is_remote(url):
        return 0
    cutoff, removed = time.time() - older_than, 0
    with explained(url, "clean"):
        for folder, dirs, files in os.walk(local_path(url)):
            stale = [(n, False) for n in files if n.startswith(TMP_PREFIX)]
            stale += [(n, True) for n in dirs if n.startswith(STAGING_PREFIX)]
            dirs[:] = [d for d in dirs if not d.startswith(STAGING_PREFIX)]
            for name, is_dir in stale:
                removed += _remove_if_older(os.path.join(folder, name), is_dir, cutoff)
    return removed


def refuse_linked_folders(url: str) -> None:
    """A writer writes and removes files only inside local OUT ``url``: a folder of those it
    writes in (``WRITTEN_FOLDERS`` and below) that is a symbolic link (``OUT/index/<set>``
    linked elsewhere) would take its writes, and its pruning, outside. One line naming the
    first such link; ``url`` itself may be one, and other folders of it are left alone."""
    if is_remote(url):
        return
    root = local_path(url)
    with explained(url, "check"):
        for top in WRITTEN_FOLDERS:
            _refuse_link(os.path.join(root, top), url)
            for folder, dirs, _ in os.walk(os.path.join(root, top)):
                for name in dirs:
                    _refuse_link(os.path.join(folder, name), url)


WRITTEN_FOLDERS = ("sets", "index", QUARANTINE)  # of an OUT: what writers write and prune


def _refuse_link(path: str, out: str) -> None:
    if os.path.islink(path):
        raise StorageError(f"{path!r} is a symbolic link to {os.readlink(path)!r}: a writer "
                           f"writes and removes files only inside {out}; put the folder "
                           "itself there")


def _remove_if_older(path: str, is_dir: bool, cutoff: float) -> int:
    try:
        if os.path.islink(path) or _last_written(path, is_dir) >= cutoff:
            return 0
        shutil.rmtree(path) if is_dir else os.remove(path)
    except FileNotFoundError:  # its writer finished or cleaned up meanwhile
        return 0
    return 1


def _last_written(path: str, is_dir: bool) -> float:
    """When ``path`` was last written: for a folder, the newest of it and its entries (a file
    still being written into an old folder is in use)."""
    times = [os.lstat(path).st_mtime]
    if is_dir:
        with os.scandir(path) as entries:
            times += [e.stat(follow_symlinks=False).st_mtime for e in entries]
    return max(times)


def check_folder(url: str, what: str) -> None:
    """``url`` can become a folder: a local path that is a file, or lies under one, or an S3
    bucket that is not there (or not ours), is one line naming ``what`` it is for (before any
    work that would end writing there)."""
    if is_remote(url):
        fs, _ = filesystem(url)
        _require_bucket(fs, url, "check")
        return
    path = Path(local_path(url))
    with explained(url, "check"):
        existing = next(p for p in (path, *path.parents) if p.exists())
        if not existing.is_dir():
            raise StorageError(f"cannot use {url} for {what}: {existing} is a file, not a "
                               "folder")


def _sync_folder(folder: str) -> None:
    """fsync ``folder`` (its entries: the rename). A file system that cannot sync a folder
    (EINVAL, ENOTSUP: some FUSE and network mounts) offers no such durability to keep."""
    fd = os.open(folder or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


MAX_JSON_BYTES = 1 << 29  # 512 MiB: a changes file of tens of millions of deleted ids


def read_json(url: str) -> dict:
    return parse_json(read_bytes(url, MAX_JSON_BYTES), url, StorageError)


def parse_json(raw: bytes | str, what: str, error: type[Exception]) -> Any:
    """``raw`` parsed, or one ``error`` line naming ``what``: json.loads also raises
    ValueError for bytes that are not UTF-8 and an int of 5,000 digits, RecursionError for
    arrays nested too deep."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise error(f"{what} is not valid JSON: {reason}") from None


def read_model(url: str, model: type[M], what: str) -> M | None:
    """A JSON file validated into ``model`` (None when there is no file): one line naming
    ``url`` and ``what`` it should be when it is not."""
    if not exists(url):
        return None
    try:
        return model.model_validate(read_json(url))
    except ValidationError as exc:
        raise StorageError(f"{url} is not {what}: {exc.errors()[0]['msg']}") from None


def write_json(url: str, payload: dict) -> None:
    write_bytes(url, json.dumps(payload, indent=2, sort_keys=True, default=str).encode())


def write_parquet(url: str, table: pa.Table, row_group_size: int | None = None) -> None:
    """Serialise ``table`` in memory, then write it atomically."""
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd", row_group_size=row_group_size)
    write_bytes(url, sink.getvalue())


def read_parquet(url: str, columns: list[str] | None = None) -> pa.Table:
    with explained(url, "read"), open_file(url) as fh:
        try:
            return pq.read_table(fh, columns=columns)
        except pa.ArrowInvalid as exc:
            raise StorageError(f"{url} is not a readable Parquet file: {exc}") from None


def parquet_file(url: str, metadata: pq.FileMetaData | None = None) -> pq.ParquetFile:
    """Open a Parquet file lazily (metadata only) for streaming row groups; ``metadata``: its
    footer as a caller already read (and checked) it, not read again. The ParquetFile owns
    the file it opened: ``close()`` (or ``with``) closes it."""
    with explained(url, "open"):
        source = open_file(url)
        try:
            pf = pq.ParquetFile(source, metadata=metadata)
        except pa.ArrowInvalid as exc:
            source.close()
            raise StorageError(f"{url} is not a readable Parquet file: {exc}") from None
    pf._close_source = True  # pyarrow leaves a file object it was given open
    return pf


def parquet_footer(url: str) -> tuple[pq.FileMetaData, pa.Schema]:
    """A Parquet file's footer and Arrow schema, the file closed again."""
    with parquet_file(url) as pf:
        return pf.metadata, pf.schema_arrow


def _ls(url: str, kinds: tuple[str, ...]) -> list[str]:
    """Entries of the given types ("file", "directory") directly under folder ``url``."""
    fs, path = filesystem(url)
    with explained(url, "list"):
        entries = fs.ls(path, detail=True) if fs.exists(path) else []
    if not entries:
        _require_bucket(fs, url, "list")
    return sorted(
        _as_url(url, e["name"].rstrip("/")) for e in entries
        if _kind(e) in kinds and e["name"].rstrip("/") != path.rstrip("/")
        and not os.path.basename(e["name"].rstrip("/")).startswith(".")
    )


def _kind(entry: dict) -> str:
    """An ``fs.ls`` entry's type; a local symbolic link (type "other") is "linked folder"
    where it points to a folder."""
    if entry["type"] == "other" and entry.get("islink") and os.path.isdir(entry["name"]):
        return "linked folder"
    return entry["type"]


def list_files(url: str, suffix: str = "") -> list[str]:
    """Entries directly under folder ``url`` whose names end with ``suffix``, sorted, as URLs.

    Sub-folders (S3: common prefixes) are listed too, as they always were; use
    ``list_dirs`` for sub-folders only. Names starting with ``.`` are skipped. A folder that
    does not exist lists as empty; on S3 a missing bucket is an error.
    """
    return [f for f in _ls(url, ("file", "directory")) if f.endswith(suffix)]


def list_regular_files(url: str, suffix: str = "") -> list[str]:
    """Files directly under folder ``url`` whose names end with ``suffix`` (no sub-folders,
    links or FIFOs), sorted, as URLs."""
    return [f for f in _ls(url, ("file",)) if f.endswith(suffix)]


def list_dirs(url: str) -> list[str]:
    """Sub-folders directly under folder ``url`` (S3: common prefixes), sorted, as URLs; a
    local link to a folder too (a set folder linked from elsewhere is read through it, and
    refused where a writer would write: ``refuse_linked_folders``)."""
    return _ls(url, ("directory", "linked folder"))


def _as_url(base_url: str, found: str) -> str:
    """Map a path returned by fs.ls/glob back onto the scheme of ``base_url``."""
    if not is_remote(base_url):
        return found
    scheme = base_url.split("://", 1)[0]
    return f"{scheme}://{found.lstrip('/')}"


def expand_parquet(url: str, pattern: bool | None = None) -> list[str]:
    """A corpus given as a file, a folder or a glob, as a sorted list of Parquet file URLs.

    In a folder, files and sub-folders whose names start with ``.`` or ``_`` are skipped
    (markers, temporary files). ``pattern``: ``is_pattern(url)`` where the caller asked it.
    """
    fs, path = filesystem(url)
    pattern = is_pattern(url) if pattern is None else pattern
    with explained(url, "list"):
        if pattern:
            found = [p for p in fs.glob(path) if fs.isfile(p)]
        elif fs.isdir(path):
            base = path.rstrip("/")
            found = [p for p in fs.find(base) if p.endswith(".parquet")
                     and not _hidden(p[len(base):])]
        elif fs.exists(path):
            found = [path]
        else:
            found = None
    if found is None:
        _require_bucket(fs, url, "read")
        raise StorageError(f"cannot read {url}: not found")
    found = [p for p in found if not os.path.basename(p).startswith(_HIDDEN_PREFIXES)]
    if not found:
        raise StorageError(f"no Parquet files under {url}")
    return sorted(_as_url(url, p) for p in found)


def is_pattern(url: str) -> bool:
    """Whether corpus ``url`` is a glob: it holds ``*``, ``?`` or ``[`` and names no file or
    folder that exists (``s3://b/run [1]/corpus/`` is read as it is, not as ``run 1``)."""
    fs, path = filesystem(url)
    if not any(ch in path for ch in GLOB_CHARS):
        return False
    with explained(url, "list"):
        return not fs.exists(path)


def _hidden(relative: str) -> bool:
    return any(part.startswith(_HIDDEN_PREFIXES) for part in relative.split("/") if part)


def remove(url: str, recursive: bool = False) -> None:
    fs, path = filesystem(url)
    with explained(url, "remove"):
        if fs.exists(path):
            fs.rm(path, recursive=recursive)


def put_file(local: str | Path, url: str) -> None:
    """Upload the local file ``local`` to remote ``url`` (an object appears whole or not)."""
    fs, path = filesystem(url)
    with explained(url, "upload to"):
        fs.put_file(str(local), path)


def _botocore_credentials() -> dict[str, str]:
    """The region and credentials botocore's chain resolves here, as object_store keys."""
    import botocore.session

    session = botocore.session.Session()
    options = {"aws_region": os.environ.get("AWS_REGION")
               or session.get_config_variable("region") or "us-east-1"}
    found = session.get_credentials()
    if found is not None:
        frozen = found.get_frozen_credentials()
        options |= {"aws_access_key_id": frozen.access_key,
                    "aws_secret_access_key": frozen.secret_key}
        if frozen.token:
            options["aws_session_token"] = frozen.token
    return options


def polars_options(url: str) -> dict[str, str]:
    """``storage_options`` for polars (object_store keys) that reach ``url`` as fsspec does:
    the same endpoint (path-style, plain HTTP allowed for a loopback or private store) and
    the same credentials, found by botocore's chain as s3fs finds them (variables, a profile
    in the shared credentials file, ...); empty for a local path."""
    if not is_s3(url):
        return {}
    options = _botocore_credentials()
    endpoint = endpoint_url()
    if endpoint:
        options["aws_endpoint_url"] = endpoint
        options["aws_virtual_hosted_style_request"] = "false"
        options["aws_allow_http"] = str(endpoint.startswith("http://")).lower()
    return options
