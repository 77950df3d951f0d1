"""Attention over wide rows as one oneDNN Graph partition (TorchScript's oneDNN fuser), on a CPU.

torch's kernels run softmax(q k^T + bias) v in passes over the whole batch: a batched product
writes every head's [tokens x keys] scores, a softmax reads and writes them again, a second
product reads them once more; SDPA's CPU flash kernel (fp32) avoids the score tensor but runs
BERT's 32-wide heads slowly. oneDNN's Graph API fuses the pattern into one kernel that takes a
row's head at a time through a product with the bias added in its epilogue, oneDNN's own
softmax and the second product, all within the core's cache. torch reaches it only through
TorchScript: ``torch.jit.trace`` records the pattern and, with ``torch.jit.enable_onednn_fusion``
on, the graph executor hands it to oneDNN as one partition when it first runs a new input shape.

Measured on a 2-core AMD EPYC VM (AVX512-BF16), one layer's attention over 8,192 tokens, 12
heads of 32 (ms, torch's kernels as ``attend`` runs them, then this kernel): bf16 keys 96: 10.3
/ 9.1, 128: 13.3 / 9.2, 256: 19.4 / 11.8, 512: 28.0 / 19.9, but keys 32: 6.2 / 11.7; fp32
(SDPA's kernel) 128: 14.6 / 10.2, 256: 24.0 / 14.8; with oneDNN's and ATen's kernels capped to
AVX2, fp32 128: 15.2 / 15.4, 256: 25.7 / 24.6, 512: 57.0 / 44.8. In MiniLM's forward over long
texts (truncated at 256 tokens): 1.09x faster in bf16 (1,000 texts), 1.08x in fp32 (400), but
0.98x capped to AVX2 (300); over 1,500 texts of 96-127 tokens (keys padded to 128), four
alternated rounds: bf16 5.56 -> 5.22 s (median), fp32 8.68 -> 8.51 s. Hence ``MIN_KEYS``, and
this way only where ATen runs AVX-512 kernels (``runs``).

Shapes: the executor specialises a traced function on the input shapes it meets and, past a
dozen of them, runs the unfused graph op by op (five times slower here). So each input
signature (dtype, shape, strides) gets a function of its own, traced once (~5-10 ms; its first
two calls, profiled then compiled, ~30 ms more), and the signatures stay few: rows go through
in blocks of ``ROW_BLOCK`` (no slower than one call: 11.4-11.5 ms for 32 rows of 256 in blocks
of 4 to 32), keys are padded up to a multiple of ``KEY_STEP`` (``key_width``; masked by the
bias).

The fuser's switch is process-wide: it is turned on only around these calls, so a caller's own
TorchScript models keep the executor they had. Where TorchScript or its oneDNN fuser is missing
(``available``), ``pipeline.attention.attend`` keeps its own way.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import cache, lru_cache

import torch
import torch.nn.functional as F

from pipeline import hardware

MIN_KEYS = 96  # narrower attention rows stay on torch's kernels (see above)
KEY_STEP = 32  # keys padded up to a multiple of this: fewer shapes, each compiled once
ROW_BLOCK = 8  # rows per call
WARM_CALLS = 2  # calls the executor profiles, then compiles, before it runs the fused kernel


def available() -> bool:
    """Whether this torch can fuse attention through oneDNN Graph (a CPU build with oneDNN
    and TorchScript's oneDNN fuser)."""
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.jit, "enable_onednn_fusion")
            and hasattr(torch.jit, "onednn_fusion_enabled"))


def runs(width: int) -> bool:
    """Whether ``pipeline.attention.attend`` hands attention over rows of ``width`` tokens
    to ``graph_attention`` here: rows of at least ``MIN_KEYS``, on a CPU where ATen runs
    AVX-512 kernels, where it was measured faster (where AMX runs SDPA's kernel was faster
    still: ``pipeline.attention.attention_kernel``)."""
    return width >= MIN_KEYS and _faster_here()


@cache
def _faster_here() -> bool:
    return available() and hardware.aten_avx512()


def key_width(width: int) -> int:
    """The keys this kernel takes over rows of ``width`` tokens: ``width`` padded up to a
    multiple of ``KEY_STEP`` (the padding masked by the bias)."""
    return -(-width // KEY_STEP) * KEY_STEP


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor
               ) -> torch.Tensor:
    return torch.matmul((torch.matmul(q, k.transpose(-1, -2)) + bias).softmax(-1), v)


@lru_cache(maxsize=512)
def _traced(signature: tuple[tuple[torch.dtype, torch.Size, tuple[int, ...]], ...]
            ) -> Callable[..., torch.Tensor]:
    """``_attention`` traced for inputs of one ``signature`` (dtype, shape and strides of q,
    k, v and bias): the executor's one specialisation is then the shape it runs."""
    examples = [torch.empty_strided(shape, strides, dtype=dtype).zero_()
                for dtype, shape, strides in signature]
    with warnings.catch_warnings():  # TorchScript is deprecated; its oneDNN fuser has no heir
        warnings.filterwarnings("ignore", message=".*torch.jit.trace.* is deprecated")
        traced = torch.jit.trace(_attention, tuple(examples), check_trace=False)
    for _ in range(WARM_CALLS):  # the executor's first calls run unfused: another last bit
        traced(*examples)
    return traced


def graph_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    bias: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T + bias) v over [rows, heads, tokens, head] (q already scaled) as [rows,
    tokens, heads x head], written into ``out`` where given, through oneDNN Graph's fused
    kernel. ``bias``: [rows, 1, 1, ``key_width(tokens)``] in q's dtype, 0 or the dtype's most
    negative value (its padded keys masked; ``pipeline.attention.attention_bias`` builds it
    once a forward), or [rows, heads, keys, keys] with MPNet's relative position bias added
    (the queries padded as the keys are), or None where no key is masked."""
    rows, heads, width, dim = q.shape
    keys = key_width(width)
    if bias is None:
        bias = torch.zeros((rows, 1, 1, keys), dtype=q.dtype)
    if bias.shape[-1] != keys or bias.shape[-2] not in (1, keys):
        raise ValueError(f"a bias over {tuple(bias.shape[-2:])} queries x keys for rows of "
                         f"{width} tokens: this kernel takes {keys} keys and 1 or {keys} "
                         "queries (key_width)")
    if keys > width:
        q, k, v = (F.pad(t, (0, 0, 0, keys - width)) for t in (q, k, v))
    if out is None:
        out = q.new_empty((rows, width, heads * dim))
    context = out.view(rows, width, heads, dim)
    enabled = torch.jit.onednn_fusion_enabled()
    torch.jit.enable_onednn_fusion(True)
    try:
        for start in range(0, rows, ROW_BLOCK):
            part = slice(start, start + ROW_BLOCK)
            inputs = (q[part], k[part], v[part], bias[part])
            block = _traced(tuple((t.dtype, t.shape, t.stride()) for t in inputs))(*inputs)
            context[part] = block[:, :, :width].transpose(1, 2)
    finally:
        torch.jit.enable_onednn_fusion(enabled)
    return out
