"""This machine's matrix-multiply peak in one dtype: the best of torch's kernels, measured now.

torch's CPU ``a @ b`` runs fp32 through MKL, which on some CPUs takes a narrower path than the
hardware has (a 2-core AMD EPYC VM with AVX-512: 214 GFLOP/s against 483-497 through oneDNN),
so the peak is the best of ``a @ b`` and oneDNN's inner product (``torch.ops.mkldnn.
_linear_pointwise``, what pipeline/onednn.py and Inductor use), over the plain weight and over
the weight packed once into oneDNN's layout (``PackedLinear``'s way; faster where the plain
weight is repacked on every call). Shape: an FFN's product, [rows, hidden] x [hidden, inter].
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from pipeline.onednn import packs


def matmul_peak(dtype: torch.dtype, hidden: int = 384, inter: int = 1536,
                rows: int = 4096) -> float:
    """Best GFLOP/s of a [rows, hidden] x [hidden, inter] product in ``dtype``, any kernel."""
    a = torch.randn(rows, hidden).to(dtype)
    b = torch.randn(hidden, inter).to(dtype)
    kernels: list[Callable[[], object]] = [lambda: a @ b]
    if torch.backends.mkldnn.is_available():
        w = b.t().contiguous()
        kernels.append(lambda: torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], ""))
        if packs(dtype, onednn_fp32=True):
            packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
            kernels.append(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none",
                                                                      [], ""))
    return max(_rate(kernel, 2 * rows * hidden * inter) for kernel in kernels)


def _rate(kernel: Callable[[], object], flops: int) -> float:
    with torch.inference_mode():
        kernel()
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(10):
                kernel()
            best = min(best, time.perf_counter() - start)
    return 10 * flops / best / 1e9
