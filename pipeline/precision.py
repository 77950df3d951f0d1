"""Choosing the device and the dtype: the fastest that keeps cosine >= 0.9999 to fp32.

This module knows nothing of encoders: ``choose_dtype`` is handed a function that measures
how close a candidate dtype's vectors stay to fp32 (the encoder runs it on its own model).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pipeline.errors import ConfigError
from pipeline.hardware import cpu_bf16_is_faster, cpu_profile

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


def choose_dtype(dtype: str, device: torch.device, cosine_to_fp32: Callable[[str], float]) -> str:
    """Resolve ``auto`` by hardware and ``cosine_to_fp32(candidate)``; validate explicit choices.

    ``cosine_to_fp32`` is only called for ``auto`` on hardware where a half dtype is faster.
    """
    on_cuda = device.type == "cuda"
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
    return candidate if cosine_to_fp32(candidate) >= MIN_COSINE else "fp32"
