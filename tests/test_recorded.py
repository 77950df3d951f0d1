"""A model's tokenizer and config recorded on first load and read back without transformers
(pipeline/models/recorded.py): the same encoder, no transformers import, never stale."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _st_models import PROMPTS, Variant, save_variant

from pipeline import fused_bert
from pipeline.config import EncoderConfig, PoolerSpec
from pipeline.embedder import Embedder
from pipeline.models import loader, recorded
from tests._flowkit import text_for

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [text_for(i) for i in range(12)]


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EMBEDPIPE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "recorded"


@pytest.fixture(scope="module")
def st_model_with_prompts(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                          ) -> Path:
    """A sentence-transformers folder with lower-casing, prompts and a max_seq_length."""
    variant = Variant("prompted", "mean", normalize=True, prompts=PROMPTS,
                      default_prompt="document", max_seq_length=40)
    return save_variant(tiny_model_dir, tmp_path_factory.mktemp("st") / "prompted", variant)


def _embedder(model: Path, **kw) -> Embedder:
    return Embedder(EncoderConfig(model=str(model), dtype="fp32", device="cpu", **kw),
                    [PoolerSpec(name="mean")])


def _no_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args):
        raise AssertionError("loaded through transformers")

    monkeypatch.setattr(loader, "load_config", refuse)
    monkeypatch.setattr(loader, "load_tokenizer", refuse)


def test_a_recorded_model_loads_the_same_encoder_without_transformers(
    st_model_with_prompts: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _embedder(st_model_with_prompts)
    assert len(list(cache.glob("*.json"))) == 1
    with monkeypatch.context() as patch:
        _no_transformers(patch)
        again = _embedder(st_model_with_prompts)
    assert isinstance(again.encoder.model.config, recorded.RecordedConfig)
    for name in ("prefix", "suffix", "pad_id", "max_length", "uses_token_types",
                 "document_prompt", "query_prompt"):
        assert getattr(again.encoder, name) == getattr(first.encoder, name), name
    np.testing.assert_array_equal(again.encode(TEXTS), first.encode(TEXTS))
    np.testing.assert_array_equal(again.encode_queries(TEXTS[:3], "mean"),
                                  first.encode_queries(TEXTS[:3], "mean"))


def test_a_changed_tokenizer_file_or_an_unreadable_record_loads_through_transformers(
    tiny_model_dir: Path, tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    _embedder(model)
    [record] = cache.glob("*.json")
    config = model / "tokenizer_config.json"
    config.write_text(config.read_text() + "\n")  # same settings, another file
    with monkeypatch.context() as patch:
        _no_transformers(patch)
        with pytest.raises(AssertionError, match="through transformers"):
            _embedder(model)
    _embedder(model)  # loaded through transformers: recorded under the new key
    assert len(list(cache.glob("*.json"))) == 2
    for path in cache.glob("*.json"):
        path.write_text("{not json")
    assert _embedder(model).encoder.prefix  # read through transformers again, no error
    rewritten = [path for path in cache.glob("*.json") if path.read_text() != "{not json"]
    assert len(rewritten) == 1 and rewritten[0] != record  # the current key, recorded again
    assert json.loads(rewritten[0].read_text())["schema"] == recorded.SCHEMA


def test_a_model_trusted_to_run_its_code_is_never_recorded(tiny_model_dir: Path,
                                                           cache: Path) -> None:
    _embedder(tiny_model_dir, trust_remote_code=True)
    assert not list(cache.glob("*.json"))


def test_a_non_fused_model_gets_transformers_config_from_a_record(
    tiny_model_dir: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fused_bert, "fusable", lambda config, device: False)
    first = Embedder(EncoderConfig(model=str(tiny_model_dir), dtype="fp32", device="cpu"),
                     [PoolerSpec(name="mean")])  # transformers' model
    again = Embedder(EncoderConfig(model=str(tiny_model_dir), dtype="fp32", device="cpu"),
                     [PoolerSpec(name="mean")])
    assert not again.encoder.fused
    assert not isinstance(again.encoder.model.config, recorded.RecordedConfig)
    np.testing.assert_array_equal(again.encode(TEXTS), first.encode(TEXTS))


def test_a_recorded_fused_model_starts_without_importing_transformers(
    tiny_model_dir: Path, cache: Path
) -> None:
    code = ("import sys; from pipeline.config import EncoderConfig, PoolerSpec\n"
            "from pipeline.embedder import get_embedder\n"
            f"e = get_embedder(EncoderConfig(model={str(tiny_model_dir)!r}, dtype='fp32'), "
            "[PoolerSpec(name='mean')])\n"
            "e.encode(['a text', 'another one'])\n"
            "print(e.encoder.fused, 'transformers' in sys.modules,\n"
            "      'transformers.modeling_utils' in sys.modules)")
    env = os.environ | {"EMBEDPIPE_CACHE": str(cache.parent)}
    runs = [subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                           text=True, timeout=300, env=env) for _ in range(2)]
    for done in runs:
        assert done.returncode == 0, done.stderr[-2000:]
    # the first start records the tokenizer through transformers, yet reads the fused weights
    # without its model code; the second imports no transformers at all
    assert [done.stdout.split() for done in runs] == [["True", "True", "False"],
                                                       ["True", "False", "False"]]
