"""What tells apart the encoders ``pipeline.fused_bert`` runs: BERT, RoBERTa (and XLM-RoBERTa,
CamemBERT: RoBERTa's model under other names), MPNet, DistilBERT and ELECTRA share one layer
(projections, attention, post-LayerNorm residuals, a GELU feed-forward) and differ in their
configs' and state dicts' names, in how they number positions and in MPNet's relative position
bias, each as transformers' own model has it:

* BERT numbers positions from 0 and adds token type embeddings;
* RoBERTa numbers real tokens from ``pad_token_id + 1`` (padding keeps ``pad_token_id``);
* MPNet numbers them as RoBERTa does from its fixed padding index 1, has no token types, names
  its layers' parts ``attention.attn.q`` ... ``attention.attn.o`` and ``attention.LayerNorm``,
  and adds to every layer's attention scores (after the 1/sqrt(head) scale, before the
  padding mask) one bias per head and query-key distance: ``RelativeBias``;
* DistilBERT numbers positions from 0 (a learned table, or a sinusoid stored in it), has no
  token types, keeps its layers under ``transformer.layer`` with parts of its own names
  (``attention.q_lin`` ... ``ffn.lin2``), and calls its sizes ``dim``, ``n_heads``,
  ``hidden_dim``, its activation ``activation``; its LayerNorm epsilon is fixed in its model;
* ELECTRA is BERT whose input embeddings may be narrower than its layers
  (``embedding_size``): then a Linear (``embeddings_project``) widens them after their
  LayerNorm.

``FusedBert`` reads its sizes from ``dims`` and its weights under BERT's names (``bert_names``)
whatever the checkpoint calls them (``weight_shapes``: the model's own names, read by
``pipeline.models.loader``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pipeline.models.recorded import ModelConfig

ROBERTA_TYPES = frozenset({"roberta", "xlm-roberta", "camembert"})  # transformers' RoBERTa
FUSABLE_TYPES = frozenset({"bert", "mpnet", "distilbert", "electra"}) | ROBERTA_TYPES
# transformers' models whose embeddings number positions from config.pad_token_id + 1 (MPNet:
# from MPNET_PADDING_IDX + 1): the fusable RoBERTa family and others a plain folder may hold
POSITION_PADDED_TYPES = ROBERTA_TYPES | {"data2vec-text", "ibert", "longformer",
                                         "roberta-prelayernorm", "xlm-roberta-xl", "xmod"}
CHECKPOINT_PREFIX = {kind: kind for kind in ("bert", "mpnet", "distilbert", "electra")} | {
    kind: "roberta" for kind in ROBERTA_TYPES}  # the base model's name inside task models
MPNET_PADDING_IDX = 1  # MPNetEmbeddings numbers positions from this, whatever the config says
MPNET_BUCKETS, MPNET_MAX_DISTANCE = 32, 128  # MPNetEncoder.compute_position_bias's, fixed there
DISTILBERT_EPS = 1e-12  # DistilBERT's LayerNorms', fixed in its model (no config field)
RELATIVE_BIAS = "encoder.relative_attention_bias.weight"
EMBEDDINGS_PROJECT = "embeddings_project"  # ELECTRA's, where its embeddings are narrower
_LAYERS = "encoder.layer."  # BERT's; DistilBERT's: _OWN_LAYERS
_OWN_LAYERS = {"distilbert": "transformer.layer."}
_OWN_PARTS = {  # BERT's name of a layer's part -> the model's own, where it differs
    "mpnet": {"attention.self.query": "attention.attn.q",
              "attention.self.key": "attention.attn.k",
              "attention.self.value": "attention.attn.v",
              "attention.output.dense": "attention.attn.o",
              "attention.output.LayerNorm": "attention.LayerNorm"},
    "distilbert": {"attention.self.query": "attention.q_lin",
                   "attention.self.key": "attention.k_lin",
                   "attention.self.value": "attention.v_lin",
                   "attention.output.dense": "attention.out_lin",
                   "attention.output.LayerNorm": "sa_layer_norm",
                   "intermediate.dense": "ffn.lin1", "output.dense": "ffn.lin2",
                   "output.LayerNorm": "output_layer_norm"}}


@dataclass(frozen=True)
class Dims:
    """A fusable model's sizes and constants, whatever its config calls them."""

    hidden: int
    heads: int
    layers: int
    inner: int  # the feed-forward's width
    activation: str
    eps: float  # the LayerNorms'
    vocab: int
    positions: int
    token_types: int  # 0: the model adds none (MPNet, DistilBERT)
    buckets: int  # MPNet's relative position buckets; 0 elsewhere
    embedding: int  # the input embeddings' width: ``hidden`` but in a narrower ELECTRA

    def __post_init__(self) -> None:
        """transformers' own check, which the fused forward (no transformers model) skips."""
        if self.heads <= 0 or self.hidden % self.heads:
            raise ValueError(f"the hidden size ({self.hidden}) is not a multiple of the number "
                             f"of attention heads ({self.heads})")


def dims(config: ModelConfig) -> Dims:
    """The sizes of the fusable model of ``config`` (a type in ``FUSABLE_TYPES``)."""
    if config.model_type == "distilbert":
        return Dims(int(config.dim), int(config.n_heads), int(config.n_layers),
                    int(config.hidden_dim), config.activation, DISTILBERT_EPS,
                    int(config.vocab_size), int(config.max_position_embeddings), 0, 0,
                    int(config.dim))
    mpnet, hidden = config.model_type == "mpnet", int(config.hidden_size)
    return Dims(hidden, int(config.num_attention_heads),
                int(config.num_hidden_layers), int(config.intermediate_size), config.hidden_act,
                float(config.layer_norm_eps), int(config.vocab_size),
                int(config.max_position_embeddings), 0 if mpnet else int(config.type_vocab_size),
                int(config.relative_attention_num_buckets) if mpnet else 0,
                int(config.embedding_size) if config.model_type == "electra" else hidden)


def _shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The weights ``FusedBert`` reads for ``config``'s model, under BERT's names."""
    d = dims(config)
    hidden, width = d.hidden, d.embedding
    shapes = {"embeddings.word_embeddings.weight": (d.vocab, width),
              "embeddings.position_embeddings.weight": (d.positions, width)}
    if d.buckets:
        shapes[RELATIVE_BIAS] = (d.buckets, d.heads)
    if d.token_types:
        shapes["embeddings.token_type_embeddings.weight"] = (d.token_types, width)
    shapes |= {"embeddings.LayerNorm.weight": (width,), "embeddings.LayerNorm.bias": (width,)}
    if width != hidden:
        shapes |= {f"{EMBEDDINGS_PROJECT}.weight": (hidden, width),
                   f"{EMBEDDINGS_PROJECT}.bias": (hidden,)}
    parts = {"attention.self.query": (hidden, hidden), "attention.self.key": (hidden, hidden),
             "attention.self.value": (hidden, hidden), "attention.output.dense": (hidden, hidden),
             "attention.output.LayerNorm": (hidden,), "intermediate.dense": (d.inner, hidden),
             "output.dense": (hidden, d.inner), "output.LayerNorm": (hidden,)}
    for i in range(d.layers):
        for part, shape in parts.items():
            shapes[f"{_LAYERS}{i}.{part}.weight"] = shape
            shapes[f"{_LAYERS}{i}.{part}.bias"] = shape[:1]
    return shapes


def plain(config: ModelConfig) -> bool:
    """Whether the model of ``config`` is one of the family as transformers builds it: a type
    in ``FUSABLE_TYPES``, no modeling code of its own (that code decides), absolute positions
    (no relative_key terms in its scores), an encoder (no causal mask, no cross-attention)."""
    remote = "AutoModel" in (getattr(config, "auto_map", None) or {})
    return (config.model_type in FUSABLE_TYPES and not remote
            and getattr(config, "position_embedding_type", "absolute") in (None, "absolute")
            and not getattr(config, "is_decoder", False)
            and not getattr(config, "add_cross_attention", False))


def own_name(model_type: str, name: str) -> str:
    """What the model's own state dict calls the weight BERT calls ``name``."""
    if not name.startswith(_LAYERS):
        return name
    index, rest = name.removeprefix(_LAYERS).split(".", 1)
    part, kind = rest.rsplit(".", 1)
    return f"{own_part(model_type, int(index), part)}.{kind}"


def own_part(model_type: str, index: int, part: str = "") -> str:
    """The model's own name of layer ``index``'s ``part`` (BERT's name, e.g.
    ``attention.self.query``; none: the layer itself)."""
    layer = f"{_OWN_LAYERS.get(model_type, _LAYERS)}{index}"
    return f"{layer}.{_OWN_PARTS.get(model_type, {}).get(part, part)}" if part else layer


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The weights ``FusedBert`` reads, as the model's own state dict (no prefix) names them,
    and their shapes."""
    return {own_name(config.model_type, name): shape for name, shape in _shapes(config).items()}


def bert_names(config: ModelConfig, state: Mapping[str, torch.Tensor]
               ) -> dict[str, torch.Tensor]:
    """The weights ``FusedBert`` reads from the model's own ``state`` (no prefix), under
    BERT's names."""
    return {name: state[own_name(config.model_type, name)] for name in _shapes(config)}


def position_padding(config: ModelConfig) -> int | None:
    """The padding index positions are numbered from (``pipeline.fused_bert.Embeddings``),
    or None where they are numbered from 0 (BERT)."""
    if config.model_type == "mpnet":
        return MPNET_PADDING_IDX
    return int(config.pad_token_id) if config.model_type in POSITION_PADDED_TYPES else None


class RelativeBias(torch.nn.Module):
    """MPNet's attention bias: per head, a learned value for each bucket of query-key
    distance (exact up to 8 either way, then log-spaced to 128), as
    ``MPNetEncoder.compute_position_bias`` builds it."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.table = torch.nn.Embedding.from_pretrained(weight, freeze=True)  # [buckets, heads]

    def forward(self, width: int, keys: int, dtype: torch.dtype) -> torch.Tensor:
        """[1, heads, width, keys] in ``dtype``: the bias of ``width`` queries over ``keys``
        keys (positions from 0)."""
        distance = torch.arange(keys)[None, :] - torch.arange(width)[:, None]
        return self.table(relative_bucket(distance)).permute(2, 0, 1)[None].to(dtype)


def relative_bucket(distance: torch.Tensor) -> torch.Tensor:
    """transformers' ``MPNetEncoder.relative_position_bucket`` (bidirectional, 32 buckets,
    max distance 128), the same arithmetic."""
    half = MPNET_BUCKETS // 2
    n = -distance
    bucket = (n < 0).to(torch.long) * half
    n = torch.abs(n)
    exact = half // 2
    large = exact + (torch.log(n.float() / exact) / math.log(MPNET_MAX_DISTANCE / exact)
                     * (half - exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, half - 1))
    return bucket + torch.where(n < exact, n, large)
