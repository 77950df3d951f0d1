"""One writer per OUT, as users meet it: real ``embedpipe embed`` processes on one OUT.

The bug report: two embeds into one OUT at once (different ``--rows-per-shard``) both exited 0
and left a sixth of the rows. Here two are started together (local OUT and an OUT on a real S3
API server): one finishes, the other fails before any work with one line naming the holder,
and the set holds every row once with the vectors of a clean run. With ``lease_wait`` the
second waits and then finishes. A holder killed with SIGKILL mid-run is taken over once its
lease expires, and the taker runs only the shards the dead one left unfinished.

The CLI processes share one Prefect server (started once here) instead of each starting an
ephemeral one.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from _flowkit import job, run_library, text_for, write_corpus
from _prefect_stack import PREFECT, free_port, prefect_env, process, wait_healthy

from pipeline import storage
from pipeline.errors import StorageError
from pipeline.sets import SetFolder, scan_set

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[1]
ROWS = 600
TTL = "3"


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory) -> dict[str, str]:
    """Environment (over the test's own, which the S3 fixture changes) for CLI processes:
    a Prefect server of their own, a short lease TTL."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    log = home / "server.log"
    cmd = [*PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui",
           "--analytics-off", "--no-late-runs"]
    with process(cmd, prefect_env(home), log) as server:
        wait_healthy(api_url, server, log)
        prefect = {k: v for k, v in prefect_env(home, api_url).items() if k.startswith("PREFECT")}
        yield prefect | {
            "EMBEDPIPE_LEASE_TTL": TTL,
            "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path]),
            "OMP_NUM_THREADS": "1",
            "PREFECT_LOGGING_LEVEL": "WARNING",
        }


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tiny_model_dir) -> tuple[Path, dict]:
    """A corpus of ROWS rows in row groups of 10, and its vectors from a clean library run."""
    root = tmp_path_factory.mktemp("corpus")
    path = write_corpus(root / "c.parquet", list(range(ROWS)), [text_for(i) for i in range(ROWS)])
    run_library(job(path, root / "ref", tiny_model_dir, rows_per_shard=20))
    return path, rows_of(str(root / "ref"))


def rows_of(out: str) -> dict:
    """id -> vector of a set (local or s3), failing if any id is there twice."""
    frame = scan_set(out, "mean").collect()
    ids = frame["id"].to_list()
    assert len(ids) == len(set(ids)), "an id is in the set twice"
    return dict(zip(ids, frame["embedding"].to_numpy(), strict=True))


def embed(corpus: Path, out: str, model: Path, env: dict, *extra: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "flows.cli", "embed", str(corpus), out, "--model", str(model),
            "--device", "cpu", "--dtype", "fp32", *extra]
    return subprocess.Popen(args, cwd=REPO, env=os.environ | env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    stdout, stderr = proc.communicate(timeout=900)
    return proc.returncode, stdout, stderr


def held_by(out: str, procs) -> int:
    """The pid in OUT's lease once one of ``procs`` has taken it (polled every 10 ms)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        with contextlib.suppress(StorageError, ValueError):  # not there yet, or half written
            return json.loads(storage.read_bytes(storage.join(out, "_LEASE.json")))["pid"]
        dead = [p.returncode for p in procs if p.poll() is not None]
        assert not dead, f"an embed exited ({dead}) before either held {out}"
        time.sleep(0.01)
    raise AssertionError(f"no embed took {out} within 300 s")


def same_as_clean(out: str, clean: dict) -> None:
    got = rows_of(out)
    assert sorted(got) == list(range(ROWS))  # every row, exactly once
    assert all(np.allclose(got[i], clean[i], atol=1e-5, rtol=0) for i in range(ROWS))
    meta = SetFolder(out, "mean").meta()
    assert meta.rows_written == ROWS


def groups_per_shard(out: str) -> set[int]:
    return {m.end_group - m.first_group for m in SetFolder(out, "mean").read_markers().values()}


@pytest.fixture(params=["local", "s3"])
def out(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "out")
    return f"s3://{request.getfixturevalue('s3_bucket')}/out"


def test_two_embeds_started_together_one_wins_the_other_names_it(out, corpus, cli_env,
                                                                  tiny_model_dir, tmp_path):
    path, clean = corpus
    # whichever takes OUT is paused (SIGSTOP) as soon as its lease is seen, until the other has
    # exited: the loser meets a live holder however slowly its start-up runs. The holder's first
    # two shard reads fail and are retried a second later each, so it is still running when
    # paused; its long TTL keeps its lease live while paused.
    held = cli_env | {"EMBEDPIPE_FAILPOINT": f"read_shard:0:2:{tmp_path / 'fp'}",
                      "EMBEDPIPE_LEASE_TTL": "600"}
    procs = {n: embed(path, out, tiny_model_dir, held, "--rows-per-shard", str(n))
             for n in (20, 30)}
    holder = held_by(out, procs.values())
    winner = next(n for n, p in procs.items() if p.pid == holder)
    loser = next(n for n in procs if n != winner)
    os.kill(procs[winner].pid, signal.SIGSTOP)
    try:
        done = {loser: finish(procs[loser])}
    finally:
        os.kill(procs[winner].pid, signal.SIGCONT)
    done[winner] = finish(procs[winner])
    assert done[winner][0] == 0, done[winner][2][-3000:]
    assert done[loser][0] == 1, done[loser][2][-3000:]
    errors = [line for line in done[loser][2].splitlines() if "error:" in line]
    assert len(errors) == 1, done[loser][2][-3000:]
    line = errors[0]
    assert line.startswith("embedpipe embed: error: ") and f"{out} is being written by" in line
    assert "'embed' `python" in line and f"--rows-per-shard {winner}" in line  # the command
    assert f"(pid {procs[winner].pid} on {os.uname().nodename}, since 20" in line
    assert f"{ROWS} rows in 1 set(s)" in done[winner][1]
    same_as_clean(out, clean)
    assert groups_per_shard(out) == {winner // 10}  # nothing of the loser's plan was written
    lease = json.loads(storage.read_bytes(storage.join(out, "_LEASE.json")))
    assert lease["pid"] == procs[winner].pid and lease["released"] is True


def test_with_lease_wait_the_second_embed_waits_then_finishes(tmp_path, corpus, cli_env,
                                                             tiny_model_dir):
    path, clean = corpus
    out = str(tmp_path / "out")
    config = tmp_path / "wait.toml"
    config.write_text("lease_wait = 600\n")
    procs = [embed(path, out, tiny_model_dir, cli_env, "--rows-per-shard", str(n),
                   "--config", str(config)) for n in (20, 30)]
    done = [finish(p) for p in procs]
    assert [d[0] for d in done] == [0, 0], [d[2][-3000:] for d in done]
    same_as_clean(out, clean)
    assert len(groups_per_shard(out)) == 1  # the set is wholly in the plan of the last run


def test_a_holder_killed_mid_run_is_taken_over_after_expiry(tmp_path, corpus, cli_env,
                                                            tiny_model_dir):
    path, clean = corpus
    out = str(tmp_path / "out")
    kill = cli_env | {"EMBEDPIPE_FAILPOINT": f"write_marker:8:1:{tmp_path / 'fp'}:kill"}
    code, _, stderr = finish(embed(path, out, tiny_model_dir, kill, "--rows-per-shard", "20"))
    assert code == -9, stderr[-3000:]
    dead = json.loads((tmp_path / "out" / "_LEASE.json").read_text())
    assert dead["released"] is False  # SIGKILL: nothing released the lease
    finished = len(SetFolder(out, "mean").read_markers())
    assert 0 < finished < ROWS // 20
    config = tmp_path / "wait.toml"
    config.write_text("lease_wait = 120\n")
    code, stdout, stderr = finish(embed(path, out, tiny_model_dir, cli_env,
                                        "--rows-per-shard", "20", "--config", str(config)))
    assert code == 0, stderr[-3000:]
    run = re.search(r"(\d+)/(\d+) shards run", stdout)
    assert run and int(run[2]) == ROWS // 20 and int(run[1]) == ROWS // 20 - finished, stdout
    same_as_clean(out, clean)
    took = json.loads((tmp_path / "out" / "_LEASE.json").read_text())
    assert took["token"] != dead["token"] and took["released"] is True
