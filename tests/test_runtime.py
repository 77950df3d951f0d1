"""The CLI's reused local Prefect server: started once, reused, left alone when configured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from _http import answering

REPO = Path(__file__).resolve().parents[1]
CALL = "from flows.runtime import use_local_server; print(use_local_server())"
STOP = "from flows.runtime import stop_local_server; print(stop_local_server())"
UP = "from flows.runtime import api_is_up; print(api_is_up())"
HEARTBEAT = ("from flows.runtime import local_api\n"
             "from prefect.settings import get_current_settings as settings\n"
             "with local_api() as url: print(url, settings().flows.heartbeat_frequency)")
IDLE_S = 20  # long enough for a run to find the server again, short enough to wait out


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PREFECT_API_URL", None)
    env.update(
        PYTHONPATH=str(REPO),
        EMBEDPIPE_CACHE=str(tmp / "cache"),
        PREFECT_HOME=str(tmp / "prefect"),
        PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{tmp / 'prefect.db'}",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        **extra,
    )
    return env


def _call(env: dict[str, str], code: str = CALL) -> str:
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_cli_runs_share_one_server_a_rerun_loads_no_model_and_the_server_idles_out(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """Flows really run against the reused server (Prefect reads its settings at import, so
    an environment variable set later would not reach them); a rerun with nothing to do
    imports no torch at all; the idle server exits, a later run starts a new one, and
    ``stop_local_server`` stops it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    corpus, out = tmp_path / "c.parquet", tmp_path / "out"
    pq.write_table(pa.table({"id": list(range(30)), "text": [f"doc {i}" for i in range(30)]}),
                   corpus)
    env = _env(tmp_path, EMBEDPIPE_PREFECT_IDLE_S=str(IDLE_S))
    env.pop("EMBEDPIPE_PREFECT_SERVER", None)  # the CLI chooses the local server itself
    record = tmp_path / "cache" / "prefect-server.json"
    args = [str(corpus), str(out), "--model", str(tiny_model_dir), "--dtype", "fp32"]
    local = env | {"EMBEDPIPE_PREFECT_SERVER": "local"}  # what a Python caller opts into
    try:
        first = _call(env, f"from flows.cli import main; main(['embed', *{args!r}])")
        assert first.startswith("embedded 30 rows")
        data = json.loads(record.read_text())
        url, pid = f"http://127.0.0.1:{data['port']}/api", data["pid"]
        rerun = ("import json, sys, embedpipe; r = embedpipe.embed("
                 f"{str(corpus)!r}, {str(out)!r}, model={str(tiny_model_dir)!r}, dtype='fp32');"
                 "print(json.dumps([r['embedded'], r['shards_run'], 'torch' in sys.modules]))")
        assert json.loads(_call(local, rerun)) == [0, 0, False]
        assert _call(local) == url  # found healthy and reused: no second server
        assert _call(local, HEARTBEAT) == f"{url} None"  # no service of its reads heartbeats
        assert _call(local, UP) == "True"  # a run starts at once: no model loaded ahead
        assert json.loads(record.read_text())["pid"] == pid
        runs = httpx.post(f"{url}/flow_runs/filter", json={}, timeout=30).json()
        flows = httpx.post(f"{url}/flows/filter", json={}, timeout=30).json()
        assert len(runs) == 2 and {r["state_type"] for r in runs} == {"COMPLETED"}
        assert {f["name"] for f in flows} == {"embed"}

        deadline = time.monotonic() + 300  # a hang guard only
        while _alive(pid) and not _zombie(pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _alive(pid) or _zombie(pid), "the idle server did not exit"
        assert _call(local, UP) == "False"  # the run would wait for a server: a model to load?
        # the rerun starts a new server; with nothing to embed it still loads no model
        assert json.loads(_call(local, rerun)) == [0, 0, False]
        fresh = _call(local)  # the new server, on a new port
        assert _call(local, UP) == "True"
        second = json.loads(record.read_text())["pid"]
        assert second != pid
        assert httpx.get(f"{fresh}/health", timeout=10).status_code == 200
        assert _call(env, STOP) == "True" and not record.exists()  # stopped on request
        deadline = time.monotonic() + 60  # a hang guard only
        while _alive(second) and not _zombie(second) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(second) or _zombie(second), "the stopped server is still running"
        assert _call(env, STOP) == "False"  # nothing left to stop
    finally:
        _call(env, STOP)  # whatever the test left running


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def test_configured_api_url_ephemeral_mode_or_a_python_caller_starts_nothing(
        tmp_path: Path) -> None:
    with answering(b"true") as base:  # a configured server's /health (runs ask it first)
        _nothing_started(tmp_path, f"{base}/api")


def _nothing_started(tmp_path: Path, url: str) -> None:
    local = {"EMBEDPIPE_PREFECT_SERVER": "local"}
    configured = _env(tmp_path, PREFECT_API_URL=url, **local)
    assert _call(configured) == "None"
    assert _call(configured, UP) == "True"  # a configured API: a flow starts without waiting
    assert _call(configured, HEARTBEAT) == "None 180"  # its settings stand: Prefect's default
    # Prefect's per-process server ends with the run: no heartbeats for it either
    assert _call(_env(tmp_path, EMBEDPIPE_PREFECT_SERVER="ephemeral"), HEARTBEAT) == "None None"
    assert _call(_env(tmp_path, EMBEDPIPE_PREFECT_SERVER="ephemeral")) == "None"
    assert _call(_env(tmp_path, EMBEDPIPE_PREFECT_SERVER="ephemeral"), UP) == "False"
    env = _env(tmp_path)
    env.pop("EMBEDPIPE_PREFECT_SERVER", None)  # a Python caller: Prefect's own server
    assert _call(env) == "None"
    assert not (tmp_path / "cache" / "prefect-server.json").exists()


def test_requests_in_progress_or_recent_keep_the_server_from_idling() -> None:
    """A long run talks to the server all along; its requests, not only new runs, count."""
    import asyncio

    from flows.runtime import Activity

    started, release = asyncio.Event(), asyncio.Event()

    async def app(scope, receive, send) -> None:
        started.set()
        await release.wait()

    async def scenario() -> None:
        activity = Activity(app)
        activity.last = 0.0  # long idle before the request
        request = asyncio.ensure_future(activity({"type": "http"}, None, None))
        await started.wait()
        assert activity.open == 1 and time.time() - activity.last_active() < 1
        activity.last = 0.0
        assert time.time() - activity.last_active() < 1  # open: active now, whatever last says
        release.set()
        await request
        assert activity.open == 0 and time.time() - activity.last_active() < 5
        await activity({"type": "lifespan"}, None, None)  # not a request: changes nothing
        assert activity.open == 0

    asyncio.run(scenario())


def test_a_server_that_exits_at_start_is_named_with_its_code_and_log(tmp_path: Path) -> None:
    from flows.runtime import PrefectServerError, _free_port, _wait_until_healthy

    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    log = tmp_path / "prefect-server.log"
    with pytest.raises(PrefectServerError, match=f"exited with code 3 \\(log: {log}\\)"):
        _wait_until_healthy(proc, f"http://127.0.0.1:{_free_port()}/api", log)


def test_a_reused_server_is_pinned_to_its_own_database(tmp_path: Path) -> None:
    """The identity a reused server must match names its database (the connection URL is a
    secret whose str() is asterisks: every database looked alike)."""
    from prefect.settings import PREFECT_API_DATABASE_CONNECTION_URL, temporary_settings

    from flows.runtime import _identity

    seen = []
    for name in ("a", "b", "a"):
        url = f"sqlite+aiosqlite:///{tmp_path / name}.db"
        with temporary_settings({PREFECT_API_DATABASE_CONNECTION_URL: url}):
            seen.append(_identity()["database"])
    assert seen[0] == seen[2] != seen[1] and "*" not in seen[0]
    assert str(tmp_path) not in seen[0]  # hashed: the URL may hold a password


def test_schedule_without_a_server_that_schedules_is_refused_in_one_line(tmp_path: Path) -> None:
    """Prefect's temporary server and the reused local one run no scheduler: served on one,
    a cron deployment never starts a run. Refused before anything is registered."""
    corpus = tmp_path / "c.parquet"
    corpus.write_bytes(b"")  # never read: the check comes first
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "schedule", str(corpus), str(tmp_path / "out"),
         "--cron", "* * * * *"], env=_env(tmp_path), capture_output=True, text=True,
        timeout=120, cwd=REPO)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "schedule needs a Prefect server that runs its scheduler" in lines[0]
    assert not (tmp_path / "cache" / "prefect-server.json").exists()  # nothing started


def test_a_cache_that_is_a_file_runs_without_the_reused_server(tmp_path: Path) -> None:
    """EMBEDPIPE_CACHE naming a file (no folder for the server's record): the run goes on with
    Prefect's own temporary server, as any cache that cannot be written only costs time (a
    FileExistsError traceback before)."""
    env = _env(tmp_path, EMBEDPIPE_PREFECT_SERVER="local")
    Path(env["EMBEDPIPE_CACHE"]).write_text("a file")
    assert _call(env) == "None"


def test_a_failed_runs_embedpipe_error_is_logged_by_its_reason_alone(prefect_api) -> None:
    """Inside ``local_api`` (every flow the CLI and the Python API run) Prefect's log of a
    flow or task run that raised an EmbedpipeError is its reason without a traceback; any
    other error keeps its traceback."""
    import logging

    from prefect import flow, task

    from flows.runtime import local_api
    from pipeline.errors import FingerprintError

    @task
    def refuse() -> None:
        raise FingerprintError("set 'mean' was made with another max length")

    @flow
    def refused() -> None:
        refuse()

    @flow
    def broken() -> None:
        raise ValueError("a bug")

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    loggers = [logging.getLogger(f"prefect.{runs}") for runs in ("flow_runs", "task_runs")]
    levels = [logger.level for logger in loggers]
    try:
        for logger in loggers:
            logger.setLevel(logging.ERROR)  # the suite's quiet_prefect sets CRITICAL
            logger.addHandler(handler)
        with local_api():
            for run, error in ((refused, FingerprintError), (broken, ValueError)):
                with pytest.raises(error):
                    run()
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(level)
    logged = [(r.name, r.exc_info is not None, r.getMessage()) for r in records]
    refusals = [(name, tb) for name, tb, message in logged if "another max length" in message]
    assert ("prefect.task_runs", False) in refusals and ("prefect.flow_runs", False) in refusals
    assert [(name, tb) for name, tb, message in logged if "a bug" in message] == [
        ("prefect.flow_runs", True)], logged


def test_overlapping_local_api_blocks_leave_prefects_global_settings_as_they_were() -> None:
    """Two threads' API calls overlap, and the first ends first: each block restored the
    global settings it had found, so the second put back the first's for good (its API URL:
    a later call took embedpipe's local server for one the user configured)."""
    import prefect.context

    from flows.runtime import _process_settings

    before = prefect.context.GLOBAL_SETTINGS_CONTEXT
    settings = prefect.context.get_settings_context()
    first, second = (_process_settings(settings.model_copy()) for _ in range(2))
    first.__enter__()
    replaced = prefect.context.GLOBAL_SETTINGS_CONTEXT  # unless the suite's API block holds it
    second.__enter__()
    first.__exit__(None, None, None)  # the first block ends while the second runs
    assert prefect.context.GLOBAL_SETTINGS_CONTEXT is replaced
    second.__exit__(None, None, None)
    assert prefect.context.GLOBAL_SETTINGS_CONTEXT is before
