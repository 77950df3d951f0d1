"""What a user stores is taken at its type: ``true`` is no row count, ``"no"`` no boolean and
``inf`` no wait.

Pydantic's lax mode read ``rows_per_shard = true`` as 1 (a shard per row) and
``normalize = "no"`` as false; every config a user writes (a job's TOML, Prefect's JSON
parameters, a head's ``head.json``, the API's server and training options) now refuses
them in one line naming the field, and a number that is not finite too (JSON has none:
Prefect stored a schedule's ``lease_wait`` of inf as null, and every run failed), while the
lists that TOML and JSON give for tuples still load.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.assembly import build_job
from pipeline.config import EmbedJob, parse
from pipeline.errors import ConfigError
from pipeline.server import ServerConfig
from pipeline.training import TrainConfig


def _job_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(("toml", "field"), [
    ("rows_per_shard = true\n", "rows_per_shard"),
    ("rows_per_shard = 2.5\n", "rows_per_shard"),
    ("dedupe = 1\n", "dedupe"),
    ("[encoder]\nmax_length = true\n", "encoder.max_length"),
    ("[encoder]\ncompile = \"no\"\n", "encoder.compile"),
    ("[[poolers]]\nname = \"mean\"\nnormalize = \"no\"\n", "poolers.0.normalize"),
    ("[[poolers]]\nname = \"mean\"\nlayers = [-1, true]\n", "poolers.0.layers.1"),
    ("[[poolers]]\nname = \"mean\"\ntruncate_dim = \"16\"\n", "poolers.0.truncate_dim"),
    # JSON has no inf: a schedule's parameters would hold null, and every run fail
    ("lease_wait = inf\n", "lease_wait"),
    ("[[poolers]]\nname = \"w\"\nstrategy = \"mean\"\nlayers = [-1, -2]\n"
     "layer_combine = \"weighted\"\nlayer_weights = [1.0, nan]\n", "poolers.0.layer_weights.1"),
])
def test_a_config_value_of_another_type_is_one_line_naming_it(tmp_path: Path, toml: str,
                                                              field: str) -> None:
    with pytest.raises(ConfigError, match=f"{field}: Input should be a (valid|finite)") as err:
        build_job("corpus", str(tmp_path / "out"), config=_job_file(tmp_path, toml))
    assert "\n" not in str(err.value)


def test_lists_load_as_tuples_and_a_job_survives_prefects_json(tmp_path: Path) -> None:
    toml = ("rows_per_shard = 500\nlease_wait = 3\n[encoder]\nmax_length = 64\n"
            "[encoder.window]\nsize = 32\nstride = 16\n"
            "[[poolers]]\nname = \"mix\"\nstrategy = \"mean\"\nlayers = [-1, -2]\n"
            "layer_combine = \"weighted\"\nlayer_weights = [1, 2.5]\nnormalize = false\n")
    job = build_job("corpus", str(tmp_path / "out"), config=_job_file(tmp_path, toml),
                    poolers=["mix", "cls"])
    mix = job.poolers[0]
    assert (mix.layers, mix.layer_weights, mix.normalize) == ((-1, -2), (1.0, 2.5), False)
    assert (job.rows_per_shard, job.lease_wait, job.encoder.window.size) == (500, 3.0, 32)
    sent = json.loads(json.dumps(job.model_dump(mode="json")))  # a flow run's parameters
    assert parse(EmbedJob, sent, "embedding job") == job


def test_server_and_training_options_are_taken_at_their_type(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="max_k: Input should be a valid integer"):
        parse(ServerConfig, {"out": "o", "max_k": True}, "server options")
    with pytest.raises(ConfigError, match="trust_remote_code: Input should be a valid bool"):
        parse(ServerConfig, {"out": "o", "trust_remote_code": "no"}, "server options")
    assert parse(ServerConfig, {"out": "o", "sets": ["a", "b"]}, "server options").sets == (
        "a", "b")
    with pytest.raises(ConfigError, match="epochs: Input should be a valid integer"):
        parse(TrainConfig, {"pairs": "p", "out": "o", "kind": "attention", "epochs": True},
              "train-pooler options")
    trained = parse(TrainConfig, {"pairs": "p", "out": "o", "kind": "layer_weights",
                                  "layers": [-1, -2], "memory_budget": "1GB", "lr": 1},
                    "train-pooler options")
    assert (trained.layers, trained.memory_budget, trained.lr) == ((-1, -2), 10**9, 1.0)


@pytest.mark.parametrize("where", ["", " ", "s3://", "s3:///out", "s3:// /out",
                                   "simplecache::file:///tmp/out"])
def test_a_place_that_names_no_folder_or_bucket_is_one_line(tmp_path: Path, where: str) -> None:
    """``train-pooler PAIRS s3://`` wrote its head into ./s3:/ and ``''`` into /; ``embed C
    s3://`` ended in a traceback from the lease; a chained URL was told to name its bucket
    (``simplecache::file://BUCKET/PATH``), then refused as chained."""
    from pipeline.index import IndexRequest

    for model, given in [(EmbedJob, {"corpus": "c", "out": where}),
                         (EmbedJob, {"corpus": where, "out": "o"}),
                         (TrainConfig, {"pairs": "p", "out": where, "kind": "attention"}),
                         (TrainConfig, {"pairs": where, "out": "o", "kind": "attention"}),
                         (IndexRequest, {"out": where, "set_name": "mean"})]:
        with pytest.raises(ConfigError, match=r"is empty|names no bucket|is a chained URL, "
                                              r"which is not supported") as exc:
            parse(model, given, "job")
        assert "BUCKET" not in str(exc.value) or "::" not in where
        assert "\n" not in str(exc.value).strip()

