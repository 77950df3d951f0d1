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
* attention as two batched products with an fp32 softmax between them, over blocks of rows whose
  score tensor stays within ``SCORE_BLOCK_BYTES`` (cache-sized).

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
SCORE_BLOCK_BYTES = 4 << 20  # fp32 attention scores per block of rows


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
        rows, width, hidden = x.shape
        qkv = self._linear(x.to(dtype), self.qkv, dtype)
        q, k, v = qkv.view(rows, width, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        context = attend(q, k, v, bias).transpose(1, 2).reshape(rows, width, hidden)
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
            bias = torch.zeros(attention_mask.shape, dtype=torch.float32)
            # the most negative float, not -inf: a row with no real token gets a uniform
            # softmax (as in transformers), not NaNs
            low = torch.finfo(torch.float32).min
            bias = bias.masked_fill_(attention_mask == 0, low)[:, None, None, :]
            states = [x]
            for layer in self.layers:
                x = layer(x, bias, dtype)
                states.append(x)
        return BaseModelOutput(last_hidden_state=x,
                               hidden_states=tuple(states) if output_hidden_states else None)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T + bias) v over [rows, heads, tokens, head] (q already scaled), in blocks
    of rows whose fp32 scores fit ``SCORE_BLOCK_BYTES``."""
    rows, heads, width, _ = q.shape
    block = max(1, SCORE_BLOCK_BYTES // (4 * heads * width * width))
    out = []
    for start in range(0, rows, block):
        part = slice(start, start + block)
        scores = torch.matmul(q[part], k[part].transpose(-1, -2)).float().add_(bias[part])
        out.append(torch.matmul(scores.softmax(-1).to(v.dtype), v[part]))
    return out[0] if len(out) == 1 else torch.cat(out)


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
