"""A real Prefect server and workers on loopback, as child processes, for the deployment test.

Every process is started in its own session, so teardown kills its whole process group (the
server's uvicorn, a worker's flow-run processes) and nothing outlives the test.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
PREFECT = [sys.executable, "-m", "prefect"]
START_TIMEOUT_S = 180  # a hang guard only; nothing asserts on time


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prefect_env(home: Path, api_url: str | None = None) -> dict[str, str]:
    """Environment for every Prefect process of the test: its own home, SQLite, no telemetry."""
    env = dict(os.environ)
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_PROFILES_PATH=str(home / "profiles.toml"),
        PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{home / 'prefect.db'}",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_SERVER_UI_ENABLED="false",
        PREFECT_CLI_PROMPT="false",
        PREFECT_LOGGING_LEVEL="INFO",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    env.pop("PREFECT_API_KEY", None)
    if api_url:
        env["PREFECT_API_URL"] = api_url
    else:
        env.pop("PREFECT_API_URL", None)
    return env


@contextmanager
def process(args: list[str], env: dict[str, str], log: Path, cwd: Path = REPO) -> Iterator:
    """Run ``args`` in its own process group for the duration of the block."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            args, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            yield proc
        finally:
            stop(proc)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left of it."""
    if proc.poll() is None:
        with _gone():
            os.killpg(proc.pid, signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=20)
    with _gone():  # children (uvicorn, flow runs) may outlive the leader
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextmanager
def _gone() -> Iterator[None]:
    with suppress(ProcessLookupError):
        yield


def group_alive(proc: subprocess.Popen) -> bool:
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_healthy(api_url: str, proc: subprocess.Popen, log: Path) -> None:
    """Wait until the server answers /health (or fail with its log if it died)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{api_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    tail = log.read_text()[-4000:]
    raise RuntimeError(f"prefect server unhealthy after {START_TIMEOUT_S}s:\n{tail}")


def run_cli(args: list[str], env: dict[str, str], timeout: float = 300) -> str:
    """Run a ``prefect`` command to completion; its output on failure."""
    result = subprocess.run(
        [*PREFECT, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
    if result.returncode != 0:
        raise AssertionError(
            f"prefect {' '.join(args)} failed ({result.returncode}):\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    return result.stdout
