"""``[encoder] compile``: the transformer through ``torch.compile`` (TorchInductor), opt-in.

Inductor fuses the element-wise work between the matrix products (bias, GELU, residual adds,
autocast's casts) and, with ``freezing``, folds the weights into the graph as constants so a
CPU runs them through prepacked oneDNN kernels. The price is a compile on the first batch
(MiniLM on a 2-core AMD EPYC VM: 22-25 s into an empty kernel cache, 7-10 s once its kernels
are cached on disk under ``EMBEDPIPE_CACHE``) for 1.06-1.22x faster batches there against the
fused forward of the time; since the fused forward packs its weights once, the compiled model
is no faster than it there (fp32 0.98-1.02x, bf16 0.86-0.90x): it is for models the fused
forward does not run, and GPUs. On a 2-core AMX Xeon VM, where the products are cheap and the
element-wise passes are not, it had beaten the fused forward in bf16 over long texts (1.19x)
until that forward's residual stream went bf16 there (0.88-0.97x since; fp32 1.01-1.16x). See
``bench/compiled.py``.
Vectors match the eager model's within float rounding (cosine >= 0.99999 in fp32): the same set.

Shapes are dynamic: batches of any rows and tokens run one compiled graph, except a batch of
one row, which the compiler would specialise (recompile) for; ``Encoder.forward`` pads such a
batch to two rows.
"""

from __future__ import annotations

import os

import torch

from pipeline.settings import cache_root


def place_kernel_cache() -> None:
    """Compiled kernels under ``EMBEDPIPE_CACHE/inductor`` (not /tmp) unless the user chose a
    place. Must run before importing transformers' models: that import fixes the folder."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))


def compile_model(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` compiled for inference with dynamic shapes and frozen weights.

    Freezing is set in Inductor's process-wide config: given as ``torch.compile(options=...)``
    it did not reach the lowering (fp32 MiniLM ran 540 docs/s that way, 1,085 with it set)."""
    import torch._inductor.config as inductor

    inductor.freezing = True
    return torch.compile(model, dynamic=True)
