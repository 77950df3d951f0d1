"""Pooler options that could only fail later, or silently, are refused where they are read:
layer weights that make no weighted mean, a positional head narrower than the rows."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from pipeline.config import EncoderConfig, PoolerSpec, WindowConfig, parse
from pipeline.embedder import Embedder
from pipeline.errors import ConfigError
from pipeline.head_files import HeadConfig
from pipeline.poolers.heads import PoolingHead, save_head


def fp32(model: Path, **kw) -> EncoderConfig:
    return EncoderConfig(model=str(model), dtype="fp32", device="cpu", **kw)


@pytest.mark.parametrize("weights", [(0.0, 0.0), (1.0, -1.0), (2.0, -1.0), (math.nan, 1.0),
                                     (math.inf, 1.0), (1e308, 1e308)])
def test_layer_weights_that_make_no_weighted_mean_are_refused(weights: tuple) -> None:
    raw = {"name": "w", "strategy": "mean", "layers": [-1, -2], "layer_combine": "weighted",
           "layer_weights": list(weights)}
    with pytest.raises(ConfigError) as err:
        parse(PoolerSpec, raw, "pooler")
    message = str(err.value)
    assert "\n" not in message
    if not all(map(math.isfinite, weights)):  # no config number is NaN or infinite
        assert "layer_weights.0: Input should be a finite number" in message
        return
    assert f"pooler 'w': layer_weights {list(weights)} must each be >= 0" in message
    assert "weighted mean of the layers" in message


def test_a_zero_weight_leaves_its_layer_out(tiny_model_dir: Path) -> None:
    """Weights >= 0 with a positive sum are a weighted mean: (0, 1) is the second layer."""
    specs = [PoolerSpec(name="w", strategy="mean", layers=(-1, -2), layer_combine="weighted",
                        layer_weights=(0.0, 1.0)),
             PoolerSpec(name="second", strategy="mean", layers=(-2,))]
    ours = Embedder(fp32(tiny_model_dir), specs)
    texts = ["hello world", "another text"]
    got = ours.encode(texts, "w")
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ours.encode(texts, "second"), atol=1e-6)


@pytest.fixture
def positional_head(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """A positional head of 16 positions for the tiny BERT (max_length 128)."""
    model_hash = Embedder(fp32(tiny_model_dir), [PoolerSpec(name="mean")]).info.model_hash
    cfg = HeadConfig(kind="positional", hidden_size=32, num_layers=2, model_hash=model_hash,
                     max_positions=16)
    save_head(PoolingHead(cfg), str(tmp_path / "head"))
    return tmp_path / "head"


def learned(head: Path) -> PoolerSpec:
    return PoolerSpec(name="pos", strategy="learned", head=str(head))


def test_a_positional_head_narrower_than_max_length_is_refused_at_load(
        tiny_model_dir: Path, positional_head: Path) -> None:
    """Rows of up to 128 tokens on 16 positions: a text failed or not by its batch-mates."""
    with pytest.raises(ConfigError) as err:
        Embedder(fp32(tiny_model_dir), [learned(positional_head)])
    message = str(err.value)
    assert "\n" not in message
    assert (f"pooler 'pos': positional head {positional_head} covers 16 token positions, rows "
            "here take up to 128 tokens (max_length 128)") in message


def test_a_positional_head_as_wide_as_the_rows_runs_whatever_the_batch_mates(
        tiny_model_dir: Path, positional_head: Path) -> None:
    long = "a much longer text " * 20
    for encoder in (fp32(tiny_model_dir, max_length=16),
                    fp32(tiny_model_dir, window=WindowConfig(size=16, stride=8))):
        ours = Embedder(encoder, [learned(positional_head)])
        alone = ours.encode(["short text"])
        among = ours.encode(["short text", long, "x"])
        np.testing.assert_allclose(alone[0], among[0], atol=1e-6)
    with pytest.raises(ConfigError, match=r"rows here take up to 24 tokens \(window size 24\)"):
        Embedder(fp32(tiny_model_dir, window=WindowConfig(size=24, stride=8)),
                 [learned(positional_head)])


@pytest.mark.parametrize(("pooler", "problem"), [
    ('name = "tuned"\nstrategy = "learned"\nhead = "/heads/a"\nlayers = [-1, -2]',
     "pooler 'tuned': strategy 'learned' reads the layers its head was trained on (head.json); "
     "remove layers"),
    ('name = "tuned"\nstrategy = "learned"\nhead = "/heads/a"\nlayer_combine = "max"\n'
     'layer_weights = [1.0]',
     "pooler 'tuned': strategy 'learned' reads the layers its head was trained on (head.json); "
     "remove layer_combine, layer_weights"),
    ('name = "mean"\nhead = "/heads/a"',
     "pooler 'mean': strategy 'mean' does not read a head: only strategy 'learned' does; "
     "remove head"),
])
def test_a_config_option_the_strategy_never_reads_is_refused(tmp_path: Path, pooler: str,
                                                             problem: str) -> None:
    """Accepted before, such an option did nothing but enter the set's fingerprint (and a head
    named on `mean` had its files hashed into the job's key: a moved head, a new set)."""
    from pipeline.assembly import build_job

    config = tmp_path / "job.toml"
    config.write_text(f"[[poolers]]\n{pooler}\n")
    with pytest.raises(ConfigError) as err:
        build_job("c.parquet", "out", config=str(config))
    assert str(err.value) == problem


def test_the_options_a_strategy_reads_are_taken(tmp_path: Path) -> None:
    from pipeline.assembly import build_job

    config = tmp_path / "job.toml"
    config.write_text('[[poolers]]\nname = "deep"\nstrategy = "mean"\nlayers = [-1, -2]\n'
                      'layer_combine = "max"\n[[poolers]]\nname = "tuned"\n'
                      'strategy = "learned"\nhead = "/heads/a"\n')
    job = build_job("c.parquet", "out", config=str(config))
    deep, tuned = job.poolers
    assert (deep.layers, deep.layer_combine) == ((-1, -2), "max")
    assert (tuned.strategy, tuned.head) == ("learned", "/heads/a")


@pytest.mark.parametrize("layers", [(-1, 2), (0, -3), (-2, 1)])
def test_one_layer_named_twice_from_both_ends_is_refused(tiny_model_dir: Path,
                                                         layers: tuple) -> None:
    """On a 2-layer encoder -1 is 2 and -3 is 0: (-1, 2) passed the duplicate check and
    concat gave one layer twice."""
    spec = PoolerSpec(name="twice", strategy="mean", layers=layers, layer_combine="concat")
    with pytest.raises(ConfigError, match=r"pooler 'twice': layers .* name one layer twice"):
        Embedder(fp32(tiny_model_dir), [spec])
