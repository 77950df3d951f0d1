"""The ``embedpipe`` command's exit: every exit hook runs and the exit code stands, but the
interpreter's teardown of modules and objects (~1 s with torch and a model loaded) is skipped."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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

