"""`train-pooler` input that numpy or the head's save refused late: a negative seed, and a
HEAD_OUT that is a file (or lies under one), refused in one line before any encoding."""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flows.cli import main
from pipeline.config import EncoderConfig
from pipeline.errors import StorageError
from pipeline.training import TrainConfig, train


@pytest.fixture(scope="module")
def pairs_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    rows = [{"query": f"query {i % 40}", "text": f"text number {i} about {i % 40}"}
            for i in range(200)]
    path = tmp_path_factory.mktemp("pairs") / "pairs.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _cli(pairs: str, out: Path, model: Path, *extra: str) -> list[str]:
    return ["train-pooler", pairs, str(out), "--kind", "attention", "--model", str(model),
            "--dtype", "fp32", "--epochs", "1", *extra]


def test_a_negative_seed_is_refused_in_one_line(pairs_path: str, tiny_model_dir: Path,
                                                tmp_path: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    code = main(_cli(pairs_path, tmp_path / "h", tiny_model_dir, "--seed", "-1"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("embedpipe train-pooler: error: invalid train-pooler options: seed")
    assert not (tmp_path / "h").exists()


def test_the_config_refuses_a_negative_seed(pairs_path: str, tmp_path: Path) -> None:
    """numpy seeds are non-negative: Python callers get the refusal up front too."""
    with pytest.raises(ValueError, match="seed"):
        TrainConfig(pairs=pairs_path, out=str(tmp_path / "h"), kind="attention", seed=-3)


@pytest.mark.parametrize("under", ["", "sub"])
def test_a_head_out_that_is_a_file_is_refused_before_encoding(
        pairs_path: str, tiny_model_dir: Path, tmp_path: Path, under: str) -> None:
    blocker = tmp_path / "taken"
    blocker.write_text("not a folder")
    out = blocker / under if under else blocker
    logged: list[str] = []
    cfg = TrainConfig(pairs=pairs_path, out=str(out), kind="attention", epochs=1,
                      encoder=EncoderConfig(model=str(tiny_model_dir), dtype="fp32"))
    with pytest.raises(StorageError, match=re.escape(f"{blocker} is a file, not a folder")):
        train(cfg, log=logged.append)
    assert logged == []  # nothing was encoded or trained
    assert blocker.read_text() == "not a folder"


def test_cli_names_a_head_out_that_is_a_file(pairs_path: str, tiny_model_dir: Path,
                                             tmp_path: Path,
                                             capsys: pytest.CaptureFixture) -> None:
    blocker = tmp_path / "taken"
    blocker.write_text("")
    code = main(_cli(pairs_path, blocker, tiny_model_dir))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("embedpipe train-pooler: error: ") and str(blocker) in err[0]
    assert "is a file, not a folder" in err[0]
