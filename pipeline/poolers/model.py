"""The ``model`` pooler: the model's own pipeline, exactly as ``SentenceTransformer.encode``.

Its Pooling (every mode, ``include_prompt``) over the last layer, then its Dense and
Normalize modules in saved order. A plain Hugging Face folder has no pipeline of its own;
sentence-transformers gives it mean pooling, no Normalize, and so does this pooler. The set is
unit length only where the model's last module is a Normalize; ``normalize = false`` leaves
that final Normalize out (a Normalize before a Dense always runs).
"""

from __future__ import annotations

import torch

from pipeline.config import PoolerSpec
from pipeline.encoder import EncoderInfo, TokenStates
from pipeline.errors import ConfigError
from pipeline.models.head import ModelHead, ModelParts
from pipeline.models.pooling import pool
from pipeline.poolers.base import Pooler, register


@register("model")
class ModelPipeline(Pooler):
    def __init__(self, spec: PoolerSpec, info: EncoderInfo,
                 parts: ModelParts | None = None) -> None:
        if parts is None:
            raise ConfigError(f"pooler {spec.name!r}: the 'model' strategy needs a model's parts")
        if spec.model_head:
            raise ConfigError(
                f"pooler {spec.name!r}: the 'model' strategy always applies the model's modules; "
                "model_head is for the other poolers"
            )
        self.pooling = parts.pooling
        super().__init__(spec, info, parts)

    def model_head(self) -> ModelHead:
        return self.parts.head

    def combined_width(self) -> int:
        token_width = super().combined_width()
        if self.pooling.dimension not in (None, token_width):
            raise ConfigError(
                f"{self.parts.source}: its Pooling expects token states of width "
                f"{self.pooling.dimension}, pooler {self.spec.name!r} gives {token_width}"
            )
        return self.pooling.width(token_width)

    @property
    def first_token_only(self) -> bool:
        """A Pooling of the [CLS] token alone that counts a prompt in (else its first token
        is the first after the prompt)."""
        return self.pooling.modes == ("cls",) and self.pooling.include_prompt

    @property
    def normalizes(self) -> bool:
        """Whether the model's last module is a Normalize (and ``normalize`` keeps it)."""
        return self.spec.normalize and self.parts.head.normalizes

    def pool(self, hidden: torch.Tensor, mask: torch.Tensor, states: TokenStates) -> torch.Tensor:
        return pool(self.pooling, hidden, mask, states.prompt_length)
