"""The Pooling module: its saved modes, and pooling exactly as sentence-transformers pools.

Modes are concatenated in the saved order (old configs with ``pooling_mode_*`` flags in
sentence-transformers' fixed order). With ``include_prompt = false`` the first
``prompt_length`` positions of every row (the prompt as sentence-transformers measures it,
special tokens included) leave the mask before any mode runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.errors import ModelError
from pipeline.models.jsonfile import read_json

MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
_LEGACY = {  # the order sentence-transformers concatenates old flag configs in
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


@dataclass(frozen=True)
class PoolingConfig:
    dimension: int | None  # the token width it was saved for (None: not recorded)
    modes: tuple[str, ...] = ("mean",)
    include_prompt: bool = True

    def width(self, token_width: int) -> int:
        return token_width * len(self.modes)


def read_pooling_config(folder: Path) -> PoolingConfig:
    path = folder / "config.json"
    raw = read_json(path)
    dimension = raw.get("embedding_dimension", raw.get("word_embedding_dimension"))
    modes = raw.get("pooling_mode")
    if modes is None:
        modes = [mode for key, mode in _LEGACY.items() if raw.get(key)] or ["mean"]
    modes = (modes,) if isinstance(modes, str) else tuple(modes)
    bad = [m for m in modes if m not in MODES]
    if not modes or bad:
        raise ModelError(f"{path}: pooling mode {bad or modes} is not one of {', '.join(MODES)}")
    return PoolingConfig(dimension, modes, bool(raw.get("include_prompt", True)))


def pool(cfg: PoolingConfig, hidden: torch.Tensor, mask: torch.Tensor,
         prompt_length: int = 0) -> torch.Tensor:
    """[batch, tokens, width] right-padded states and bool mask -> [batch, width * modes]."""
    if prompt_length and not cfg.include_prompt:
        mask = mask.clone()
        mask[:, :prompt_length] = False
    return torch.cat([_MODE[m](hidden, mask) for m in cfg.modes], dim=-1)


def _cls(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    first = mask.to(torch.int32).argmax(dim=1)  # the first token left in the mask
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), first]


def _max(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return hidden.masked_fill(~mask.unsqueeze(-1), float("-inf")).amax(dim=1)


def _sum_count(hidden: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * w).sum(1), w.sum(1).clamp(min=1e-9)


def _mean(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    total, count = _sum_count(hidden, mask)
    return total / count


def _mean_sqrt_len(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    total, count = _sum_count(hidden, mask)
    return total / count.sqrt()


def _weighted_mean(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Position p (from 1) weighs p; a prompt left out keeps the others' positions."""
    positions = torch.arange(1, hidden.shape[1] + 1, device=hidden.device, dtype=hidden.dtype)
    w = mask.unsqueeze(-1).to(hidden.dtype) * positions.view(1, -1, 1)
    return (hidden * w).sum(1) / w.sum(1).clamp(min=1e-9)


def _last_token(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    seen, from_end = mask.to(torch.int32).flip(1).max(1)
    from_end = torch.where(seen == 0, hidden.shape[1] - 1, from_end)
    last = hidden.shape[1] - 1 - from_end
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    return (hidden * mask.unsqueeze(-1).to(hidden.dtype))[rows, last]


_MODE = {"cls": _cls, "max": _max, "mean": _mean, "mean_sqrt_len_tokens": _mean_sqrt_len,
         "weightedmean": _weighted_mean, "lasttoken": _last_token}
