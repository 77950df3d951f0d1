"""Choosing the device and the dtype: the fastest that keeps cosine >= 0.9999 to fp32.

This module knows nothing of encoders: ``choose_dtype`` is handed a function that measures a
candidate dtype on the encoder's own model (how close its vectors stay to fp32, how much
faster it runs), and caches that measurement per model, machine and torch version. A fast
bf16 matrix unit does not make every model faster: a tiny encoder's few small products cost
less than the casts around them (on an AVX512-BF16 CPU whose bf16 matrix peak is 4.5x its fp32
one, a 32-wide BERT's forward ran at 0.86x its fp32 speed in bf16, MiniLM's at 3.4x), so
``auto`` times the model, not the hardware.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from pipeline.errors import ConfigError
from pipeline.hardware import cpu_bf16_is_faster, cpu_key, cpu_profile
from pipeline.settings import cache_root, write_cache

MIN_COSINE = 0.9999
MIN_SPEEDUP = 1.1  # a half dtype must be 10% faster on the model to be worth its rounding
CHECK_VERSION = 2  # how the check times a dtype: checks cached by another way measure again
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


@dataclass(frozen=True)
class DtypeCheck:
    """A half dtype measured on one model against fp32."""

    cosine: float  # lowest cosine between its vectors and fp32's over CALIBRATION_TEXTS
    speedup: float  # fp32 forward time / its forward time on a timing batch

    def __post_init__(self) -> None:
        for value in (self.cosine, self.speedup):  # what a cache file says, too
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"a dtype check's figures are numbers, not {value!r}")

    def wins(self) -> bool:
        return self.cosine >= MIN_COSINE and self.speedup >= MIN_SPEEDUP


def check_dtype(dtype: str, device: torch.device) -> None:
    """An explicit dtype that has no path on ``device`` is refused in one line."""
    on_cuda = device.type == "cuda"
    if dtype == "fp16" and not on_cuda:
        raise ConfigError("dtype fp16 needs a CUDA device; use bf16 or fp32 on a CPU")
    if dtype == "int8" and on_cuda:
        raise ConfigError("dtype int8 is a CPU path; use bf16 or fp16 on a CUDA device")
    if dtype == "bf16" and not on_cuda and not cpu_profile()["bf16_ok"]:
        raise ConfigError("dtype bf16 does not run on this CPU; use fp32")


def choose_dtype(dtype: str, device: torch.device, check: Callable[[str], DtypeCheck],
                 model_key: str) -> str:
    """Resolve ``auto`` by hardware and ``check(candidate)``; validate explicit choices.

    ``check`` is only called for ``auto`` on hardware whose half dtype has a fast path, and
    once per ``model_key`` (the model's hash and attention kernel), machine and torch version.
    """
    check_dtype(dtype, device)
    if dtype != "auto":
        return dtype
    if device.type == "cuda":
        candidate = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    elif cpu_bf16_is_faster():
        candidate = "bf16"
    else:
        return "fp32"
    key = f"{model_key}-{candidate}-{_device_key(device)}"
    return candidate if cached_check(key, lambda: check(candidate)).wins() else "fp32"


def cached_check(key: str, measure: Callable[[], DtypeCheck]) -> DtypeCheck:
    """``measure()``, or what it gave the last time for ``key`` (cached under cache_root)."""
    path = cache_root() / f"dtype-v{CHECK_VERSION}-{key}.json"
    try:
        return DtypeCheck(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):  # absent or unreadable: measure again
        pass
    result = measure()
    write_cache(path, asdict(result))
    return result


def _device_key(device: torch.device) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return "cuda-" + "".join(c if c.isalnum() else "_" for c in name)
    return f"cpu-{cpu_key()}"
