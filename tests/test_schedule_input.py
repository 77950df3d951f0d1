"""`embedpipe schedule` input refused in one line before anything is served: what would fail
every scheduled run at its model's load (an unknown pooler, a dtype the device cannot run), a
bad --cron or --name each named as itself, and a Prefect server that does not answer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

UNREACHABLE = "http://127.0.0.1:1/api"  # port 1: nothing listens there


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "c.parquet"
    pq.write_table(pa.table({"id": list(range(20)), "text": [f"text {i}" for i in range(20)]}),
                   path)
    return path


def _schedule(corpus: Path, out: Path, model: Path, *flags: str) -> tuple[int, list[str]]:
    env = {**os.environ, "PREFECT_API_URL": UNREACHABLE}
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "schedule", str(corpus), str(out),
         "--model", str(model), *flags],
        env=env, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stderr.strip().splitlines()


@pytest.mark.parametrize(("flags", "problem"), [
    (["--pooler", "nosuch"], "unknown pooler 'nosuch' for set 'nosuch'; known: "),
    (["--dtype", "fp16", "--device", "cpu"], "dtype fp16 needs a CUDA device"),
    (["--cron", "not a cron"], "invalid schedule --cron 'not a cron': not a valid cron"),
    (["--cron", "61 2 * * *"], "invalid schedule --cron '61 2 * * *': not a valid cron"),
    (["--name", ""], "invalid deployment --name '': "),
    (["--name", "a/b"], "invalid deployment --name 'a/b': "),
    # JSON has no inf: the deployment would hold null, and every run fail
    (["--lease-wait", "inf"], "lease_wait: Input should be a finite number"),
])
def test_bad_input_is_refused_before_the_server_is_asked(
        corpus: Path, tiny_model_dir: Path, tmp_path: Path, flags: list[str],
        problem: str) -> None:
    """Each is found first: none of these reaches the (unreachable) server."""
    code, err = _schedule(corpus, tmp_path / "out", tiny_model_dir, "--cron", "0 2 * * *",
                          *flags)
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("embedpipe schedule: error: ") and problem in err[0]
    assert UNREACHABLE not in err[0]


def test_a_bad_name_is_not_blamed_on_the_cron(corpus: Path, tiny_model_dir: Path,
                                              tmp_path: Path) -> None:
    code, err = _schedule(corpus, tmp_path / "out", tiny_model_dir, "--cron", "0 2 * * *",
                          "--name", "")
    assert code == 1 and len(err) == 1 and "--cron" not in err[0], err


def test_an_unreachable_server_is_one_line_naming_its_url(corpus: Path, tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    code, err = _schedule(corpus, tmp_path / "out", tiny_model_dir, "--cron", "0 2 * * *")
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("embedpipe schedule: error: cannot reach the Prefect server at "
                             f"{UNREACHABLE}")


def test_a_head_trained_for_another_model_is_refused_before_the_server_is_asked(
        corpus: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    """Every run would refuse it at its model load (``Learned``): the schedule does first."""
    from pipeline.head_files import HeadConfig
    from pipeline.poolers.heads import PoolingHead, save_head

    head = tmp_path / "head"
    save_head(PoolingHead(HeadConfig(kind="attention", hidden_size=32, num_layers=2,
                                     model_hash="0" * 16)), str(head))
    config = tmp_path / "job.toml"
    config.write_text(f'[[poolers]]\nname = "learned"\nstrategy = "learned"\nhead = "{head}"\n')
    code, err = _schedule(corpus, tmp_path / "out", tiny_model_dir, "--cron", "0 2 * * *",
                          "--config", str(config))
    assert code == 1 and len(err) == 1, err
    assert f"pooling head {head} was trained for encoder {'0' * 16}, not for " in err[0]
    assert UNREACHABLE not in err[0]


@pytest.mark.parametrize(("flags", "problem"), [
    ([], "pooler 'pos': positional head {head} covers 16 token positions, rows here take up to "
         "128 tokens (max_length 128)"),
    (["--max-length", "16"], f"cannot reach the Prefect server at {UNREACHABLE}"),
])
def test_a_positional_head_narrower_than_the_rows_is_refused_before_the_server_is_asked(
        corpus: Path, tiny_model_dir: Path, tmp_path: Path, flags: list[str],
        problem: str) -> None:
    """Every run would refuse it at its model load (``Learned.check_row_tokens``, whose
    window sizes test_poolers_checks covers), at the model's own max_length too (nothing
    given); rows that fit reach the server."""
    from pipeline.head_files import HeadConfig
    from pipeline.models.loader import read_model_files
    from pipeline.poolers.heads import PoolingHead, save_head

    head = tmp_path / "head"
    save_head(PoolingHead(HeadConfig(
        kind="positional", hidden_size=32, num_layers=2, max_positions=16,
        model_hash=read_model_files(str(tiny_model_dir)).model_hash())), str(head))
    config = tmp_path / "job.toml"
    config.write_text(f'[[poolers]]\nname = "pos"\nstrategy = "learned"\nhead = "{head}"\n')
    code, err = _schedule(corpus, tmp_path / "out", tiny_model_dir, "--cron", "0 2 * * *",
                          "--config", str(config), *flags)
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("embedpipe schedule: error: ")
    assert problem.format(head=head) in err[0], err


@pytest.mark.parametrize("command", ["embed", "index"])
def test_a_run_on_a_server_that_does_not_answer_is_one_line_naming_it(
        corpus: Path, tiny_model_dir: Path, tmp_path: Path, command: str) -> None:
    """embed and index on a configured server gave Prefect's 117-line traceback."""
    args = ([str(corpus), str(tmp_path / "out"), "--model", str(tiny_model_dir)]
            if command == "embed" else [str(tmp_path / "out")])
    if command == "index":  # a set to index: input checks come before the server's
        from _flowkit import job, run_library

        run_library(job(corpus, tmp_path / "out", tiny_model_dir))
    env = {**os.environ, "PREFECT_API_URL": UNREACHABLE}
    done = subprocess.run([sys.executable, "-m", "flows.cli", command, *args], env=env,
                          capture_output=True, text=True, timeout=300)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(err) == 1, err
    assert err[0].startswith(f"embedpipe {command}: error: cannot reach the Prefect server at "
                             f"{UNREACHABLE} (PREFECT_API_URL): ")
