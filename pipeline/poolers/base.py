"""The pooler extension point: subclass ``Pooler``, fill in ``pool``, register a name.

    @register("mean")
    class Mean(Pooler):
        def pool(self, hidden, mask, states):
            ...

``hidden`` is already the configured combination of layers ([batch, tokens, width]);
``mask`` is True on real tokens. Options shared by every pooler (layers, layer_combine,
normalize, truncate_dim, window_agg) are applied around ``pool`` by the embedder, so a
pooler only says how tokens become one vector.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from pipeline.config import PoolerSpec
from pipeline.encoder import EncoderInfo, TokenStates, resolve_layer
from pipeline.errors import ConfigError

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

    def __init__(self, spec: PoolerSpec, info: EncoderInfo) -> None:
        self.spec = spec
        self.info = info
        self.layers = tuple(resolve_layer(i, info.num_layers) for i in self.layer_indices())
        self.width = self.combined_width()
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

    def identity(self) -> dict:
        """What else, beyond the spec, decides this pooler's vectors (for the fingerprint)."""
        return {}

    @property
    def dim(self) -> int:
        """Size of the vectors this pooler writes."""
        return self.spec.truncate_dim or self.width

    def __call__(self, states: TokenStates) -> torch.Tensor:
        """[batch, dim] float32 vectors, before window aggregation and normalisation."""
        hidden = combine_layers([states.hidden[i] for i in self.layers], self.spec)
        return self.pool(hidden, states.mask, states)

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
    if spec.layer_combine == "weighted":
        weights = torch.tensor(spec.layer_weights, dtype=stacked.dtype, device=stacked.device)
        return torch.einsum("l,l...->...", weights / weights.sum(), stacked)
    return stacked.mean(dim=0)


def build_pooler(spec: PoolerSpec, info: EncoderInfo) -> Pooler:
    """The pooler for ``spec``, validated against the encoder it will run on."""
    from pipeline.poolers import builtin, learned  # noqa: F401  (fill the registry)

    cls = REGISTRY.get(spec.strategy or spec.name)
    if cls is None:
        raise ConfigError(
            f"unknown pooler {spec.strategy!r} for set {spec.name!r}; "
            f"known: {', '.join(sorted(REGISTRY))}"
        )
    return cls(spec, info)
