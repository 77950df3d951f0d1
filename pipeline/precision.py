"""Choosing the device and the dtype: the fastest that keeps cosine >= 0.9999 to fp32."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pipeline.errors import ConfigError
from pipeline.hardware import cpu_bf16_is_faster, cpu_profile

if TYPE_CHECKING:
    from pipeline.encoder import Encoder

MIN_COSINE = 0.9999
CALIBRATION_TEXTS = [
    "A fast batch embedding pipeline for Parquet corpora.",
    "def main():\n    return 0",
    "Les modèles de langue encodent des phrases en vecteurs.",
    "Sparse retrieval, dense retrieval and hybrid search compared on 12 datasets " * 8,
    "OK",
    "Ünïcödé, emoji 🚀 and symbols ∑∫√ in one line.",
]


def choose_device(device: str) -> torch.device:
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' was asked for but no CUDA GPU is available")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def choose_dtype(dtype: str, encoder: Encoder) -> str:
    """Resolve ``auto`` by hardware and a calibration check; validate explicit choices."""
    on_cuda = encoder.device.type == "cuda"
    if dtype == "fp16" and not on_cuda:
        raise ConfigError("dtype fp16 needs a CUDA device; use bf16 or fp32 on a CPU")
    if dtype == "int8" and on_cuda:
        raise ConfigError("dtype int8 is a CPU path; use bf16 or fp16 on a CUDA device")
    if dtype == "bf16" and not on_cuda and not cpu_profile()["bf16_ok"]:
        raise ConfigError("dtype bf16 does not run on this CPU; use fp32")
    if dtype != "auto":
        return dtype
    if on_cuda:
        candidate = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    elif cpu_bf16_is_faster():
        candidate = "bf16"
    else:
        return "fp32"
    return candidate if min_cosine_to_fp32(encoder, candidate) >= MIN_COSINE else "fp32"


def min_cosine_to_fp32(encoder: Encoder, dtype: str, texts: list[str] | None = None) -> float:
    """Lowest cosine between mean-pooled vectors in ``dtype`` and in fp32 over ``texts``."""
    texts = texts or CALIBRATION_TEXTS
    pieces = [ids[: encoder.content_length] for ids in encoder.tokenize(texts)]
    ids, mask = encoder.pad(pieces)
    vectors = []
    for candidate in ("fp32", dtype):
        encoder.dtype = candidate
        hidden = encoder.forward(ids, mask, {encoder.num_layers}, False).layer(-1)
        weights = mask.to(hidden.device).unsqueeze(-1).float()
        vectors.append((hidden * weights).sum(1) / weights.sum(1))
    return float(torch.nn.functional.cosine_similarity(*vectors, dim=-1).min())
