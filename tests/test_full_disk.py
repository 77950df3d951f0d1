"""A disk that fills up mid-run: the run fails in one line, nothing half-written is visible,
and once space is back the rerun finishes with every row exactly once and the same vectors.

The disk is real: a 1 MiB tmpfs mounted for the test (root only; skipped where mounting is
not allowed), filled with a ballast file until a few parts no longer fit.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from flows.embed import embed_flow
from pipeline.errors import EmbedpipeError
from pipeline.sets import SetFolder
from tests._flowkit import job, read_set, same_vectors, text_for, write_corpus

ROWS = 120


@pytest.fixture
def small_disk(tmp_path: Path):
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path, leave: int) -> Path:
    """Write a ballast file so that only about ``leave`` bytes stay free."""
    ballast = disk / "ballast"
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    with open(ballast, "wb") as fh:
        fh.write(b"\0" * max(0, free - leave))
    return ballast


@pytest.mark.slow
def test_full_disk_then_rerun(small_disk: Path, tmp_path: Path, tiny_model_dir, prefect_api):
    ids = list(range(ROWS))
    corpus = write_corpus(tmp_path / "corpus" / "c.parquet", ids, [text_for(i) for i in ids])
    spec = job(corpus, small_disk / "out", tiny_model_dir, poolers=[{"name": "mean"}])
    reference = job(corpus, tmp_path / "ref", tiny_model_dir, poolers=[{"name": "mean"}])
    embed_flow(reference)

    ballast = fill(small_disk, leave=48 * 1024)  # room for metadata and a few parts only
    with pytest.raises((EmbedpipeError, OSError)) as failure:
        embed_flow(spec)
    message = str(failure.value)
    assert "\n" not in message and "No space left on device" in message
    out = small_disk / "out"
    done = SetFolder(str(out), "mean").read_markers()
    assert 0 < len(done) < ROWS // 20, "the disk filled up part-way through the shards"
    leftovers = [p.name for p in out.rglob(".tmp-*")]
    assert leftovers == [], f"temporary files left behind: {leftovers}"
    partial = read_set(out, "mean")
    assert set(partial) < set(ids), "only whole parts are visible"

    ballast.unlink()
    summary = embed_flow(spec)
    assert summary["rows"] == ROWS
    assert same_vectors(read_set(out, "mean"), read_set(tmp_path / "ref", "mean"))
    assert SetFolder(str(out), "mean").read_meta().rows_written == ROWS
