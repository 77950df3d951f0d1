"""`embedpipe demo` end to end: stdlib corpus -> embed -> index -> queries, in a subprocess."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.demo_corpus import stdlib_docstrings


def test_stdlib_corpus_spreads_over_the_library() -> None:
    table = stdlib_docstrings(limit=300)
    assert table.num_rows == 300
    ids = table.column("id").to_pylist()
    assert len(set(ids)) == 300 and ids == sorted(ids)
    modules = {name.split(".")[0] for name in table.column("name").to_pylist()}
    assert len(modules) > 40, "an evenly spread sample spans many top-level modules"
    assert all(len(t) >= 40 for t in table.column("text").to_pylist())


@pytest.mark.slow
def test_demo_runs_the_whole_job(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "demo", "--out", str(tmp_path), "--rows", "120",
         "--pooler", "mean", "-k", "2"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "120 docstrings" in done.stdout
    assert done.stdout.count("query:") == 4
    assert done.stdout.count("[mean] 1.") == 4
    parts = (tmp_path / "out/sets/mean").glob("part-*.parquet")
    rows = sum(pq.read_table(p).num_rows for p in parts)
    assert rows == 120
    assert (tmp_path / "out/index/mean/_INDEX.json").exists()
