"""`--dtype int8` in ONNX Runtime (where the fused int8 path does not run: forced here): int8
weights, close to fp32, its own fingerprint, built once per model and cache, CPU only. The
fused oneDNN int8 path: tests/test_int8_fused.py."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import build_tiny_bert

from pipeline import int8_linear
from pipeline.config import EncoderConfig, PoolerSpec
from pipeline.embedder import Embedder
from pipeline.errors import ConfigError
from pipeline.quantize import OnnxInt8Model
from pipeline.vectors import row_cosines
from tests._int8 import TEXTS, check_int8_vectors, check_text_alone
from tests._int8 import embedder as _embedder


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """int8 through ONNX Runtime, as on a CPU without the fused int8 path; its model cache."""
    monkeypatch.setattr(int8_linear, "onednn_int8_available", lambda: False)
    monkeypatch.setenv("EMBEDPIPE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "onnx-int8"


def test_int8_runs_in_onnx_runtime_close_to_fp32(tiny_model_dir: Path, cache: Path) -> None:
    fp32, int8 = _embedder(tiny_model_dir, "fp32"), _embedder(tiny_model_dir, "int8")
    assert isinstance(int8.encoder.model, OnnxInt8Model)
    check_int8_vectors(fp32, int8, "-onnx-int8-static")
    assert len(list(cache.glob("*.onnx"))) == 1  # the int8 model, kept for the next start


@pytest.fixture(scope="module")
def tiny_mpnets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An architecture ONNX Runtime's BERT fusions leave alone, which takes no token type ids:
    with its own tokenizer's inputs, and with a tokenizer that gives token type ids anyway
    (the exported graph drops the input the model ignores)."""
    plain = build_tiny_bert(tmp_path_factory.mktemp("tiny-mpnet"), kind="mpnet")
    typed = shutil.copytree(plain, tmp_path_factory.mktemp("typed") / "mpnet")
    options = json.loads((typed / "tokenizer_config.json").read_text())
    del options["model_input_names"]  # the BERT tokenizer's own: token type ids too
    (typed / "tokenizer_config.json").write_text(json.dumps(options))
    return {"mpnet": plain, "mpnet-given-token-types": typed}


@pytest.mark.parametrize("kind", ["bert", "mpnet", "mpnet-given-token-types"])
def test_int8_vectors_depend_on_their_text_alone_not_on_batch_mates(
    kind: str, tiny_model_dir: Path, tiny_mpnets: dict[str, Path], cache: Path
) -> None:
    import onnx

    model = tiny_mpnets.get(kind, tiny_model_dir)
    fp32, int8 = _embedder(model, "fp32"), _embedder(model, "int8")
    check_int8_vectors(fp32, int8, "-onnx-int8-static")  # builds the int8 file
    [built] = cache.glob("*.onnx")
    ops = {node.op_type for node in onnx.load(str(built)).graph.node}
    assert {"QuantizeLinear", "MatMulIntegerToFloat"} <= ops  # fixed scales, one op a product
    assert not ops & {"DynamicQuantizeLinear", "MatMulInteger"}
    check_text_alone(int8)  # with per-batch scales: 7.2e-5 apart


def test_int8_model_is_reused_and_rebuilt_when_altered(tiny_model_dir: Path, cache: Path
                                                       ) -> None:
    first = _embedder(tiny_model_dir, "int8").encode(TEXTS)
    [built] = cache.glob("*.onnx")
    stamp = built.stat().st_mtime_ns
    again = _embedder(tiny_model_dir, "int8").encode(TEXTS)
    assert built.stat().st_mtime_ns == stamp  # loaded, not built again
    np.testing.assert_array_equal(first, again)
    built.write_bytes(built.read_bytes()[:-100] + bytes(100))  # altered in the cache
    rebuilt = _embedder(tiny_model_dir, "int8").encode(TEXTS)
    np.testing.assert_allclose(first, rebuilt, atol=1e-6)
    assert built.stat().st_mtime_ns != stamp


def test_int8_gives_every_layer_to_layer_poolers(tiny_model_dir: Path, cache: Path) -> None:
    spec = PoolerSpec(name="layers", strategy="mean", layers=(0, 1, -1))
    fp32, int8 = _embedder(tiny_model_dir, "fp32", spec), _embedder(tiny_model_dir, "int8", spec)
    cosine = row_cosines(fp32.encode(TEXTS), int8.encode(TEXTS))
    assert cosine.min() > 0.95
    assert len(list(cache.glob("*.onnx"))) == 1  # only the session with hidden states was built


def test_int8_refuses_the_attention_pooler(tiny_model_dir: Path, cache: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """ONNX Runtime's int8 gives no attention weights: refused, and before asking for ONNX
    Runtime to be installed (which would not help)."""
    with pytest.raises(ConfigError, match="attention pooler needs"):
        _embedder(tiny_model_dir, "int8", PoolerSpec(name="attention"))
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import fails as if not installed
    with pytest.raises(ConfigError, match="through ONNX Runtime does not give"):
        _embedder(tiny_model_dir, "int8", PoolerSpec(name="attention"))


def test_int8_without_onnxruntime_says_what_to_install(
    tiny_model_dir: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=r"embedpipe\[int8\]"):
        _embedder(tiny_model_dir, "int8")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to refuse")
def test_int8_is_refused_on_cuda(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="int8 is a CPU path"):
        Embedder(EncoderConfig(model=str(tiny_model_dir), dtype="int8", device="cuda"),
                 [PoolerSpec(name="mean")])
