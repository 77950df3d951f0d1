"""One writer per OUT: a lease in ``OUT/_LEASE.json`` that writers take, renew and release.

``embed``, ``backfill``, the nightly run and ``index`` hold it while they write; readers never
need it. A second writer fails at once with one line naming the holder (host, pid, command,
since when), or, when asked, waits for it. A holder that dies stops renewing, and its lease
expires ``ttl`` seconds after its last renewal (``EMBEDPIPE_LEASE_TTL``, default 60); the next
writer takes it over, at once where it runs on the holder's machine and sees its process gone
(``Holder.ended_here``). Because every shard is marked done only after its parts, the taker
redoes only the shards that the dead holder did not finish.

Every change of the lease is a compare-and-swap on the version the changer last read, so two
writers can never both believe they took it:

- local OUT: the swap runs under an exclusive ``fcntl.flock`` on ``OUT/.lease.lock`` (the
  version is the SHA-256 of the file's bytes; the file is replaced by an atomic rename);
- ``s3://`` OUT: S3 conditional writes: ``PutObject`` with ``If-None-Match: *`` creates it,
  ``If-Match: <ETag>`` renews, releases and takes it over (AWS S3 since 2024, MinIO, moto).

A renewal that finds another holder marks the lease lost; ``check`` (called by the flows
between shards and before ``finalize`` and an index's publish) then raises ``LeaseLost``, and
a shard's worker, in whichever process it runs, reads the lease before it writes a set's files
and before the marker that makes them the set's (``check_holder``): a writer paused past its
TTL writes nothing more into an OUT another writer took over, but for the moment between a
check and the write it guards (the README's "One writer per OUT: the lease"). The lease is
re-entrant within the thread that took it (an embed flow that also indexes does not wait for
itself; another thread of the process is another writer) and released on exit, normal or
not. Expiry compares the
holder's last renewal time with the taker's clock: writers' clocks must agree to well within
the TTL (NTP does this).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

from pydantic import BaseModel, Field

from pipeline import storage
from pipeline.config import DAY_S
from pipeline.errors import ConfigError, EmbedpipeError, StorageError

LEASE_FILE = "_LEASE.json"
TTL_ENV = "EMBEDPIPE_LEASE_TTL"
DEFAULT_TTL = 60.0
MAX_TTL = DAY_S
MAX_LEASE_BYTES = 64 * 1024  # a holder record is under 2 KB; more is not a lease
# Times a holder record may hold: from the epoch to the year 5138, so every one is a date.
_Time = Field(ge=0.0, le=1e11, allow_inf_nan=False)


class LeaseHeld(EmbedpipeError):
    """Another live writer holds the OUT's lease."""


class LeaseLost(EmbedpipeError):
    """This writer's lease expired and was taken over: it must not finalize."""


class Holder(BaseModel):
    """The content of ``_LEASE.json``: who holds the lease, since when, until when."""

    token: str  # unique per acquisition: tells this holder from a later one of the same pid
    host: str
    pid: int
    command: str  # the flow: embed, backfill, nightly, index
    argv: str = ""  # the holder's command line
    since: float = _Time
    renewed: float = _Time
    ttl: float = Field(gt=0.0, le=MAX_TTL, allow_inf_nan=False)
    renewals: int = 0  # makes every write unique (an S3 ETag is the MD5 of the content)
    released: bool = False
    process: str = ""  # ``process_identity`` of the holder ("": not known)

    def free(self, now: float) -> bool:
        """Released, expired, or held by a process of this machine that has ended."""
        return self.released or now > self.renewed + self.ttl or self.ended_here()

    def ended_here(self) -> bool:
        """The holder ran on this machine (same boot, same pid namespace) and its process is
        gone: its pid is free or now another process's. A holder elsewhere, or one that left
        no identity, only expires."""
        machine, _, _ = self.process.rpartition("/")
        if not machine or machine != _machine():
            return False
        return process_identity(self.pid) != self.process

    def describe(self, now: float) -> str:
        since = datetime.fromtimestamp(self.since, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        argv = f" `{_plain(self.argv, 500)}`" if self.argv else ""
        return (f"{_plain(self.command, 40)!r}{argv} (pid {self.pid} on "
                f"{_plain(self.host, 100)}, since {since}, renewed "
                f"{max(0.0, now - self.renewed):.0f}s ago)")

    def encode(self) -> bytes:
        return self.model_dump_json(indent=2).encode()


def _machine() -> str:
    """This boot of this machine and this pid namespace (containers on one host have their
    own): where a pid names one process; "" where /proc cannot tell."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def process_identity(pid: int) -> str:
    """``<machine>/<pid>:<start time>`` of a live process of this machine: a pid reused by a
    later process gets another; "" where the process is gone or /proc cannot tell."""
    machine = _machine()
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rpartition(")")[2].split()
    except OSError:
        return ""
    return f"{machine}/{pid}:{fields[19]}" if machine and len(fields) > 19 else ""


def _plain(text: str, limit: int) -> str:
    """``text`` read from the lease file, on one line of printable characters."""
    return "".join(c for c in " ".join(text.split()) if c.isprintable())[:limit]


def lease_ttl() -> float:
    """Seconds a lease lives after its last renewal (``EMBEDPIPE_LEASE_TTL``, default 60)."""
    raw = os.environ.get(TTL_ENV)
    if not raw:
        return DEFAULT_TTL
    try:
        ttl = float(raw)
    except ValueError:
        ttl = 0.0
    return _checked_ttl(ttl, f"{TTL_ENV}={raw!r}")


def _checked_ttl(ttl: float, what: str) -> float:
    if not 0.5 <= ttl <= MAX_TTL:  # NaN too
        raise ConfigError(f"{what}: expected seconds between 0.5 and {MAX_TTL:.0f}")
    return ttl


# ---- where the lease lives: a compare-and-swap store per backend ---------------------------


class _Store(Protocol):
    url: str

    def read(self) -> tuple[bytes | None, str | None]: ...
    def create(self, data: bytes) -> str | None: ...
    def replace(self, data: bytes, version: str) -> str | None: ...
    def remove(self, version: str) -> None: ...
    def check_swaps(self) -> None: ...


class _LocalStore:
    """A local file; every swap under an exclusive flock on a hidden side file."""

    def __init__(self, out: str) -> None:
        root = storage.local_path(out)
        self.url = os.path.join(root, LEASE_FILE)
        self._guard = os.path.join(root, ".lease.lock")
        with storage.explained(root, "create"):
            os.makedirs(root, exist_ok=True)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with storage.explained(self._guard, "lock"):
            fd = os.open(self._guard, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            with storage.explained(self._guard, "lock"):
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing drops the lock

    def read(self) -> tuple[bytes | None, str | None]:
        """The lease's bytes and version (None, None: no lease); any other failure to read
        (NFS's ESTALE, EIO) is a StorageError, which the renewer rides out. Opened without
        blocking and read only if it is a regular file: a FIFO or device put in its place
        would hang every writer, a huge file fill its memory."""
        try:
            fh = storage.open_file(self.url)
        except FileNotFoundError:
            return None, None
        except StorageError:  # not a regular file
            raise StorageError(f"{self.url} is not a regular file, so not a writer lease; "
                               "remove it") from None
        except OSError as exc:
            raise StorageError(f"cannot read {self.url}: {type(exc).__name__}: "
                               f"{exc}") from None
        with fh:
            try:
                data = fh.read(MAX_LEASE_BYTES + 1)
            except OSError as exc:
                raise StorageError(f"cannot read {self.url}: {type(exc).__name__}: "
                                   f"{exc}") from None
        return data, hashlib.sha256(data).hexdigest()

    def create(self, data: bytes) -> str | None:
        with self._locked():
            if os.path.exists(self.url):
                return None
            storage.write_bytes(self.url, data)
        return hashlib.sha256(data).hexdigest()

    def replace(self, data: bytes, version: str) -> str | None:
        with self._locked():
            if self.read()[1] != version:
                return None
            storage.write_bytes(self.url, data)
        return hashlib.sha256(data).hexdigest()

    def remove(self, version: str) -> None:
        with self._locked(), storage.explained(self.url, "remove"):
            if self.read()[1] == version:
                os.remove(self.url)

    def check_swaps(self) -> None:
        """flock holds on a local disk: nothing to probe."""


_SWAPS_CHECKED: set[str] = set()  # buckets whose store refused a second If-None-Match PUT


class _S3Store:
    """An S3 object, changed only by conditional PUTs (the ETag is the version)."""

    def __init__(self, out: str) -> None:
        self.url = storage.join(out, LEASE_FILE)
        self._fs, path = storage.filesystem(self.url)
        self._bucket, _, self._key = path.partition("/")

    def read(self) -> tuple[bytes | None, str | None]:
        from fsspec.asyn import sync

        async def get() -> tuple[bytes, str]:
            response = await self._fs._call_s3("get_object", Bucket=self._bucket, Key=self._key)
            body = response["Body"]
            data = b""
            try:  # a read returns what has arrived: read on to one byte past the limit
                while len(data) <= MAX_LEASE_BYTES and (
                        chunk := await body.read(MAX_LEASE_BYTES + 1 - len(data))):
                    data += chunk
            finally:
                body.close()
            return data, response["ETag"]

        with storage.explained(self.url, "read"):
            try:
                return sync(self._fs.loop, get)
            except FileNotFoundError:  # no lease yet (a missing bucket fails on the write)
                return None, None

    def _put(self, data: bytes, key: str | None = None, **condition: str) -> str | None:
        with storage.explained(self.url, "write"):
            try:
                response = self._fs.call_s3("put_object", Bucket=self._bucket,
                                            Key=key or self._key, Body=data, **condition)
            except Exception as exc:  # s3fs turns a refused condition into an OSError
                if _conflict(exc):
                    return None
                raise
        return response["ETag"]

    def create(self, data: bytes) -> str | None:
        return self._put(data, IfNoneMatch="*")

    def check_swaps(self) -> None:
        """Refuse a store that ignores conditional writes (older MinIO or Ceph RGW releases,
        some gateways): there two writers would both take the lease. Probed once per bucket
        in a process: a second ``If-None-Match: *`` PUT of one new key must be refused."""
        if self._bucket in _SWAPS_CHECKED:
            return
        probe = f"{self._key.rpartition('/')[0]}/.lease-probe-{uuid.uuid4().hex}".lstrip("/")
        self._put(b"", probe, IfNoneMatch="*")
        ignored = self._put(b"", probe, IfNoneMatch="*") is not None
        with storage.explained(self.url, "remove"):
            self._fs.call_s3("delete_object", Bucket=self._bucket, Key=probe)
        if ignored:
            raise StorageError(
                f"the S3 store of {self.url} ignores conditional writes (a second PutObject "
                "with If-None-Match: * was not refused), so it cannot keep two writers of one "
                "OUT apart; use a store that honours them (AWS S3, MinIO since 2024)")
        _SWAPS_CHECKED.add(self._bucket)

    def replace(self, data: bytes, version: str) -> str | None:
        return self._put(data, IfMatch=version)

    def remove(self, version: str) -> None:
        with storage.explained(self.url, "remove"):
            try:
                self._fs.call_s3("delete_object", Bucket=self._bucket, Key=self._key,
                                 IfMatch=version)
            except Exception as exc:
                if not _conflict(exc):
                    raise


def _conflict(exc: BaseException) -> bool:
    """True when a conditional write was refused: the object is not the one we read."""
    seen: BaseException | None = exc
    while seen is not None:
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            code = str(response.get("Error", {}).get("Code", ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return code in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409") \
                or status in (409, 412)
        if isinstance(seen, FileExistsError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _read_holder(store: _Store) -> tuple[Holder | None, str | None]:
    """The lease's holder and version in ``store`` (None, None: no lease)."""
    data, version = store.read()
    if data is None:
        return None, None
    try:
        if len(data) > MAX_LEASE_BYTES:
            raise ValueError("too large")
        return Holder.model_validate_json(data), version
    except ValueError:  # a pydantic ValidationError too
        raise StorageError(
            f"{store.url} is not a writer lease; if no embedpipe writer is running on this "
            "OUT, remove it"
        ) from None


def _store(out: str) -> _Store:
    if storage.is_s3(out):
        return _S3Store(out)
    if storage.is_remote(out):
        raise StorageError(f"cannot take a writer lease on {out}: only local paths and s3://")
    return _LocalStore(out)


# ---- the lease -----------------------------------------------------------------------------


@dataclass
class WriterLease:
    """This process's hold on one OUT's lease: taken, renewed in the background, released."""

    out: str
    command: str
    ttl: float = field(default_factory=lease_ttl)
    _store: _Store = field(init=False)
    _me: Holder = field(init=False)
    _version: str | None = field(init=False, default=None)
    _lost: str | None = field(init=False, default=None)
    _users: int = field(init=False, default=0)
    _stop: threading.Event = field(init=False, default_factory=threading.Event)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)
    _thread: threading.Thread | None = field(init=False, default=None)
    _thread_id: int = field(init=False, default_factory=threading.get_ident)  # the taker's

    def __post_init__(self) -> None:
        _checked_ttl(self.ttl, f"a lease TTL of {self.ttl!r}")
        self._store = _store(self.out)
        now = time.time()
        self._me = Holder(token=uuid.uuid4().hex, host=socket.gethostname(), pid=os.getpid(),
                          command=self.command, argv=_command_line(), since=now, renewed=now,
                          ttl=self.ttl, process=process_identity(os.getpid()))

    @property
    def url(self) -> str:
        return self._store.url

    @property
    def token(self) -> str:
        """This acquisition's token (``check_holder`` fences writers with it)."""
        return self._me.token

    def _current(self) -> tuple[Holder | None, str | None]:
        return _read_holder(self._store)

    def acquire(self, wait: float = 0.0) -> None:
        """Take the lease, waiting up to ``wait`` seconds for a live holder to finish."""
        deadline = time.monotonic() + max(0.0, wait)
        self._store.check_swaps()
        while True:
            holder, version = self._current()
            now = time.time()
            if holder is None or holder.free(now):
                self._me = self._me.model_copy(update={"since": now, "renewed": now})
                data = self._me.encode()
                got = (self._store.create(data) if version is None
                       else self._store.replace(data, version))
                if got is not None:
                    self._version = got
                    self._start_renewing()
                    return
                continue  # another writer swapped first: look again
            if time.monotonic() >= deadline:
                hint = ("" if wait else "; wait for it (lease_wait) or, if it is gone, "
                        f"retry after its lease expires ({holder.ttl:.0f}s after its last renewal)")
                raise LeaseHeld(f"{self.out} is being written by {holder.describe(now)}{hint}")
            time.sleep(min(1.0, self.ttl / 6, max(0.05, deadline - time.monotonic())))

    def renew(self) -> bool:
        """Extend the lease; False (and the lease marked lost) when another writer holds it."""
        with self._lock:
            if self._lost is not None or self._version is None:
                return False
            now = time.time()
            me = self._me.model_copy(update={"renewed": now, "renewals": self._me.renewals + 1})
            got = self._store.replace(me.encode(), self._version)
            if got is None:  # changed since we wrote it: ours (a lost response) or another's
                holder, version = self._current()
                if holder is not None and holder.token == self._me.token and not holder.released:
                    self._me, self._version = holder, version
                    return True
                self._lost = holder.describe(now) if holder else "nobody (the lease was removed)"
                return False
            self._me, self._version = me, got
            return True

    def check(self) -> None:
        """Raise ``LeaseLost`` when the lease was taken over (call before any finalizing)."""
        if self._lost is None and time.time() > self._me.renewed + self.ttl:
            self.renew()  # the renewer could not reach the store in time: try once more
            if time.time() > self._me.renewed + self.ttl:
                self._lost = self._lost or "nobody we know of (renewals failed past the TTL)"
        if self._lost is not None:
            raise LeaseLost(
                f"this {self.command} lost the writer lease on {self.out} to {self._lost}; "
                "it stopped before finalizing: rerun to resume"
            )

    def release(self) -> None:
        """Stop renewing and free the lease (if still ours) for the next writer at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self._lost is None and self._version is not None:
                done = self._me.model_copy(update={"released": True, "renewed": time.time()})
                try:
                    self._store.replace(done.encode(), self._version)
                except StorageError:  # e.g. a full disk: removing needs no space
                    with suppress(StorageError):  # unreachable: it expires after its TTL
                        self._store.remove(self._version)
            self._version = None

    def _start_renewing(self) -> None:
        self._thread = threading.Thread(target=self._renew_loop, daemon=True,
                                        name=f"lease-renewer {self.out}")
        self._thread.start()

    def _renew_loop(self) -> None:
        """Renew every third of the TTL until released or lost: a failed renewal (the store
        unreachable, a stale NFS handle) is retried, never the end of renewing; ``check``
        notices if failures last past the TTL."""
        while not self._stop.wait(self.ttl / 3):
            try:
                if not self.renew():
                    return
            except (StorageError, OSError):
                continue


_held: dict[str, WriterLease] = {}
_held_lock = threading.Lock()  # guards the two dicts, never held over IO
_out_locks: dict[str, threading.Lock] = {}  # one per OUT: taking or freeing its lease


def _out_lock(key: str) -> threading.Lock:
    with _held_lock:
        return _out_locks.setdefault(key, threading.Lock())


@contextmanager
def writer_lease(out: str, command: str, wait: float = 0.0) -> Iterator[WriterLease]:
    """Hold OUT's writer lease for the block; re-entrant within the thread that took it (an
    embed flow that also indexes). Another thread of this process is another writer: it
    waits up to ``wait`` seconds, then fails naming the holder, as one elsewhere would.
    Waiting for one OUT's lease holds up no thread that takes or frees another OUT's."""
    key = storage.canonical(out)
    deadline = time.monotonic() + max(0.0, wait)
    while (lease := _enter(key, out, command, wait)) is None:
        if time.monotonic() >= deadline:
            holder = _held.get(key)
            whom = holder._me.describe(time.time()) if holder else "another thread"
            raise LeaseHeld(f"{out} is being written by {whom}, in another thread of this "
                            "process")
        time.sleep(0.05)
    try:
        yield lease
    finally:
        with _out_lock(key):
            lease._users -= 1
            if lease._users == 0:
                del _held[key]
                lease.release()


def _enter(key: str, out: str, command: str, wait: float) -> WriterLease | None:
    """OUT's lease for this thread: the one it holds, or newly taken (waiting up to ``wait``
    for a holder elsewhere); None while another thread of this process holds it."""
    with _out_lock(key):
        lease = _held.get(key)
        if lease is None:
            lease = WriterLease(out, command)
            lease.acquire(wait)
            try:  # OUT is this writer's now: what writers killed mid-write left goes
                storage.refuse_linked_folders(out)
                storage.remove_stale_temporaries(out, older_than=lease.ttl)
            except StorageError:
                lease.release()
                raise
            _held[key] = lease
        elif lease._thread_id != threading.get_ident():
            return None
        lease._users += 1
        return lease


def check_holder(out: str, token: str) -> None:
    """Raise ``LeaseLost`` unless OUT's lease is still held, unexpired, by the acquisition
    ``token`` (``WriterLease.token``): read from the store, so it fences a worker in any
    process (a Dask or process runner's) before it writes a shard's files. A writer paused or
    cut off past its TTL, whose OUT another writer took over, writes nothing more into it."""
    holder, _ = _read_holder(_store(out))
    now = time.time()
    if holder is not None and holder.token == token and not holder.free(now):
        return
    whom = ("nobody (its lease expired)" if holder is not None and holder.token == token
            else holder.describe(now) if holder is not None else "nobody (the lease was removed)")
    raise LeaseLost(f"this run lost the writer lease on {out} to {whom}; it stopped before "
                    "writing a shard: rerun to resume")


def check_free(out: str) -> None:
    """Raise ``LeaseHeld`` naming the holder while another writer holds OUT's lease: for a
    caller about to change what that writer reads (the demo's corpus beside its OUT)."""
    writer = writer_of(out)
    if writer is not None:
        raise LeaseHeld(f"{out} is being written by {writer}")


def writer_of(out: str) -> str | None:
    """The writer holding OUT's lease now, described (its command, machine, process), or
    None where no live writer does. Reads the lease only: a reader takes nothing."""
    holder, _ = _read_holder(_store(out))
    now = time.time()
    return holder.describe(now) if holder is not None and not holder.free(now) else None


def check_held(out: str) -> None:
    """Raise ``LeaseLost`` if this process's lease on OUT was taken over (no-op if none held)."""
    lease = _held.get(storage.canonical(out))
    if lease is not None:
        lease.check()


def _command_line() -> str:
    """This process's command line as typed (``python -m flows.cli embed …``), program
    shortened to its file name."""
    argv = list(getattr(sys, "orig_argv", sys.argv))
    if argv:
        argv[0] = os.path.basename(argv[0])
    return " ".join(argv)[:500]
