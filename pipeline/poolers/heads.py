"""Trainable pooling heads, stored as ``head.json`` + ``head.safetensors`` (never pickle).

One module serves training and inference. ``kind`` names what is learned:

- ``attention``: a linear scorer over token states; softmax over real tokens weights the mean.
- ``positional``: one logit per position; softmax over real positions weights the mean.
- ``layer_weights``: softmax weights mix the chosen layers; then a mean over real tokens.
- ``adapter``: a mean over real tokens followed by a linear map (initialised to identity).

Any kind can add the linear adapter on top with ``adapter = true``.

The files are read and checked by ``pipeline.head_files`` (without torch, so that a job's
keys take a head's digests without importing it); ``load_head`` then builds the module.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import nn

from pipeline import storage
from pipeline.config import HEAD_JSON, HEAD_WEIGHTS
from pipeline.errors import ConfigError
from pipeline.head_files import (
    CONFIG_KEY,
    HeadConfig,
    check_saved_config,
    config_digest,
    expected_shapes,
    read_head_config,
    read_weights,
)


class PoolingHead(nn.Module):
    """[layers x [batch, tokens, hidden]] + mask -> [batch, dim]."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weights_sha256 = ""  # load_head: of the weights file read
        self.config_sealed = True  # load_head: whether that file carries head.json's digest
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
    weights = save_safetensors(tensors, metadata={CONFIG_KEY: config_digest(head.cfg)})
    storage.write_bytes(storage.join(folder, HEAD_WEIGHTS), weights)
    storage.write_json(storage.join(folder, HEAD_JSON), head.cfg.model_dump(mode="json"))


def load_head(folder: str,
              expect: Callable[[HeadConfig], None] | None = None) -> PoolingHead:
    """Read a head saved by ``save_head``; a malformed one fails naming the file.

    ``expect`` may refuse the config (another encoder) before the weights are read.
    """
    cfg = read_head_config(folder)
    if expect is not None:
        expect(cfg)
    weights, saved = read_weights(storage.join(folder, HEAD_WEIGHTS), folder,
                                  expected_shapes(cfg))
    check_saved_config(saved, cfg, folder)
    head = PoolingHead(cfg)  # no larger than the checked file
    try:
        head.load_state_dict(load_safetensors(weights), strict=True)
    except (RuntimeError, SafetensorError) as exc:
        first = str(exc).splitlines()[0]
        raise ConfigError(f"pooling head {folder} does not match its head.json: {first}") from None
    if not all(bool(torch.isfinite(p).all()) for p in head.parameters()):
        raise ConfigError(f"pooling head {folder}: {HEAD_WEIGHTS} holds weights that are not "
                          "finite (NaN or infinity): it is damaged; restore it or train again")
    head.weights_sha256 = hashlib.sha256(weights).hexdigest()[:16]
    head.config_sealed = CONFIG_KEY in saved  # else head.json is not bound to the weights
    return head.eval()
