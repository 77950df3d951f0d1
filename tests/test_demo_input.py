"""`embedpipe demo` flags that failed late (a traceback, or after the corpus was built, embedded
and indexed): each refused in one line before the corpus is written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.demo_corpus import stdlib_docstrings
from pipeline.errors import ConfigError


def _demo(*args: str, env: dict[str, str] | None = None) -> tuple[int, list[str]]:
    done = subprocess.run([sys.executable, "-m", "flows.cli", "demo", *args],
                          capture_output=True, text=True, timeout=600, env=env)
    return done.returncode, done.stderr.strip().splitlines()


@pytest.mark.parametrize(("flags", "problem"), [
    (["--rows", "-5"], "--rows must be at least 1, got -5"),
    (["--rows", "0"], "--rows must be at least 1, got 0"),
    (["-k", "0"], "-k must be an integer between 1 and 1000, got 0"),
    (["--pooler", "nosuch"], "unknown pooler 'nosuch' for set 'nosuch'"),
    (["--pooler", "mean", "--pooler", "mean"], "repeated: ['mean']"),
])
def test_bad_flags_are_refused_before_the_corpus_is_built(tmp_path: Path, flags: list[str],
                                                          problem: str) -> None:
    code, err = _demo("--out", str(tmp_path / "demo"), "--rows", "50", *flags)
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("embedpipe demo: error: ") and problem in err[0]
    assert not (tmp_path / "demo" / "corpus").exists()


def test_a_refused_demo_leaves_no_temp_folder_behind(tmp_path: Path) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    code, err = _demo("--rows", "50", "--pooler", "nosuch",
                      env=os.environ | {"TMPDIR": str(temp)})
    assert code == 1 and len(err) == 1 and "unknown pooler 'nosuch'" in err[0], err
    assert not [p.name for p in temp.iterdir() if p.name.startswith("embedpipe-demo-")]


@pytest.mark.parametrize("under", ["", "sub"])
def test_an_out_that_is_a_file_is_refused_in_one_line(tmp_path: Path, under: str) -> None:
    blocker = tmp_path / "taken"
    blocker.write_text("keep me")
    out = blocker / under if under else blocker
    code, err = _demo("--out", str(out), "--rows", "50", "--pooler", "nosuch")
    assert code == 1 and len(err) == 1, err
    assert f"{blocker} is a file, not a folder" in err[0]  # named before the pooler
    assert blocker.read_text() == "keep me"


@pytest.mark.parametrize("limit", [0, -5])
def test_the_corpus_needs_at_least_one_row(limit: int) -> None:
    with pytest.raises(ConfigError, match=f"at least 1 row, got {limit}"):
        stdlib_docstrings(limit=limit)


def test_a_demo_in_a_folder_another_demo_runs_in_leaves_its_corpus_alone(tmp_path: Path) -> None:
    """The second demo was refused by OUT's lease only after it had replaced the running
    demo's corpus, which then failed on a 'corrupt' file."""
    from pipeline.lease import WriterLease

    demo = tmp_path / "demo"
    corpus = demo / "corpus" / "stdlib.parquet"
    corpus.parent.mkdir(parents=True)
    corpus.write_bytes(b"the running demo's corpus")
    running = WriterLease(str(demo / "out"), "embed-and-index")  # as the running demo holds it
    running.acquire()
    try:
        code, err = _demo("--out", str(demo), "--rows", "50")
    finally:
        running.release()
    assert code == 1 and len(err) == 1, err
    assert "is being written by 'embed-and-index'" in err[0]
    assert corpus.read_bytes() == b"the running demo's corpus"
