"""Which fused CPU forward computes a model: ``FusedBert`` for the BERT family
(``pipeline.fused_bert``) or ``FusedModernBert`` (``pipeline.fused_modernbert``), each deciding
by its module's ``fusable`` whether it computes exactly what the model does on that device."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pipeline.fused_bert import FusedEncoder
    from pipeline.models.recorded import ModelConfig


def fused_forward(config: ModelConfig, device: torch.device) -> type[FusedEncoder] | None:
    """The fused forward that runs the model of ``config`` on ``device``, or None (then
    transformers' own forward runs it)."""
    from pipeline import fused_bert, fused_modernbert

    if fused_bert.fusable(config, device):
        return fused_bert.FusedBert
    if fused_modernbert.fusable(config, device):
        return fused_modernbert.FusedModernBert
    return None
