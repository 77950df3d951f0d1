"""The fixed poolers of the DESIGN table. Masks are exact: padding never reaches a vector."""

from __future__ import annotations

import torch

from pipeline.encoder import TokenStates
from pipeline.poolers.base import Pooler, register


def _weights(mask: torch.Tensor) -> torch.Tensor:
    return mask.unsqueeze(-1).to(torch.float32)


@register("cls")
class Cls(Pooler):
    """Hidden state of the first token."""

    @property
    def first_token_only(self) -> bool:
        return True

    def pool(self, hidden: torch.Tensor, mask: torch.Tensor, states: TokenStates) -> torch.Tensor:
        return hidden[:, 0]


@register("mean")
class Mean(Pooler):
    """Mean over real tokens (sentence-transformers' default)."""

    def pool(self, hidden: torch.Tensor, mask: torch.Tensor, states: TokenStates) -> torch.Tensor:
        w = _weights(mask)
        return (hidden * w).sum(1) / w.sum(1).clamp(min=1e-9)


@register("max")
class Max(Pooler):
    """Per-dimension max over real tokens."""

    def pool(self, hidden: torch.Tensor, mask: torch.Tensor, states: TokenStates) -> torch.Tensor:
        return hidden.masked_fill(~mask.unsqueeze(-1), float("-inf")).amax(dim=1)


@register("mean_sqrt_len")
class MeanSqrtLen(Pooler):
    """Sum over real tokens divided by the square root of their count."""

    def pool(self, hidden: torch.Tensor, mask: torch.Tensor, states: TokenStates) -> torch.Tensor:
        w = _weights(mask)
        return (hidden * w).sum(1) / w.sum(1).clamp(min=1e-9).sqrt()


@register("weighted_mean")
class WeightedMean(Pooler):
    """Mean weighted by position 1..n over real tokens: later tokens weigh more (SGPT)."""

    def pool(self, hidden: torch.Tensor, mask: torch.Tensor, states: TokenStates) -> torch.Tensor:
        positions = torch.cumsum(mask.to(torch.float32), dim=1) * mask
        w = positions.unsqueeze(-1)
        return (hidden * w).sum(1) / w.sum(1).clamp(min=1e-9)


@register("last_token")
class LastToken(Pooler):
    """Hidden state of the last real token (decoder embedding models)."""

    def pool(self, hidden: torch.Tensor, mask: torch.Tensor, states: TokenStates) -> torch.Tensor:
        positions = torch.arange(mask.shape[1], device=mask.device)
        last = (positions * mask).argmax(dim=1)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]


@register("attention")
class Attention(Pooler):
    """Mean weighted by the model's last-layer attention from the first token, over heads."""

    needs_attention = True

    def pool(self, hidden: torch.Tensor, mask: torch.Tensor, states: TokenStates) -> torch.Tensor:
        weights = states.first_token_attention.masked_fill(~mask, 0.0)
        weights = weights / weights.sum(1, keepdim=True).clamp(min=1e-9)
        return torch.einsum("bt,btd->bd", weights, hidden)
