"""ModernBERT's forward on a CPU with fewer, larger operations than transformers'.

ModernBERT (gte-modernbert-base, modernbert-embed-base) differs from BERT in its layer: the
LayerNorms come before attention and the feed-forward (none before the first layer's
attention, one more after the last layer), positions enter as rotary embeddings of query and
key (``rope_theta`` per layer type), the layers marked ``sliding_attention`` attend only to
keys within ``local_attention // 2`` tokens either way, the feed-forward is gated (its first
product ``Wi`` twice as wide: GELU of one half times the other), and its Linears and
LayerNorms may have no biases. transformers' forward runs, per layer, the rotary embedding as
eight passes in fp32 (casts, two products, a negation, a concatenation, an add), autocast's
casts of an fp32 residual stream before each product and GELU and the gate as passes of
their own: with its products packed for oneDNN, a random ModernBERT-base in bf16 spent 42% of
its forward over PyPI summaries in products, 15% in SDPA (slow over short rows), 10% in casts
and 17% in adds and multiplies (2-core AMX Xeon VM, torch profiler). Fused: 1.42x that
forward on summaries, 1.62x on texts of 374 tokens (one run; bench/RESULTS.md).

``FusedModernBert`` runs the same arithmetic as ``pipeline.fused_bert.FusedBert`` runs BERT's
(``FusedEncoder``, ``ProductLayer``: packed products, their bias, GELU or residual add in
oneDNN's epilogue, the batch's real tokens flat (``pipeline.token_layout``) over
``product_rows`` rows; ``pipeline.attention``'s kernels),
plus:

* the 1/sqrt(head) scale folded into the query rows of ``Wqkv`` once (the rotation is linear);
* the rotary embedding as one complex product in place over the query and key together in
  fp32 (``Rotary``), each head's dimensions reordered once in ``Wqkv`` so that the pairs it
  rotates sit side by side, its angles built once a forward per theta, written straight into
  the head-major layout attention reads;
* the gate's two halves as two products over one cast of their input: GELU in the first
  one's epilogue, which the second one's epilogue multiplies into its output where oneDNN
  runs it (else, and in fp32, in place after it: ``PackedLinear.binary_after``);
* a sliding layer's band of keys (and the padding, where the batch runs padded) in one bias
  per forward for each run of rows ([1, 1, queries, keys] for a run of real tokens alone, which
  its rows share; [rows, 1, queries, keys] padded; masked entries the dtype's most negative
  value: a padding query with no key in its band gets a uniform softmax, not NaNs);
* the residual stream in fp32 even where AMX runs (BERT's is bf16 there,
  ``FusedBert.residual_dtype``): a pre-norm stream adds every layer's output to itself
  unnormalised, and in bf16 a random ModernBERT-base's vectors of 50 long texts fell to cosine
  0.99973 to fp32. A bf16 product is added into it in place where no caller keeps the
  layer's input (``ProductLayer._linear``'s ``owned``).

Its weights are the model's own state dict (``weight_shapes``), read straight from
``model.safetensors`` by ``pipeline.models.loader.read_fused_weights`` where it can. Hidden
states are returned as transformers' ``output_hidden_states`` gives them: the
embeddings, each layer's output, the last one after the final LayerNorm. Not used with int8
(its kernels are BERT's layer's: such a run takes transformers' model to ONNX Runtime), nor
with rotary scaling other than the default.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from pipeline import bert_family
from pipeline.attention import attention_bias, key_width, masked_bias, masked_keys, query_width
from pipeline.fused_bert import (
    GELU,
    FusedEncoder,
    ProductLayer,
    frozen,
    layer_norm_from,
    linear_from,
    under,
)
from pipeline.token_layout import Layout, Run

if TYPE_CHECKING:
    from pipeline.models.recorded import ModelConfig

LAYER_TYPES = ("full_attention", "sliding_attention")
CHECKPOINT_PREFIX = "model"  # the base model's name inside ModernBERT's task models


def fusable(config: ModelConfig, device: torch.device) -> bool:
    """Whether ``FusedModernBert`` computes what the ModernBERT of ``config`` computes, on
    ``device`` (not for a model whose config names its own modeling code)."""
    if config.model_type != "modernbert" or device.type != "cpu":
        return False
    remote = "AutoModel" in (getattr(config, "auto_map", None) or {})
    rope = getattr(config, "rope_parameters", None) or {}
    kinds = list(getattr(config, "layer_types", None) or [])
    return (torch.backends.mkldnn.is_available() and not remote
            and config.hidden_activation in GELU
            and len(kinds) == config.num_hidden_layers and set(kinds) <= set(LAYER_TYPES)
            and all((rope.get(kind) or {}).get("rope_type") == "default" for kind in set(kinds)))


def dims(config: ModelConfig) -> bert_family.Dims:
    """ModernBERT's sizes, as the encoder reads a fused model's (``inner``: its gated first
    product's width, both halves)."""
    hidden = int(config.hidden_size)
    return bert_family.Dims(hidden, int(config.num_attention_heads),
                            int(config.num_hidden_layers), 2 * int(config.intermediate_size),
                            config.hidden_activation, float(config.norm_eps),
                            int(config.vocab_size), int(config.max_position_embeddings), 0, 0,
                            hidden)


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The weights ``FusedModernBert`` reads, as the model's own state dict names them (no
    prefix), and their shapes: biases where the config gives them."""
    d, inner = dims(config), int(config.intermediate_size)
    hidden = d.hidden

    def linear(name: str, out: int, into: int, bias: bool) -> dict[str, tuple[int, ...]]:
        return {f"{name}.weight": (out, into)} | ({f"{name}.bias": (out,)} if bias else {})

    def norm(name: str) -> dict[str, tuple[int, ...]]:
        return {f"{name}.weight": (hidden,)} | (
            {f"{name}.bias": (hidden,)} if config.norm_bias else {})

    attention, mlp = bool(config.attention_bias), bool(config.mlp_bias)
    shapes = {"embeddings.tok_embeddings.weight": (d.vocab, hidden)} | norm("embeddings.norm")
    for i in range(d.layers):
        at = f"layers.{i}."
        shapes |= (norm(f"{at}attn_norm") if i else {}) | linear(
            f"{at}attn.Wqkv", 3 * hidden, hidden, attention) | linear(
            f"{at}attn.Wo", hidden, hidden, attention) | norm(f"{at}mlp_norm") | linear(
            f"{at}mlp.Wi", 2 * inner, hidden, mlp) | linear(f"{at}mlp.Wo", hidden, inner, mlp)
    return shapes | norm("final_norm")


class Rotary(torch.nn.Module):
    """The rotary embedding of one ``theta``: transformers' ``ModernBertRotaryEmbedding``
    (default type) and ``apply_rotary_pos_emb``, rotating each head's dimension i with i +
    head / 2 by the angle of i. ``FusedModernBert`` orders each head's query and key
    dimensions as those pairs side by side (``pair_order``: attention's scores do not change
    when query and key permute their dimensions alike), so that the rotation is one complex
    product in fp32: (x1 cos - x2 sin, x2 cos + x1 sin)."""

    def __init__(self, theta: float, head: int) -> None:
        super().__init__()
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head, 2, dtype=torch.float) / head))

    def table(self, width: int) -> torch.Tensor:
        """cos + i sin of each position's angles: [width, head / 2], complex64."""
        freqs = torch.arange(width).float()[:, None] * self.inv_freq
        return torch.polar(torch.ones_like(freqs), freqs)

    @staticmethod
    def rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """``x`` ([..., width, head] in ``pair_order``, any strides: the query and the key
        stacked, [2, rows, heads, width, head]) rotated in fp32 (a copy multiplied in place),
        back in its dtype, contiguous."""
        pairs = x.to(torch.float32, memory_format=torch.contiguous_format).unflatten(-1, (-1, 2))
        torch.view_as_complex(pairs).mul_(table)
        return pairs.flatten(-2).to(x.dtype)


def pair_order(head: int) -> torch.Tensor:
    """A head's dimensions with each i (< head / 2) followed by i + head / 2."""
    half = torch.arange(head // 2)
    return torch.stack((half, half + head // 2), dim=1).flatten()


class ModernLayer(ProductLayer):
    """One ModernBERT layer: pre-LayerNorm attention with rotary query and key, then the
    pre-LayerNorm gated feed-forward, each added to the residual stream."""

    PRODUCTS = ("qkv", "out_proj", "up", "gate", "down")

    def __init__(self, config: ModelConfig, state: Mapping[str, torch.Tensor], first_layer: bool,
                 onednn_fp32: bool) -> None:
        super().__init__()
        d = dims(config)
        self.heads, self.gelu, self.onednn_fp32 = d.heads, GELU[d.activation], onednn_fp32
        self.attn_norm = None if first_layer else layer_norm_from(state, "attn_norm", d.eps)
        self.qkv, self.out_proj = _qkv(state, d), linear_from(state, "attn.Wo")
        self.mlp_norm = layer_norm_from(state, "mlp_norm", d.eps)
        self.up, self.gate = _halves(linear_from(state, "mlp.Wi"))
        self.down = linear_from(state, "mlp.Wo")

    def forward(self, x: torch.Tensor, runs: Sequence[tuple[Run, tuple]], dtype: torch.dtype,
                owned: bool = False, first: torch.Tensor | None = None,
                weights: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The layer over ``x``: [tokens, hidden], the batch's ``runs`` of rows with each one's
        attention bias and rotary table (``Rotary.table``, this layer type's), then zero rows
        up to its product rows, written in place where ``owned`` (no caller keeps it).
        ``first`` and ``weights``: as ``FusedLayer.forward``'s."""
        normed = x if self.attn_norm is None else self.attn_norm(x)
        context, x, owned = self._attention(self._linear(normed, self.qkv, dtype), runs, x,
                                            owned, first, weights)
        x = self._linear(context, self.out_proj, dtype, residual=x, owned=owned)
        normed = self.mlp_norm(x).to(dtype)  # cast once for both halves
        inner = self._linear(normed, self.up, dtype, activation=True)
        inner = self._linear(normed, self.gate, dtype, times=inner)
        return self._linear(inner, self.down, dtype, residual=x, owned=True)

    def positioned(self, heads: torch.Tensor, *positions: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Query and key rotated together by the rotary ``table`` of their width."""
        (table,) = positions
        q, k = Rotary.rotate(heads[:2], table[: heads.shape[3]])
        return q, k, heads[2]


class FusedModernBert(FusedEncoder):
    """A ModernBERT with a fused forward (``weight_shapes``)."""

    ARCHITECTURE = "ModernBERT"

    def __init__(self, config: ModelConfig, state: Mapping[str, torch.Tensor],
                 onednn_fp32: bool) -> None:
        super().__init__(config)
        self.dims = dims(config)
        self.window = int(config.local_attention) // 2
        self.kinds = list(config.layer_types)
        self.tok_embeddings = torch.nn.Embedding.from_pretrained(
            state["embeddings.tok_embeddings.weight"], freeze=True)
        self.embedding_norm = layer_norm_from(state, "embeddings.norm", self.dims.eps)
        self.layers = torch.nn.ModuleList(
            ModernLayer(config, under(state, f"layers.{i}."), i == 0, onednn_fp32)
            for i in range(self.dims.layers))
        self.final_norm = layer_norm_from(state, "final_norm", self.dims.eps)
        head = self.dims.hidden // self.dims.heads
        self.rotary = {kind: Rotary(float(config.rope_parameters[kind]["rope_theta"]), head)
                       for kind in set(self.kinds)}

    @classmethod
    def checkpoint_weights(cls, config: ModelConfig) -> tuple[dict[str, tuple[int, ...]], str]:
        return weight_shapes(config), CHECKPOINT_PREFIX

    def embed(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None,
              layout: Layout) -> torch.Tensor:
        return self.embedding_norm(self.tok_embeddings(layout.flat(input_ids)))

    def layer_inputs(self, mask: torch.Tensor, layout: Layout, dtype: torch.dtype
                     ) -> list[list[tuple]]:
        """Each layer's attention bias and rotary table for each run, by its layer type, each
        built once a forward."""
        biases = [self._attention_biases(m, dtype) for m in layout.masks(mask)]
        tables = {kind: rotary.table(mask.shape[1]) for kind, rotary in self.rotary.items()}
        return [[(run[kind], tables[kind]) for run in biases] for kind in self.kinds]

    def final(self, x: torch.Tensor) -> torch.Tensor:
        return self.final_norm(x)

    def _attention_biases(self, mask: torch.Tensor, dtype: torch.dtype
                          ) -> dict[str, torch.Tensor | None]:
        """Each layer type's attention bias, built once a forward: the padding's
        (``attention_bias``) for global layers; for sliding ones the keys outside a query's
        band masked too, [rows, 1, ``query_width``, keys] (the padding's where every key is
        within every query's band)."""
        padding = attention_bias(mask, dtype)
        width = mask.shape[1]
        if width - 1 <= self.window:
            return dict.fromkeys(LAYER_TYPES, padding)
        keys, queries = key_width(width, dtype), query_width(width, dtype)
        distance = torch.arange(keys)[None, :] - torch.arange(queries)[:, None]
        masked = masked_keys(mask, keys)[:, None, None, :] | (distance.abs() > self.window)
        return {"full_attention": padding, "sliding_attention": masked_bias(masked, dtype)}


def _qkv(state: Mapping[str, torch.Tensor], d: bert_family.Dims) -> torch.nn.Linear:
    """``Wqkv`` with the 1/sqrt(head) scale in its query rows (rotating is linear) and each
    head's query and key rows in ``pair_order``."""
    wqkv, head = linear_from(state, "attn.Wqkv"), d.hidden // d.heads
    order = torch.arange(3 * d.hidden).view(3, d.heads, head)
    order[:2] = order[:2, :, pair_order(head)]
    scale = torch.ones(3 * d.hidden)
    scale[: d.hidden] = head ** -0.5
    with torch.no_grad():
        wqkv.weight.copy_(wqkv.weight[order.flatten()] * scale[:, None])
        if wqkv.bias is not None:
            wqkv.bias.copy_(wqkv.bias[order.flatten()] * scale)
    return wqkv


def _halves(linear: torch.nn.Linear) -> tuple[torch.nn.Linear, torch.nn.Linear]:
    """A Linear's first and second halves of its outputs, each a Linear."""
    weights = linear.weight.chunk(2)
    biases = (None, None) if linear.bias is None else linear.bias.chunk(2)
    return tuple(frozen(torch.nn.Linear, w, b) for w, b in zip(weights, biases, strict=True))
