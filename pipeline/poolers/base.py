"""The pooler extension point: subclass ``Pooler``, fill in ``pool``, register a name.

    @register("mean")
    class Mean(Pooler):
        def pool(self, hidden, mask, states):
            ...

``hidden`` is already the configured combination of layers ([batch, tokens, width]);
``mask`` is True on real tokens. Options shared by every pooler (layers, layer_combine,
normalize, truncate_dim, window_agg, model_head) are applied around ``pool`` by this class
and the embedder, so a pooler only says how tokens become one vector.

Poolers read token states: for a sentence-transformers model, before its Dense and
Normalize modules. ``model_head = true`` applies those modules after ``pool``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from pipeline.config import PoolerSpec
from pipeline.encoder import EncoderInfo, TokenStates, resolve_layer
from pipeline.errors import ConfigError
from pipeline.models.head import ModelHead, ModelParts

REGISTRY: dict[str, type[Pooler]] = {}


def register(name: str):
    """Class decorator: make a Pooler available as ``strategy = name``."""

    def decorate(cls: type[Pooler]) -> type[Pooler]:
        if name in REGISTRY:
            raise ValueError(f"pooler {name!r} is registered twice")
        REGISTRY[name] = cls
        cls.strategy = name
        return cls

    return decorate


class Pooler(ABC):
    """Turns one forward pass into one vector per row."""

    strategy: ClassVar[str] = ""
    needs_attention: ClassVar[bool] = False

    def __init__(self, spec: PoolerSpec, info: EncoderInfo,
                 parts: ModelParts | None = None) -> None:
        self.spec = spec
        self.info = info
        self.parts = parts
        self.layers = tuple(resolve_layer(i, info.num_layers) for i in self.layer_indices())
        if len(set(self.layers)) != len(self.layers):
            raise ConfigError(
                f"pooler {spec.name!r}: layers {list(self.layer_indices())} name one layer twice "
                f"(with {info.num_layers} layers, -1 is {info.num_layers} and "
                f"{-(info.num_layers + 1)} is 0)"
            )
        self.head = self.model_head()
        self.width = self.combined_width()
        if self.head is not None:
            self.width = self.head.out_width(self.width, f"pooler {spec.name!r}")
        if spec.truncate_dim is not None and spec.truncate_dim > self.width:
            raise ConfigError(
                f"pooler {spec.name!r}: truncate_dim {spec.truncate_dim} is above the "
                f"vector size {self.width}"
            )

    def layer_indices(self) -> tuple[int, ...]:
        """Hidden-state layers this pooler reads (the forward asks for exactly these)."""
        return self.spec.layers

    def combined_width(self) -> int:
        factor = len(self.layers) if self.spec.layer_combine == "concat" else 1
        return self.info.hidden_size * factor

    def model_head(self) -> ModelHead | None:
        """The model's Dense / Normalize modules this pooler applies after ``pool``."""
        if not self.spec.model_head:
            return None
        if self.parts is None or self.parts.head.empty:
            source = self.parts.source if self.parts else "this model"
            raise ConfigError(
                f"pooler {self.spec.name!r}: model_head = true, but {source} has no Dense or "
                "Normalize module after its Pooling"
            )
        return self.parts.head

    @property
    def normalizes(self) -> bool:
        """Whether the set's vectors end L2-normalised (after windows and truncate_dim)."""
        return self.spec.normalize

    def identity(self) -> dict:
        """What else, beyond the spec, decides this pooler's vectors (for the fingerprint)."""
        return {}

    def check_row_tokens(self, tokens: int, source: str) -> None:
        """Refuse, at load, rows of up to ``tokens`` tokens (``source`` says what sets that:
        max_length or the window size) where this pooler cannot take them; a batch is as wide
        as its longest row, so a pooler that took some widths only would fail or not by
        batch-mates. Every built-in pooler takes any width."""
        return None

    @property
    def first_token_only(self) -> bool:
        """Whether this pooler reads nothing of its layers but each row's first token (then a
        forward that reads no other layer computes the last one at those tokens alone)."""
        return False

    @property
    def dim(self) -> int:
        """Size of the vectors this pooler writes."""
        return self.spec.truncate_dim or self.width

    def __call__(self, states: TokenStates) -> torch.Tensor:
        """[batch, dim] float32 vectors, before window aggregation and normalisation."""
        hidden = combine_layers([states.hidden[i] for i in self.layers], self.spec)
        pooled = self.pool(hidden, states.mask, states)
        if self.head is not None:
            pooled = self.head(pooled, normalize=self.spec.normalize)
        return pooled

    @abstractmethod
    def pool(self, hidden: torch.Tensor, mask: torch.Tensor, states: TokenStates) -> torch.Tensor:
        """[batch, tokens, width] hidden states and [batch, tokens] mask -> [batch, width]."""


def combine_layers(hidden: list[torch.Tensor], spec: PoolerSpec) -> torch.Tensor:
    """Combine per-layer token states into one [batch, tokens, width] tensor."""
    if len(hidden) == 1:
        return hidden[0]
    if spec.layer_combine == "concat":
        return torch.cat(hidden, dim=-1)
    stacked = torch.stack(hidden, dim=0)
    if spec.layer_combine == "max":
        return stacked.amax(dim=0)
    if spec.layer_combine == "weighted":  # a weighted mean: PoolerSpec checks sum > 0
        weights = torch.tensor(spec.layer_weights, dtype=stacked.dtype, device=stacked.device)
        return torch.einsum("l,l...->...", weights / weights.sum(), stacked)
    return stacked.mean(dim=0)


def registered(strategy: str) -> type[Pooler] | None:
    """The pooler class registered as ``strategy`` (the built-in ones loaded on first use)."""
    from pipeline.poolers import builtin, learned, model  # noqa: F401  (fill the registry)

    return REGISTRY.get(strategy)


def pooler_class(spec: PoolerSpec) -> type[Pooler]:
    """The class of ``spec``'s strategy; an unknown one is refused, listing the known ones."""
    cls = registered(spec.strategy or spec.name)
    if cls is None:
        raise ConfigError(
            f"unknown pooler {spec.strategy or spec.name!r} for set {spec.name!r}; "
            f"known: {', '.join(sorted(REGISTRY))}"
        )
    return cls


def build_pooler(spec: PoolerSpec, info: EncoderInfo, parts: ModelParts | None = None) -> Pooler:
    """The pooler for ``spec``, validated against the encoder it will run on."""
    return pooler_class(spec)(spec, info, parts)
