"""Bad input gets one clear error naming the problem."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.config import EncoderConfig, PoolerSpec, WindowConfig, parse
from pipeline.embedder import Embedder
from pipeline.errors import ConfigError, ModelError
from pipeline.head_files import HeadConfig
from pipeline.models import loader
from pipeline.models.loader import read_model_files
from pipeline.poolers.heads import PoolingHead, save_head


def tiny(folder: Path, **kw) -> EncoderConfig:
    return EncoderConfig(model=str(folder), dtype="fp32", **kw)


def test_unknown_pooler_lists_known_ones(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown pooler 'median'.*known: .*attention.*cls"):
        Embedder(tiny(tiny_model_dir), [PoolerSpec(name="median")])


def test_unknown_option_is_named() -> None:
    with pytest.raises(ConfigError, match=r"poolers.0.pooling_mode: Extra inputs"):
        parse(
            __import__("pipeline.config").config.EmbedJob,
            {"corpus": "c", "out": "o", "poolers": [{"name": "m", "pooling_mode": "x"}]},
            "config",
        )


def test_layer_out_of_range(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"layer -5 is out of range .* 2 layers \(valid: -3..2\)"):
        Embedder(tiny(tiny_model_dir), [PoolerSpec(name="mean", layers=(-1, -5))])


def test_truncate_dim_above_hidden_size(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"truncate_dim 64 is above the vector size 32"):
        Embedder(tiny(tiny_model_dir), [PoolerSpec(name="mean", truncate_dim=64)])


def test_weighted_layers_need_weights() -> None:
    with pytest.raises(ConfigError, match="one layer_weights per layer"):
        parse(PoolerSpec, {"name": "w", "layers": [-1, -2], "layer_combine": "weighted"}, "pooler")


def test_window_stride_that_leaves_gaps() -> None:
    with pytest.raises(ConfigError, match="leaves gaps"):
        parse(WindowConfig, {"size": 10, "stride": 9}, "window")


def test_window_above_max_length(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="window size 200 is above max_length 128"):
        Embedder(tiny(tiny_model_dir, window=WindowConfig(size=200, stride=100)),
                 [PoolerSpec(name="mean")])


def test_missing_model_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="model folder not found: .*/nope"):
        Embedder(tiny(tmp_path / "nope"), [PoolerSpec(name="mean")])


@pytest.mark.parametrize("url", ["s3://models/minilm", "https://huggingface.co/org/model"])
def test_a_model_url_says_models_are_read_from_local_folders(url: str) -> None:
    """It said "model folder not found: s3://...", as of a local folder missing."""
    from pipeline.models.folder import resolve_model_dir

    with pytest.raises(ModelError, match=rf"model {url} is a URL: models are read from a "
                                         r"local folder"):
        resolve_model_dir(url)


def test_folder_that_is_not_a_model(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ModelError, match="is not a model folder"):
        Embedder(tiny(tmp_path), [PoolerSpec(name="mean")])


def test_name_not_in_local_cache(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelError, match="neither a folder nor in the local Hugging Face cache"):
        Embedder(EncoderConfig(model="someorg/some-model"), [PoolerSpec(name="mean")])


def test_max_length_above_positions(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"max_length 512 exceeds the 128 tokens model .* "
                                          r"reads in a row \(its 128 positions\)"):
        Embedder(tiny(tiny_model_dir, max_length=512), [PoolerSpec(name="mean")])


def _damaged_copy(tiny_model_dir: Path, target: Path, change) -> Path:
    """A copy of the tiny model whose checkpoint ``change`` edited (a dict of tensors)."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = Path(shutil.copytree(tiny_model_dir, target))
    state = load_file(folder / "model.safetensors")
    change(state)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_a_checkpoint_missing_a_weight_is_refused_not_started_at_random(
        tiny_model_dir: Path, tmp_path: Path, dtype: str) -> None:
    """transformers starts a missing weight at random: each load's vectors differed, under the
    same model hash. The base model's unused pooler may be missing."""
    def drop(state):
        del state[next(k for k in state if k.endswith("layer.1.output.dense.weight"))]

    folder = _damaged_copy(tiny_model_dir, tmp_path / "missing", drop)
    with pytest.raises(ModelError, match=r"model .*missing: the checkpoint has no weight "
                                         r"\S*layer.1.output.dense.weight \(transformers would"):
        Embedder(EncoderConfig(model=str(folder), dtype=dtype), [PoolerSpec(name="mean")])
    unpooled = _damaged_copy(tiny_model_dir, tmp_path / "unpooled", lambda state: [
        state.pop(k) for k in [k for k in state if k.startswith("pooler.")]])
    ids = torch.tensor([[101, 2023, 2003, 102]])
    states = []
    for folder in (unpooled, tiny_model_dir):
        files = read_model_files(str(folder))
        model = loader.load_transformer(files, False, False, loader.load_config(files, False))
        states.append(model(input_ids=ids).last_hidden_state)
    torch.testing.assert_close(states[0], states[1])


def test_a_checkpoint_weight_of_another_shape_is_one_line(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    def narrow(state):
        key = next(k for k in state if k.endswith("layer.0.intermediate.dense.weight"))
        state[key] = state[key][:-4].clone()

    folder = _damaged_copy(tiny_model_dir, tmp_path / "shape", narrow)
    with pytest.raises(ModelError, match=r"weight \S*layer.0.intermediate.dense.weight has shape "
                                         r"\(60, 32\) in the checkpoint but \(64, 32\) in the"):
        Embedder(tiny(folder), [PoolerSpec(name="mean")])


def test_heads_that_do_not_divide_the_hidden_size_are_refused_at_load(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """transformers refuses such a config; the fused forward, which builds no transformers
    model, failed on the first batch with a torch shape error (a shard retried, then lost)."""
    import json
    import shutil

    folder = Path(shutil.copytree(tiny_model_dir, tmp_path / "heads"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"num_attention_heads": 3}))
    with pytest.raises(ModelError, match=r"cannot load an encoder from .*heads: the hidden size "
                                         r"\(32\) is not a multiple of the number of attention "
                                         r"heads \(3\)"):
        Embedder(tiny(folder), [PoolerSpec(name="mean")])


def test_fp16_on_cpu_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="fp16 needs a CUDA device"):
        Embedder(EncoderConfig(model=str(tiny_model_dir), dtype="fp16", device="cpu"),
                 [PoolerSpec(name="mean")])


def model_hash(folder: Path) -> str:
    return read_model_files(str(folder)).model_hash()


def _head(tmp_path: Path, folder: Path, **kw) -> str:
    cfg = HeadConfig(kind="attention", num_layers=2, model_hash=model_hash(folder), **kw)
    head_dir = tmp_path / "head"
    save_head(PoolingHead(cfg), str(head_dir))
    return str(head_dir)


def test_learned_head_of_wrong_shape(tiny_model_dir: Path, tmp_path: Path) -> None:
    head = _head(tmp_path, tiny_model_dir, hidden_size=48)
    with pytest.raises(ConfigError, match="expects an encoder with hidden size 48 and 2 layers"):
        Embedder(tiny(tiny_model_dir), [PoolerSpec(name="l", strategy="learned", head=head)])


def test_learned_head_for_another_encoder(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = HeadConfig(kind="positional", hidden_size=32, num_layers=2, model_hash="0" * 16)
    save_head(PoolingHead(cfg), str(tmp_path / "h"))
    with pytest.raises(ConfigError, match="was trained for encoder 0000000000000000"):
        Embedder(tiny(tiny_model_dir),
                 [PoolerSpec(name="l", strategy="learned", head=str(tmp_path / "h"))])


def test_learned_head_weights_that_do_not_match_json(tiny_model_dir: Path, tmp_path: Path) -> None:
    head = _head(tmp_path, tiny_model_dir, hidden_size=32)
    from safetensors.torch import save_file

    save_file({"scorer.weight": torch.zeros(1, 16)}, str(Path(head) / "head.safetensors"))
    with pytest.raises(ConfigError, match="does not match its head.json"):
        Embedder(tiny(tiny_model_dir), [PoolerSpec(name="l", strategy="learned", head=head)])


def test_learned_head_runs_and_is_fingerprinted(tiny_model_dir: Path, tmp_path: Path) -> None:
    head = _head(tmp_path, tiny_model_dir, hidden_size=32, adapter=True, out_dim=16)
    emb = Embedder(tiny(tiny_model_dir), [PoolerSpec(name="l", strategy="learned", head=head)])
    assert emb.dims() == {"l": 16}
    assert emb.encode(["a learned head"]).shape == (1, 16)
    assert "head_sha256" in emb.poolers["l"].identity()
