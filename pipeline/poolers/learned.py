"""The ``learned`` pooler: a trained PoolingHead applied to the frozen encoder's states."""

from __future__ import annotations

import torch

from pipeline.config import PoolerSpec
from pipeline.encoder import EncoderInfo, TokenStates
from pipeline.errors import ConfigError
from pipeline.head_files import HeadConfig, check_positions, check_trained_for
from pipeline.models.head import ModelParts
from pipeline.poolers.base import Pooler, register
from pipeline.poolers.heads import load_head


@register("learned")
class Learned(Pooler):
    """Reads the layers its head was trained on; refuses heads made for another encoder."""

    def __init__(self, spec: PoolerSpec, info: EncoderInfo,
                 parts: ModelParts | None = None) -> None:
        if spec.model_head:
            raise ConfigError(f"pooler {spec.name!r}: a learned head cannot take model_head = true "
                              "(train it with an adapter instead)")
        self.pooling_head = load_head(spec.head, expect=lambda cfg: _check_encoder(spec, cfg, info))
        super().__init__(spec, info, parts)

    def identity(self) -> dict:
        """The head's weights, whose file carries the digest of the head.json they were saved
        with (``heads.load_head`` refuses another), so fingerprints made before stay valid; a
        head saved before that digest adds its head.json's (an edit of its layers kept the
        fingerprint, and a set took vectors of another layer beside its own)."""
        head = self.pooling_head
        identity = {"head_sha256": head.weights_sha256}
        if not head.config_sealed:  # a head saved before the digest: head.json counts apart
            from pipeline.head_files import config_digest

            identity["head_config"] = config_digest(head.cfg)
        return identity

    def layer_indices(self) -> tuple[int, ...]:
        return self.pooling_head.cfg.layers

    def check_row_tokens(self, tokens: int, source: str) -> None:
        """A positional head has one weight per position: rows must fit in them."""
        check_positions(self.spec.name, self.spec.head, self.pooling_head.cfg, tokens, source)

    def combined_width(self) -> int:
        return self.pooling_head.cfg.dim

    def __call__(self, states: TokenStates) -> torch.Tensor:
        with torch.inference_mode():
            hidden = [states.hidden[i] for i in self.layers]
            return self.pooling_head(hidden, states.mask).float()

    def pool(self, hidden: torch.Tensor, mask: torch.Tensor, states: TokenStates) -> torch.Tensor:
        raise NotImplementedError("the learned pooler applies its head in __call__")


def _check_encoder(spec: PoolerSpec, cfg: HeadConfig, info: EncoderInfo) -> None:
    """Refuse a head made for another encoder, before its weights are read."""
    if cfg.hidden_size != info.hidden_size or cfg.num_layers != info.num_layers:
        raise ConfigError(
            f"pooling head {spec.head} expects an encoder with hidden size "
            f"{cfg.hidden_size} and {cfg.num_layers} layers; this one has "
            f"{info.hidden_size} and {info.num_layers}"
        )
    check_trained_for(spec.head, cfg, {info.model_hash}, info.model)
