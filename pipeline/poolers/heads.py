"""Trainable pooling heads, stored as ``head.json`` + ``head.safetensors`` (never pickle).

One module serves training and inference. ``kind`` names what is learned:

- ``attention``: a linear scorer over token states; softmax over real tokens weights the mean.
- ``positional``: one logit per position; softmax over real positions weights the mean.
- ``layer_weights``: softmax weights mix the chosen layers; then a mean over real tokens.
- ``adapter``: a mean over real tokens followed by a linear map (initialised to identity).

Any kind can add the linear adapter on top with ``adapter = true``.
"""

from __future__ import annotations

import hashlib
import json

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import nn

from pipeline import storage
from pipeline.config import HeadKind
from pipeline.errors import ConfigError

HEAD_JSON = "head.json"
HEAD_WEIGHTS = "head.safetensors"


class HeadConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: HeadKind
    hidden_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    model_hash: str
    layers: tuple[int, ...] = (-1,)
    max_positions: int = Field(default=512, gt=0)
    adapter: bool = False
    out_dim: int | None = Field(default=None, gt=0)
    format_version: int = 1
    metrics: dict[str, float] = Field(default_factory=dict)

    @property
    def dim(self) -> int:
        if self.has_adapter:
            return self.out_dim or self.hidden_size
        return self.hidden_size

    @property
    def has_adapter(self) -> bool:
        return self.adapter or self.kind == "adapter"


class PoolingHead(nn.Module):
    """[layers x [batch, tokens, hidden]] + mask -> [batch, dim]."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        if cfg.kind == "attention":
            self.scorer = nn.Linear(h, 1)
            nn.init.zeros_(self.scorer.weight)
            nn.init.zeros_(self.scorer.bias)
        if cfg.kind == "positional":
            self.position_logits = nn.Parameter(torch.zeros(cfg.max_positions))
        if cfg.kind == "layer_weights":
            self.layer_logits = nn.Parameter(torch.zeros(len(cfg.layers)))
        if cfg.has_adapter:
            out = cfg.out_dim or h
            self.adapter = nn.Linear(h, out)
            with torch.no_grad():
                self.adapter.weight.copy_(torch.eye(out, h))
                self.adapter.bias.zero_()

    def forward(self, hidden: list[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        states = self._mix_layers(hidden)
        weights = self._token_weights(states, mask)
        pooled = torch.einsum("bt,btd->bd", weights, states)
        return self.adapter(pooled) if self.cfg.has_adapter else pooled

    def _mix_layers(self, hidden: list[torch.Tensor]) -> torch.Tensor:
        if self.cfg.kind == "layer_weights":
            mix = torch.softmax(self.layer_logits, dim=0)
            return torch.einsum("l,lbtd->btd", mix, torch.stack(hidden, dim=0))
        return torch.stack(hidden, dim=0).mean(dim=0) if len(hidden) > 1 else hidden[0]

    def _token_weights(self, states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.cfg.kind == "attention":
            logits = self.scorer(states).squeeze(-1)
        elif self.cfg.kind == "positional":
            t = states.shape[1]
            if t > self.cfg.max_positions:
                limit = self.cfg.max_positions
                raise ConfigError(f"positional head covers {limit} tokens, got {t}")
            logits = self.position_logits[:t].unsqueeze(0).expand(states.shape[0], t)
        else:
            logits = torch.zeros(mask.shape, dtype=states.dtype, device=states.device)
        logits = logits.masked_fill(~mask, float("-inf"))
        return torch.softmax(logits, dim=1)


def save_head(head: PoolingHead, folder: str) -> None:
    """Write the head's config and weights under ``folder`` (local or s3://)."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    storage.write_bytes(storage.join(folder, HEAD_WEIGHTS), save_safetensors(tensors))
    storage.write_json(storage.join(folder, HEAD_JSON), head.cfg.model_dump(mode="json"))


def load_head(folder: str) -> PoolingHead:
    """Read a head saved by ``save_head``; a malformed one fails naming the folder."""
    raw = json.loads(storage.read_bytes(storage.join(folder, HEAD_JSON)))
    from pipeline.config import parse

    cfg = parse(HeadConfig, raw, f"pooling head {folder}/{HEAD_JSON}")
    head = PoolingHead(cfg)
    weights = storage.read_bytes(storage.join(folder, HEAD_WEIGHTS))
    tensors = load_safetensors(weights)
    try:
        head.load_state_dict(tensors, strict=True)
    except RuntimeError as exc:
        first = str(exc).splitlines()[0]
        raise ConfigError(f"pooling head {folder} does not match its head.json: {first}") from None
    head.weights_sha256 = hashlib.sha256(weights).hexdigest()[:16]
    return head.eval()
