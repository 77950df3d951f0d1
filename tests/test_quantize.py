"""`--dtype int8`: quantized Linear layers, close to fp32, its own fingerprint, CPU only."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.config import EncoderConfig, PoolerSpec
from pipeline.embedder import Embedder
from pipeline.errors import ConfigError
from tests._flowkit import text_for


def _embedder(model: Path, dtype: str) -> Embedder:
    return Embedder(EncoderConfig(model=str(model), dtype=dtype, device="cpu"),
                    [PoolerSpec(name="mean")])


def test_int8_quantizes_every_linear_and_stays_close_to_fp32(tiny_model_dir: Path) -> None:
    fp32, int8 = _embedder(tiny_model_dir, "fp32"), _embedder(tiny_model_dir, "int8")
    assert int8.info.dtype == "int8"
    kinds = {type(m) for m in int8.encoder.model.modules()}
    assert torch.nn.Linear not in kinds  # every float Linear swapped...
    assert torch.ao.nn.quantized.dynamic.Linear in kinds  # ...for the int8 one
    texts = [text_for(i) for i in range(40)]
    a, b = fp32.encode(texts), int8.encode(texts)
    cosine = np.sum(a * b, axis=1)  # both normalised
    assert cosine.min() > 0.95
    assert not np.allclose(a, b, atol=1e-6)  # the vectors really changed...
    assert int8.fingerprint("mean") != fp32.fingerprint("mean")  # ...so the set is another
    assert int8.info.model_hash == f"{fp32.info.model_hash}-int8"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to refuse")
def test_int8_is_refused_on_cuda(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="int8 is a CPU path"):
        Embedder(EncoderConfig(model=str(tiny_model_dir), dtype="int8", device="cuda"),
                 [PoolerSpec(name="mean")])
