"""A BERT-family encoder's forward on a CPU with fewer, larger operations than transformers'.

transformers' BERT layer runs its three projections as three products, lets autocast cast the
same fp32 activations to bf16 before each, applies GELU as a pass of its own and hands
attention to ``scaled_dot_product_attention``, whose CPU kernel is slow for BERT's 32-wide heads
(MiniLM, 256 rows x 24 tokens: 25 GFLOP/s; 32 rows x 256 tokens: 126). On a 2-core AVX512-BF16
VM these took 47% of a bf16 forward over PyPI summaries while its products ran at ~90% of the
matrix peak. ``FusedBert`` runs the same arithmetic as:

* one [hidden, 3 x hidden] product for query, key and value (the 1/sqrt(head) scale folded into
  the query weights once), one cast of the residual stream per product;
* GELU in the product's epilogue (oneDNN's fused ``linear_pointwise``; fp32 through oneDNN only
  where ``pipeline.onednn`` measured it faster than MKL, else ``F.linear`` then ``F.gelu``);
* attention as two batched products around a softmax (the padding mask added inside the first
  product, none for a batch without padding), over blocks of rows whose score tensor stays
  within ``SCORE_BLOCK_BYTES`` (cache-sized), the softmax at a width and dtype where torch's
  kernel is fast (see ``attend``).

The residual stream, LayerNorms and returned states stay fp32, as under autocast. The weights
are transformers' own (same ``state_dict`` values; only query/key/value are concatenated), so
the model hash and the vectors' set are unchanged: fp32 states match transformers' within
float rounding (tested), bf16 ones pass the same cosine >= 0.9999 check against fp32.

Used on a CPU for ``model_type`` bert / roberta / xlm-roberta with absolute positions and GELU,
when no pooler needs attention weights (those run transformers' eager attention), and not with
``int8`` or ``--compile`` (which take the transformers model). A GPU keeps transformers' forward
and SDPA's fused kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import BaseModelOutput

FUSABLE_TYPES = frozenset({"bert", "roberta", "xlm-roberta"})
GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}  # oneDNN's algorithm
SCORE_BLOCK_BYTES = 8 << 20  # attention scores per block of rows
# torch's CPU softmax over the last dim, ns per element on an AVX512 VM: fp32 rows of < 16
# ~6 (scalar code), of >= 16 0.3-0.7; bf16 rows of < 32 2-4, 32-63 0.4-1.6, >= 64 ~0.35
MIN_KEYS = 16  # narrower attention rows get masked keys appended
BF16_SOFTMAX_KEYS = 64  # narrower bf16 rows take their softmax in fp32


def fusable(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether ``FusedBert`` computes what ``model``'s own forward does, on ``device``."""
    cfg = model.config
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and cfg.model_type in FUSABLE_TYPES and cfg.hidden_act in GELU
            and getattr(cfg, "position_embedding_type", "absolute") in (None, "absolute")
            and not cfg.is_decoder and not getattr(cfg, "add_cross_attention", False)
            and hasattr(model, "embeddings") and hasattr(model, "encoder"))


class FusedLayer(torch.nn.Module):
    """One transformer layer: fused projections, blocked attention, post-LayerNorm residuals."""

    def __init__(self, layer: torch.nn.Module, heads: int, gelu: str, onednn_fp32: bool) -> None:
        super().__init__()
        attn = layer.attention
        scale = (attn.self.query.weight.shape[0] // heads) ** -0.5
        self.qkv = _concat([(attn.self.query, scale), (attn.self.key, 1.0), (attn.self.value, 1.0)])
        self.out_proj, self.norm1 = attn.output.dense, attn.output.LayerNorm
        self.up, self.down = layer.intermediate.dense, layer.output.dense
        self.norm2 = layer.output.LayerNorm
        self.heads, self.gelu, self.onednn_fp32 = heads, gelu, onednn_fp32

    def forward(self, x: torch.Tensor, bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rows, width, _ = x.shape
        qkv = self._linear(x.to(dtype), self.qkv, dtype)
        q, k, v = qkv.view(rows, width, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        context = attend(q, k, v, bias)
        x = self.norm1(self._linear(context, self.out_proj, dtype).float() + x)
        inner = self._linear(x.to(dtype), self.up, dtype, activation=True)
        return self.norm2(self._linear(inner, self.down, dtype).float() + x)

    def _linear(self, x: torch.Tensor, layer: torch.nn.Linear, dtype: torch.dtype,
                activation: bool = False) -> torch.Tensor:
        weight, bias = layer.weight.to(dtype), layer.bias.to(dtype)  # no-ops once cast
        if dtype != torch.float32 or self.onednn_fp32:
            attr, algorithm = ("gelu", self.gelu) if activation else ("none", "")
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, attr, [], algorithm)
        out = F.linear(x, weight, bias)
        return F.gelu(out, approximate=self.gelu) if activation else out


class FusedBert(torch.nn.Module):
    """``model``'s embeddings and layers with a fused forward; called like the model itself
    (``input_ids``, ``attention_mask``, ``token_type_ids``, ``output_hidden_states``)."""

    def __init__(self, model: torch.nn.Module, onednn_fp32: bool) -> None:
        super().__init__()
        self.config = model.config
        self.embeddings = model.embeddings
        gelu = GELU[self.config.hidden_act]
        self.layers = torch.nn.ModuleList(
            FusedLayer(layer, self.config.num_attention_heads, gelu, onednn_fp32)
            for layer in model.encoder.layer)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None, output_hidden_states: bool = False,
                output_attentions: bool = False) -> BaseModelOutput:
        if output_attentions:
            raise ValueError("FusedBert computes no attention weights; use the model's own")
        dtype = (torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu")
                 else torch.float32)
        with torch.autocast("cpu", enabled=False):
            x = self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids).float()
            bias = _mask_bias(attention_mask, dtype)
            states = [x]
            for layer in self.layers:
                x = layer(x, bias, dtype)
                states.append(x)
        return BaseModelOutput(last_hidden_state=x,
                               hidden_states=tuple(states) if output_hidden_states else None)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None
           ) -> torch.Tensor:
    """softmax(q k^T + bias) v over [rows, heads, tokens, head] (q already scaled; ``bias``
    [rows, 1, 1, tokens] in q's dtype, None where no token is masked) as [rows, tokens, heads x
    head], in blocks of rows whose scores fit ``SCORE_BLOCK_BYTES``.

    The scores come out of the product rounded to q's dtype; the softmax then runs where
    torch's CPU kernel is fast for the row's width (it computes in fp32 inside either way):
    rows narrower than ``MIN_KEYS`` run scalar code, so they get masked keys appended, and bf16
    rows narrower than ``BF16_SOFTMAX_KEYS`` are faster cast to fp32 and back."""
    rows, heads, width, dim = q.shape
    keys = max(width, MIN_KEYS)
    if keys > width:
        k, v, bias = _pad_keys(k, v, bias, keys)
    upcast = q.dtype != torch.float32 and keys < BF16_SOFTMAX_KEYS
    block = max(1, SCORE_BLOCK_BYTES // (q.element_size() * heads * width * keys))
    context = torch.empty((rows, width, heads, dim), dtype=q.dtype)
    for start in range(0, rows, block):
        part = slice(start, start + block)
        n = len(range(rows)[part])
        qs = q[part].reshape(n * heads, width, dim)
        ks, vs = (t[part].reshape(n * heads, keys, dim) for t in (k, v))
        if bias is None:
            scores = torch.bmm(qs, ks.transpose(1, 2))
        else:
            full = bias[part].expand(n, heads, width, keys).reshape(n * heads, width, keys)
            scores = torch.baddbmm(full, qs, ks.transpose(1, 2))
        weights = scores.float().softmax(-1).to(q.dtype) if upcast else scores.softmax(-1)
        context[part] = torch.bmm(weights, vs).view(n, heads, width, dim).transpose(1, 2)
    return context.view(rows, width, heads * dim)


def _pad_keys(k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, keys: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k and v with zero keys appended up to ``keys``, and a bias that masks them."""
    rows, width = k.shape[0], k.shape[2]
    k, v = (F.pad(t, (0, 0, 0, keys - width)) for t in (k, v))
    padded = torch.zeros((rows, 1, 1, keys), dtype=k.dtype)
    padded[..., width:] = torch.finfo(k.dtype).min
    if bias is not None:
        padded[..., :width] = bias
    return k, v, padded


def _mask_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """[rows, 1, 1, tokens]: 0 at real tokens, the most negative ``dtype`` value at padding
    (not -inf: a row with no real token gets a uniform softmax, as in transformers, not NaNs);
    None when no token is padding (a batch of texts cut at max_length)."""
    padding = mask == 0
    if not padding.any():
        return None
    bias = torch.zeros(mask.shape, dtype=dtype).masked_fill_(padding, torch.finfo(dtype).min)
    return bias[:, None, None, :]


def _concat(scaled: list[tuple[torch.nn.Linear, float]]) -> torch.nn.Linear:
    """One Linear computing the outputs of ``scaled``'s Linears side by side, each times its
    scale."""
    first = scaled[0][0]
    fused = torch.nn.Linear(first.in_features, sum(lin.out_features for lin, _ in scaled),
                            device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([lin.weight * scale for lin, scale in scaled]))
        fused.bias.copy_(torch.cat([lin.bias * scale for lin, scale in scaled]))
    return fused.requires_grad_(False)
