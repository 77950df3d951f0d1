"""The modules after Pooling (Dense, Normalize), as one torch module, and what poolers reuse.

They run in saved order: a Normalize before a Dense normalises what the Dense reads (the
Dense's output is then not unit length), as in ``SentenceTransformer.encode``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pipeline.errors import ConfigError
from pipeline.models.dense import Dense
from pipeline.models.normalize import Normalize
from pipeline.models.pooling import PoolingConfig


class ModelHead(nn.Module):
    """The model's Dense and Normalize modules in saved order (possibly none)."""

    def __init__(self, modules: list[nn.Module]) -> None:
        super().__init__()
        self.steps = nn.ModuleList(modules)

    @property
    def empty(self) -> bool:
        return len(self.steps) == 0

    @property
    def normalizes(self) -> bool:
        """Whether the last module is a Normalize: only then do its vectors end unit length."""
        return bool(self.steps) and isinstance(self.steps[-1], Normalize)

    def out_width(self, width: int, source: str) -> int:
        """The width after every Dense, checking each takes what the one before gives."""
        for step in self.steps:
            if isinstance(step, Dense):
                if step.cfg.in_features != width:
                    raise ConfigError(
                        f"{source}: Dense takes {step.cfg.in_features} values but gets {width}"
                    )
                width = step.cfg.out_features
        return width

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        """Every module in order; ``normalize = False`` leaves out a final Normalize alone (one
        before a Dense is part of what the Dense computes)."""
        steps = list(self.steps)
        if not normalize and self.normalizes:
            steps = steps[:-1]
        for step in steps:
            x = step(x)
        return x


@dataclass(frozen=True)
class ModelParts:
    """What poolers may reuse of the model's own pipeline (a plain HF folder: mean, no head)."""

    source: str
    pooling: PoolingConfig
    head: ModelHead
    sentence_transformers: bool
