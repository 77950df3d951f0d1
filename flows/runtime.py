"""Prefect's API for the command line: one local server, started once and reused by later runs.

Without ``PREFECT_API_URL`` Prefect 3 starts a temporary API server in every process (a uvicorn
subprocess that migrates its SQLite database before it answers the first request): seconds of
fixed cost on every run. The CLI instead starts that same server (``create_app`` in Prefect's
ephemeral mode: no UI, no background services) once, detached, records its pid and port under
the cache dir, and points ``PREFECT_API_URL`` at it; a later run finds it healthy with one HTTP
GET. The server stops by itself after ``IDLE_S`` seconds in which no run touched its record.

The CLI opts in (``EMBEDPIPE_PREFECT_SERVER=local``, set by ``prepare``); the server is started
only when a flow is about to run, after the input was checked, so bad input still fails in
seconds. Python callers keep Prefect's own per-process server unless they set the variable to
``local``. An API URL the user configured (environment, profile, test harness) always wins, and
``EMBEDPIPE_PREFECT_SERVER=ephemeral`` keeps Prefect's own per-process server.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from pipeline.errors import ConfigError, EmbedpipeError
from pipeline.settings import cache_root
from pipeline.torch_thread import spin_briefly

MODE_ENV = "EMBEDPIPE_PREFECT_SERVER"  # "local" (the CLI's default) or "ephemeral"
IDLE_S = 1800  # the server exits after this long without a run
IDLE_ENV = "EMBEDPIPE_PREFECT_IDLE_S"
START_TIMEOUT_S = 180  # a hang guard: a busy machine migrates the database slowly
RECORD = "prefect-server.json"
FLOW_COMMANDS = ("embed", "backfill", "index", "demo")  # CLI commands that run Prefect flows


class PrefectServerError(EmbedpipeError):
    """The local Prefect server did not start."""


def prepare(command: str) -> None:
    """Everything the CLI sets up once before running ``command``: OpenMP's brief spinning
    (``pipeline.torch_thread.spin_briefly``, before torch loads) and, for commands that run
    flows, the reused local Prefect server."""
    spin_briefly()
    if command in FLOW_COMMANDS:
        os.environ.setdefault(MODE_ENV, "local")  # started by use_local_server, when needed


def use_local_server() -> str | None:
    """Point Prefect at the reused local server (starting it if needed); returns its API URL.

    Does nothing (returns None) unless the mode is ``local``, or when an API URL is already
    configured.
    """
    if os.environ.get(MODE_ENV) != "local" or _configured_api_url():
        return None
    root = cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:  # no cache to record a server in: Prefect's own temporary one, slower
        return None
    with _locked(root / "prefect-server.lock"):
        url = _healthy_record(root / RECORD)
        if url is None:
            url = _start(root / RECORD)
    os.environ["PREFECT_API_URL"] = url
    return url


def api_is_up() -> bool:
    """Whether a flow would start without waiting for an API server to boot: an API URL is
    configured, or the reused local server answers. Otherwise the flow's start waits for one
    (the local server, or Prefect's own temporary one in this process): seconds that
    ``embedpipe.embed`` spends loading the model meanwhile."""
    if _configured_api_url():
        return True
    if os.environ.get(MODE_ENV) != "local":
        return False
    return _healthy_record(cache_root() / RECORD) is not None


@contextlib.contextmanager
def local_api() -> Iterator[str | None]:
    """Run the flows inside this block against the reused local server (see
    ``use_local_server``); yields its URL, or None where Prefect's own choice stands.

    Prefect reads its settings once, when it is imported: an environment variable set later
    reaches only child processes (task workers), so this process gets the URL through
    Prefect's settings context as well.

    Unless the API is a server the user configured, flow runs send no heartbeats: they let a
    long-lived server mark a run that stopped without a word as crashed, a service the local
    server does not run (and Prefect's per-process server ends with the process), and ending
    their thread held every run's end for up to 1 s.
    """
    url = use_local_server()
    if url is None and _configured_api_url():
        check_server()
        with reasons_only():
            yield None  # the user's server: its settings stand
        return
    import prefect.context
    from prefect.settings import PREFECT_API_URL, temporary_settings

    updates: dict = {"flows.heartbeat_frequency": None}
    if url is not None:
        updates[PREFECT_API_URL] = url
    with temporary_settings(updates=updates), _process_settings(
            prefect.context.get_settings_context()), reasons_only():
        try:
            yield url
        finally:
            if url is not None:
                _drain()


_process_lock = threading.Lock()
_process_holders: list[contextlib.ExitStack] = []  # the first caller's swap, one per holder


@contextlib.contextmanager
def _process_settings(settings: object) -> Iterator[None]:
    """Prefect's process-global settings replaced by ``settings`` while any ``local_api``
    block runs: threads the task runners start (the process pool's message forwarder) do not
    inherit the block's context, they read the global one, replaced the way Prefect's own
    test harness does it (a private helper: without it, nothing is replaced).

    Blocks of several threads overlap (the Python API called from threads): the first one in
    replaces the global settings, the last one out restores them, so that they end as they
    were whatever order the blocks end in (each restoring what it found left a finished
    block's settings in place for good)."""
    import prefect.context

    replace = getattr(prefect.context, "_temporary_global_settings_context", None)
    with _process_lock:
        stack = _process_holders[0] if _process_holders else contextlib.ExitStack()
        if not _process_holders and replace is not None:
            stack.enter_context(replace(settings))
        _process_holders.append(stack)
    try:
        yield
    finally:
        with _process_lock:
            _process_holders.pop()
            if not _process_holders:
                stack.close()


class _ReasonOnly(logging.Filter):
    """Drops the traceback from a run log record of an ``EmbedpipeError``: its message is the
    whole reason (bad input, another writer, a set made another way), and the caller gets the
    exception itself (the CLI prints it in one line, the Python API raises it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], EmbedpipeError):
            record.exc_info = record.exc_text = None
        return True


@contextlib.contextmanager
def reasons_only() -> Iterator[None]:
    """Within this block, Prefect's flow and task run loggers log a failed run's
    ``EmbedpipeError`` by its reason alone, without a traceback (any other error keeps it)."""
    loggers = [logging.getLogger(f"prefect.{runs}") for runs in ("flow_runs", "task_runs")]
    only = _ReasonOnly()
    for logger in loggers:
        logger.addFilter(only)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(only)


def check_server() -> None:
    """The Prefect server at ``PREFECT_API_URL`` answers (a run's or a deployment's first
    request): one line naming the URL, not the traceback of Prefect's "Failed to reach API"."""
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL

    with get_client(sync_client=True) as client:
        failure = client.api_healthcheck()
    if failure is not None:
        text = str(failure).strip()
        reason = f"{type(failure).__name__}: {text.splitlines()[0]}" if text else repr(failure)
        raise ConfigError(f"cannot reach the Prefect server at {PREFECT_API_URL.value()} "
                          f"(PREFECT_API_URL): {reason}")


def _drain() -> None:
    """Send the logs and events still queued to the server before the URL is forgotten (else
    Prefect would start a temporary server of its own to deliver them at exit)."""
    import inspect

    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.utilities.asyncutils import run_coro_as_sync

    async def drain() -> None:
        for pending in (APILogWorker.drain_all(), EventsWorker.drain_all()):
            if inspect.isawaitable(pending):
                await pending

    run_coro_as_sync(drain())


def stop_local_server(cache: Path | None = None) -> bool:
    """Stop the reused local server recorded under ``cache`` (default: this environment's cache
    dir) if one runs: a test session's end, an operator's clean-up. True if one was stopped.
    Only a process that really is this module's server is signalled."""
    record = (cache or cache_root()) / RECORD
    try:
        pid = int(json.loads(record.read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    record.unlink(missing_ok=True)
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    if b"flows.runtime" not in command:
        return False  # the pid was reused by another process
    os.kill(pid, signal.SIGTERM)
    return True


def check_scheduler() -> None:
    """A cron schedule runs only on a Prefect server that runs its scheduler: one the user
    configured (``PREFECT_API_URL``). Prefect's temporary server, and the reused local one,
    run no services, so their schedules never fire: refused in one line."""
    if not _configured_api_url():
        raise ConfigError(
            "schedule needs a Prefect server that runs its scheduler: start one (`prefect "
            "server start`, or the stack in infra/) and set PREFECT_API_URL to its API; "
            "without one no scheduled run would ever start"
        )


def _configured_api_url() -> str | None:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or None


def _identity() -> dict[str, str]:
    """What a reusable server must match: the Prefect version and its database."""
    import prefect
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    url = settings.server.database.connection_url  # a SecretStr: its str() is asterisks
    database = (hashlib.sha256(url.get_secret_value().encode()).hexdigest()[:16] if url
                else str(settings.home))
    return {"prefect": prefect.__version__, "database": database, "python": sys.executable}


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One CLI at a time checks and starts the server (a second one then reuses it)."""
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _healthy_record(record: Path) -> str | None:
    """The recorded server's API URL if it is alive, ours and answering; touches the record."""
    try:
        data = json.loads(record.read_text())
        pid, port = int(data["pid"]), int(data["port"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if data.get("identity") != _identity() or not _alive(pid):
        return None
    url = f"http://127.0.0.1:{port}/api"
    if not _healthy(url):
        return None
    os.utime(record)  # this run keeps the server from idling out
    return url


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _healthy(url: str, timeout: float = 2.0) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start(record: Path) -> str:
    """Start the server detached (its own session, so it outlives this process)."""
    from prefect.settings import get_current_settings

    port = _free_port()
    env = {
        **os.environ,
        **get_current_settings().to_environment_variables(exclude_unset=True),
        "PREFECT_UI_ENABLED": "0",
        "PREFECT__SERVER_EPHEMERAL": "1",  # no scheduler or other services
        "PREFECT__SERVER_FINAL": "1",
    }
    env.pop("PREFECT_API_URL", None)
    log = open(record.with_suffix(".log"), "ab")  # noqa: SIM115  (handed to the child)
    with log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flows.runtime", str(port), str(record)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}/api"
    _wait_until_healthy(proc, url, record.with_suffix(".log"))
    tmp = record.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": proc.pid, "port": port, "identity": _identity()}))
    tmp.replace(record)
    return url


def _wait_until_healthy(proc: subprocess.Popen, url: str, log: Path) -> None:
    """Until the started server answers; raises if it exits or stays silent too long."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _healthy(url, timeout=1.0):
        if proc.poll() is not None:
            raise PrefectServerError(
                f"the local Prefect server exited with code {proc.returncode} (log: {log})")
        if time.monotonic() > deadline:
            proc.kill()
            raise PrefectServerError(
                f"the local Prefect server did not answer within {START_TIMEOUT_S}s (log: {log})")
        time.sleep(0.1)


def _serve(port: int, record: Path, idle_s: float = IDLE_S) -> None:
    """The server process: Prefect's API app under uvicorn, until idle for ``idle_s``."""
    import uvicorn
    from prefect.server.api.server import create_app

    app = Activity(create_app(ephemeral=True))
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="on")
    )

    def watch() -> None:
        while not server.started:  # a slow start is not idle time
            time.sleep(0.5)
        serving = time.time()
        while not server.should_exit:
            time.sleep(min(30.0, idle_s / 4))
            server.should_exit = _orphaned(record, max(serving, app.last_active()), idle_s)

    threading.Thread(target=watch, daemon=True).start()
    server.run()


class Activity:
    """ASGI wrapper that tells when the API last served a request: a run that lasts hours
    talks to the server all along (task states, logs, events) and so keeps it up."""

    def __init__(self, app) -> None:
        self.app = app
        self.last = time.time()
        self.open = 0  # requests and websockets in progress

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        self.open += 1
        self.last = time.time()
        try:
            await self.app(scope, receive, send)
        finally:
            self.open -= 1
            self.last = time.time()

    def last_active(self) -> float:
        """Now while a request or websocket is open, else when the last one ended."""
        return time.time() if self.open else self.last


def _orphaned(record: Path, serving: float, idle_s: float) -> bool:
    """Idle for ``idle_s`` since ``serving`` (it began serving, or last served a request) or
    the last run touched the record, or the record is gone or names another server (then no
    run will find this one)."""
    try:
        data = json.loads(record.read_text())
        last = record.stat().st_mtime
    except (OSError, ValueError):  # gone, or not written yet by the starting CLI
        return time.time() - serving > idle_s
    if data.get("pid") != os.getpid():
        return time.time() - serving > idle_s
    return time.time() - max(serving, last) > idle_s


if __name__ == "__main__":
    _serve(int(sys.argv[1]), Path(sys.argv[2]), float(os.environ.get(IDLE_ENV, IDLE_S)))
