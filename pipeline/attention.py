"""Attention over the fused forwards' runs of rows (``pipeline.token_layout``): the kernel
measured fastest for the CPU, dtype and width (``attention_kernel``), the padding's bias and the
widths each kernel takes (``attention_bias``, ``key_width``, ``query_width``), and the attention
pooler's weights from each row's first query (``first_query_weights``).

The kernels: SDPA's flash kernel where AMX runs, and in fp32; over rows of
``graph_attention.MIN_KEYS`` tokens or more on other AVX-512 CPUs, one fused oneDNN Graph kernel
(``pipeline.graph_attention``); else, in bf16, two batched products around a softmax (the
padding mask, built once a forward, added inside the first product; none for a batch without
padding), over blocks of rows whose score tensor stays within ``SCORE_BLOCK_BYTES``
(cache-sized), the softmax at a width and dtype where torch's kernel is fast.
"""

from __future__ import annotations

from functools import cache
from typing import Literal

import torch
import torch.nn.functional as F

from pipeline import graph_attention, hardware
from pipeline.token_layout import Layout

SCORE_BLOCK_BYTES = 8 << 20  # attention scores per block of rows
# torch's CPU softmax over the last dim, ns per element on an AVX512 VM: fp32 rows of < 16
# ~6 (scalar code), of >= 16 0.3-0.7; bf16 rows of < 32 2-4, 32-63 0.4-1.6, >= 64 ~0.35
MIN_KEYS = 16  # narrower attention rows get masked keys appended
BF16_SOFTMAX_KEYS = 64  # narrower bf16 rows take their softmax in fp32
AMX_SDPA_MIN_KEYS = 32  # where AMX runs, bf16 rows this wide take SDPA (``attention_kernel``)
AttentionKernel = Literal["sdpa", "graph", "blocked"]
UNPADDED_ALWAYS = 1 << 30  # ``unpadded_below`` where every batch runs unpadded


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
           out: torch.Tensor | None = None, kernel: AttentionKernel | None = None
           ) -> torch.Tensor:
    """softmax(q k^T + bias) v over [rows, heads, tokens, head] (q already scaled; ``bias``
    from ``attention_bias``: [rows, 1, 1, ``key_width(tokens, dtype)``] in q's dtype, or
    [rows, heads, ``query_width``, keys] with MPNet's relative position bias added, or None) as
    [rows, tokens, heads x head], written into ``out`` where given (contiguous rows,
    a view of a longer buffer), through ``kernel``, else the one ``attention_kernel`` picks."""
    rows, heads, width, dim = q.shape
    if out is None:
        out = q.new_empty((rows, width, heads * dim))
    kernel = kernel or attention_kernel(width, q.dtype)
    if kernel == "graph":
        graph_attention.graph_attention(q, k, v, bias, out)
    elif kernel == "sdpa":
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)
        out.view(rows, width, heads, dim).copy_(context.transpose(1, 2))
    else:
        _blocked_attention(q, k, v, bias, out.view(rows, width, heads, dim))
    return out


def first_weights(weights: list[torch.Tensor] | None, layout: Layout) -> torch.Tensor | None:
    """The runs' first-token attention weights (``pipeline.fused_bert.ProductLayer._attend``:
    flat, run by run, as the stream holds their tokens) as the padded batch's [rows, width]:
    zero at masked keys, as transformers' are (a row without real tokens, padded, spreads
    them evenly, as there; unpadded it holds no token and gets zeros)."""
    if weights is None:
        return None
    flat = torch.cat(weights) if weights else torch.zeros(0)
    return layout.batch(flat[:, None])[..., 0]


def first_query_weights(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor | None
                        ) -> torch.Tensor:
    """Each row's first query's attention weights over its keys, averaged over heads:
    [rows, keys] in fp32, from ``attend``'s q (scaled), k and bias ([rows, heads, tokens,
    head]; the bias's keys past k's cut): what transformers' attention probabilities give at
    query 0 (``pipeline.encoder.Encoder.forward``). One query a row: a small product beside
    the layer's."""
    scores = torch.matmul(q[:, :, :1].float(), k.float().transpose(-1, -2))
    if bias is not None:
        scores += bias[:, :, :1, : k.shape[2]].float()
    return scores.softmax(-1).mean(dim=1)[:, 0]


def _blocked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       bias: torch.Tensor | None, context: torch.Tensor) -> None:
    """``attend`` as two batched products around a softmax, in blocks of rows whose scores
    fit ``SCORE_BLOCK_BYTES``, written into ``context`` ([rows, tokens, heads, head]).

    The scores come out of the product rounded to q's dtype; the softmax then runs where
    torch's CPU kernel is fast for the row's width (it computes in fp32 inside either way):
    k and v get zero keys appended up to the bias's width (masked by it), and bf16 rows
    narrower than ``BF16_SOFTMAX_KEYS`` are faster cast to fp32 and back."""
    rows, heads, width, dim = q.shape
    keys = width if bias is None else bias.shape[-1]
    if keys > width:
        k, v = (F.pad(t, (0, 0, 0, keys - width)) for t in (k, v))
    upcast = q.dtype != torch.float32 and keys < BF16_SOFTMAX_KEYS
    block = max(1, SCORE_BLOCK_BYTES // (q.element_size() * heads * width * keys))
    for start in range(0, rows, block):
        part, n = slice(start, start + block), min(block, rows - start)
        qs = q[part].reshape(n * heads, width, dim)
        ks, vs = (t[part].reshape(n * heads, keys, dim) for t in (k, v))
        if bias is None:
            scores = torch.bmm(qs, ks.transpose(1, 2))
        else:
            full = bias[part].expand(n, heads, width, keys).reshape(n * heads, width, keys)
            scores = torch.baddbmm(full, qs, ks.transpose(1, 2))
        weights = scores.float().softmax(-1).to(q.dtype) if upcast else scores.softmax(-1)
        context[part] = torch.bmm(weights, vs).view(n, heads, width, dim).transpose(1, 2)


def attention_kernel(width: int, dtype: torch.dtype) -> AttentionKernel:
    """Which kernel ``attend`` runs over rows of ``width`` tokens in ``dtype`` here, each
    where it was measured fastest:

    * where AMX runs (``amx_here``): torch's flash attention (SDPA, no score tensor) in fp32,
      and in bf16 over rows of ``AMX_SDPA_MIN_KEYS`` tokens or more (torch packs its blocks
      for oneDNN's AMX product there); narrower bf16 rows blocked. On a 2-core AMX Xeon VM,
      MiniLM's encode, alternated rounds, best: bf16, 1,000 texts of 253 tokens 6.34 s
      against 7.29 s with the oneDNN Graph kernel; 3,000 summaries 1.50 s against 1.52 s
      blocked, but 1.78 s with SDPA over every width (rows of 20-29 tokens: 4.2-6.5 ms a
      layer against 2.9-4.1 blocked); fp32, 300 long texts 6.22 s against 6.41 s.
    * elsewhere, rows of ``graph_attention.MIN_KEYS`` tokens or more on an AVX-512 CPU:
      oneDNN Graph's fused kernel (``graph_attention.runs``), in either dtype;
    * else SDPA in fp32, blocked (``_blocked_attention``) in bf16. On an AVX512-BF16 EPYC VM
      (no AMX: torch's SDPA does not pack there), one layer's attention over [32 rows, 12
      heads, 256 tokens, 32] took 30 ms through SDPA against 41 ms blocked in fp32, but in
      bf16 16 ms blocked against 26 through SDPA."""
    if amx_here() and dtype in (torch.bfloat16, torch.float32):
        narrow = dtype == torch.bfloat16 and width < AMX_SDPA_MIN_KEYS
        return "blocked" if narrow else "sdpa"
    if graph_attention.runs(width):
        return "graph"
    return "sdpa" if dtype == torch.float32 else "blocked"


def unpadded_below(dtype: torch.dtype) -> int:
    """Batches narrower than this many tokens run unpadded
    (``pipeline.fused_bert.FusedEncoder.layout``): all but those whose attention takes oneDNN
    Graph's kernel, traced for each shape it meets (runs of rows of every length would each
    take one)."""
    if attention_kernel(graph_attention.MIN_KEYS, dtype) == "graph":
        return graph_attention.MIN_KEYS
    return UNPADDED_ALWAYS


@cache
def amx_here() -> bool:
    """Whether AMX runs here (``hardware.amx_runs``) on a CPU where ATen runs AVX-512
    kernels: where ``attention_kernel`` takes SDPA's kernel."""
    return hardware.aten_avx512() and hardware.amx_runs()


def attention_bias(mask: torch.Tensor, dtype: torch.dtype, keys: int | None = None
                   ) -> torch.Tensor | None:
    """[rows, 1, 1, keys], built once a forward: 0 at real tokens, the most negative ``dtype``
    value at padding and at the masked keys appended past the mask's width up to ``keys``
    (``key_width``'s by default: what ``attend`` takes for this width and dtype); not -inf:
    a row with no real token gets a uniform softmax, as in transformers, not NaNs. None where
    no key is masked (a batch of texts cut at max_length)."""
    keys = key_width(mask.shape[1], dtype) if keys is None else keys
    padding = masked_keys(mask, keys)
    return masked_bias(padding, dtype)[:, None, None, :] if padding.any() else None


def masked_keys(mask: torch.Tensor, keys: int) -> torch.Tensor:
    """[rows, keys], True at padding and at the keys appended past the mask's width."""
    return F.pad(mask == 0, (0, keys - mask.shape[1]), value=True)


def masked_bias(masked: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``masked`` is False, the most negative ``dtype`` value where it is True; on
    ``masked``'s device (a GPU's mask, ``pipeline.first_token_attention``)."""
    zeros = torch.zeros(masked.shape, dtype=dtype, device=masked.device)
    return zeros.masked_fill_(masked, torch.finfo(dtype).min)


def key_width(width: int, dtype: torch.dtype) -> int:
    """How many keys ``attend`` takes over rows of ``width`` tokens in ``dtype``, the keys past
    ``width`` masked: oneDNN Graph's padded width where that kernel runs
    (``graph_attention.key_width``); ``width`` for SDPA; at least ``MIN_KEYS`` for the
    blocked products (torch's softmax over fewer than 16 values per row runs scalar code)."""
    kernel = attention_kernel(width, dtype)
    if kernel == "graph":
        return graph_attention.key_width(width)
    return width if kernel == "sdpa" else max(width, MIN_KEYS)


def query_width(width: int, dtype: torch.dtype) -> int:
    """How many queries ``attend`` takes over rows of ``width`` tokens in ``dtype``: oneDNN
    Graph's kernel pads them as it pads the keys (``key_width``), the others take ``width``.
    A bias per query (MPNet's) is built for that many, once a forward."""
    return key_width(width, dtype) if attention_kernel(width, dtype) == "graph" else width
