"""The ``embedpipe`` command's exit: every exit hook runs and the exit code stands, but the
interpreter's teardown of modules and objects (~1 s with torch and a model loaded) is skipped."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import atexit, sys
atexit.register(print, "teardown ran")  # before the CLI: would run after its exit hook
from flows.cli import run
atexit.register(print, "later exit hooks ran")  # like Prefect's: runs before it
sys.argv = ["embedpipe", *sys.argv[1:]]
run()
"""


def _embedpipe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_the_exit_code_and_exit_hooks_stand_and_the_teardown_is_skipped(tmp_path: Path) -> None:
    done = _embedpipe("embed", str(tmp_path / "missing.parquet"), str(tmp_path / "out"))
    assert done.returncode == 1
    missing = tmp_path / "missing.parquet"
    assert done.stderr == f"embedpipe embed: error: cannot read {missing}: not found\n"
    assert done.stdout.splitlines() == ["later exit hooks ran"]  # flushed into the pipe


def test_a_cli_that_raised_exits_the_usual_way(tmp_path: Path) -> None:
    done = _embedpipe("no-such-command")  # argparse raises SystemExit(2) inside main()
    assert done.returncode == 2
    assert done.stderr.startswith("embedpipe: error: argument COMMAND: invalid choice: "
                                  "'no-such-command' (choose from ")
    assert done.stderr.endswith(" (see embedpipe --help)\n") and done.stderr.count("\n") == 1


def test_a_bad_flag_is_one_line_too() -> None:
    """argparse printed its whole usage before the reason."""
    done = _embedpipe("backfill", "corpus", "out")
    assert done.returncode == 2
    assert done.stderr == ("embedpipe backfill: error: the following arguments are required: "
                           "--pooler (see embedpipe backfill --help)\n")
    assert done.stdout.splitlines() == ["later exit hooks ran", "teardown ran"]



@pytest.mark.slow
def test_processes_runner_workers_end_with_a_killed_run(tmp_path: Path, tiny_model_dir) -> None:
    """``kill -9`` of ``embed --runner processes``: its pool's workers waited on their task
    queue for good, each holding its model, after the rerun too."""
    import os
    import signal
    import time

    import psutil
    from _flowkit import text_for, write_corpus

    corpus = write_corpus(tmp_path / "c.parquet", list(range(400)),
                          [text_for(i) for i in range(400)])
    run = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, "embed", str(corpus), str(tmp_path / "out"), "--model",
         str(tiny_model_dir), "--runner", "processes", "--workers", "2", "--rows-per-shard",
         "10"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, workers = time.monotonic() + 90, []
    while len(workers) < 2 and time.monotonic() < deadline and run.poll() is None:
        time.sleep(0.2)
        workers = [p for p in psutil.Process(run.pid).children()
                   if "spawn_main" in " ".join(p.cmdline())]
    assert len(workers) == 2, "the pool's workers never started"
    os.kill(run.pid, signal.SIGKILL)
    run.wait()
    _, alive = psutil.wait_procs(workers, timeout=15)
    alive = [p for p in alive if _running(p)]  # a zombie has ended: no init reaps it here
    for worker in alive:
        worker.kill()
    assert not alive, f"{len(alive)} worker(s) outlived the killed run"


def _running(process) -> bool:
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
