"""What a training run of a pooling head needs, validated before any work starts."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, Field, field_validator, model_validator

from pipeline.config import AS_LIST, STRICT, CacheDType, EncoderConfig, HeadKind, Location

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(value: int | str) -> int:
    """Bytes from ``2GB``, ``512MiB``, ``1.5GB`` or a plain integer."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    unit = match.group(2).upper() if match else ""
    if not match or unit not in _UNITS:
        raise ValueError(f"not a size: {value!r} (use e.g. 2GB, 512MiB or a number of bytes)")
    return int(float(match.group(1)) * _UNITS[unit])


def default_layers(kind: HeadKind, num_layers: int) -> tuple[int, ...]:
    """``layer_weights`` mixes every layer (embeddings too); the other kinds read the last."""
    if kind == "layer_weights":
        return tuple(range(-1, -num_layers - 2, -1))
    return (-1,)


class TrainConfig(BaseModel):
    """A pooling head trained on (query, text) pairs over a frozen encoder."""

    model_config = STRICT

    pairs: Location
    out: Location
    kind: HeadKind
    encoder: EncoderConfig = EncoderConfig()
    query_column: str = "query"
    text_column: str = "text"
    group_column: str | None = None
    layers: Annotated[tuple[int, ...], AS_LIST] | None = None
    adapter: bool = False
    out_dim: int | None = Field(default=None, gt=0)
    epochs: int = Field(default=10, gt=0)
    patience: int = Field(default=2, ge=1)
    batch_size: int = Field(default=256, ge=2)
    lr: float = Field(default=5e-4, gt=0, le=10)  # AdamW overflows far above
    weight_decay: float = Field(default=0.0, ge=0)
    temperature: float = Field(default=0.05, gt=0)
    val_fraction: float = Field(default=0.1, gt=0, lt=1)
    max_pairs: int | None = Field(default=None, gt=0)
    max_val_pairs: int = Field(default=5000, ge=2)
    memory_budget: int = Field(default=2 * 10**9, gt=0)
    cache_dtype: CacheDType = "auto"
    k: int = Field(default=10, gt=0)
    seed: int = Field(default=0, ge=0)  # numpy seeds are non-negative
    overwrite: bool = False  # replace a head already in ``out`` (its sets no longer match it)

    @field_validator("memory_budget", mode="before")
    @classmethod
    def _size(cls, value: int | str) -> int:
        return parse_size(value)

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.encoder.window is not None:
            raise ValueError("training reads the first max_length tokens; windows are not used")
        layers = self.layers
        if layers is not None and (not layers or len(set(layers)) != len(layers)):
            raise ValueError(f"layers must be distinct and non-empty, got {list(self.layers)}")
        if self.out_dim is not None and not (self.adapter or self.kind == "adapter"):
            raise ValueError("out_dim needs an adapter (kind 'adapter' or adapter = true)")
        return self

    def head_layers(self, num_layers: int) -> tuple[int, ...]:
        """The layers the head reads, as stored in head.json (negative = from the top)."""
        return self.layers or default_layers(self.kind, num_layers)

    @property
    def token_level(self) -> bool:
        """Whether the head weighs tokens (so the cache keeps every token's states).

        The other kinds pool by a plain mean over tokens, which commutes with their layer
        mix and adapter, so one mean vector per layer and text is all they need.
        """
        return self.kind in ("attention", "positional")
