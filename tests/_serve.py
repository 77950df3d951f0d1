"""`embedpipe serve` in a subprocess on a free loopback port, waited for and stopped cleanly;
or an app made in the test, served by uvicorn in a thread (for tests that reach into it)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_env(**extra: str) -> dict[str, str]:
    """The environment for a CLI subprocess running this checkout's code."""
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


@contextlib.contextmanager
def serving(out: Path | str, *args: str, env: dict[str, str] | None = None):
    """Yield (base URL, process, log) of ``embedpipe serve OUT ARGS`` once /health answers 200.

    ``log()`` is what the server printed so far (stdout and stderr)."""
    port = free_port()
    code = ("import sys; from flows.cli import main; "
            f"sys.exit(main(['serve', {str(out)!r}, '--port', '{port}', *{list(args)!r}]))")
    with tempfile.TemporaryFile() as sink:
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env or cli_env(),
                                stdout=sink, stderr=subprocess.STDOUT)

        def log() -> str:
            sink.seek(0)
            return sink.read().decode(errors="replace")

        try:
            _wait_healthy(f"http://127.0.0.1:{port}", proc, log)
            yield f"http://127.0.0.1:{port}", proc, log
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def _wait_healthy(base: str, proc: subprocess.Popen, log) -> None:
    deadline = time.monotonic() + 180  # a hang guard, not a timing
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"server did not start: {log()[-2000:]}")
        time.sleep(0.5)


@contextlib.contextmanager
def serving_app(app):
    """Yield the base URL of ``app`` served by uvicorn on a free loopback port, in a thread of
    this process (its lifespan runs: start, then stop on exit)."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60  # a hang guard, not a timing
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
