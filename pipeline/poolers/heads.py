"""Trainable pooling heads, stored as ``head.json`` + ``head.safetensors`` (never pickle).

One module serves training and inference. ``kind`` names what is learned:

- ``attention``: a linear scorer over token states; softmax over real tokens weights the mean.
- ``positional``: one logit per position; softmax over real positions weights the mean.
- ``layer_weights``: softmax weights mix the chosen layers; then a mean over real tokens.
- ``adapter``: a mean over real tokens followed by a linear map (initialised to identity).

Any kind can add the linear adapter on top with ``adapter = true``.

Loading trusts neither file: ``head.json`` is size-bounded and validated, the tensor shapes it
implies (``expected_shapes``) are checked against the file size and the safetensors header
before the weights are read or any tensor is allocated, so a bad JSON, a truncated file, a huge
shape or a shape that disagrees with the JSON fails in one line, early.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Callable

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import nn

from pipeline import storage
from pipeline.config import HEAD_JSON, HEAD_WEIGHTS, HeadKind
from pipeline.errors import ConfigError

MAX_JSON_BYTES = 1 << 20  # head.json and the safetensors header are small


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


def expected_shapes(cfg: HeadConfig) -> dict[str, tuple[int, ...]]:
    """The float32 tensors (name: shape) a head of ``cfg`` has, computed without making it."""
    h = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {}
    if cfg.kind == "attention":
        shapes |= {"scorer.weight": (1, h), "scorer.bias": (1,)}
    if cfg.kind == "positional":
        shapes["position_logits"] = (cfg.max_positions,)
    if cfg.kind == "layer_weights":
        shapes["layer_logits"] = (len(cfg.layers),)
    if cfg.has_adapter:
        out = cfg.out_dim or h
        shapes |= {"adapter.weight": (out, h), "adapter.bias": (out,)}
    return shapes


def read_head_config(folder: str) -> HeadConfig:
    """``head.json`` of ``folder``, validated; one ConfigError line when it is not one."""
    url = storage.join(folder, HEAD_JSON)
    if storage.size(url) > MAX_JSON_BYTES:
        raise ConfigError(f"pooling head {url} is larger than {MAX_JSON_BYTES:,} bytes")
    try:
        raw = json.loads(storage.read_bytes(url))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"pooling head {url} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"pooling head {url} is not a JSON object")
    from pipeline.config import parse

    return parse(HeadConfig, raw, f"pooling head {url}")


def load_head(folder: str,
              expect: Callable[[HeadConfig], None] | None = None) -> PoolingHead:
    """Read a head saved by ``save_head``; a malformed one fails naming the file.

    ``expect`` may refuse the config (another encoder) before the weights are read.
    """
    cfg = read_head_config(folder)
    if expect is not None:
        expect(cfg)
    weights = _read_weights(storage.join(folder, HEAD_WEIGHTS), expected_shapes(cfg))
    head = PoolingHead(cfg)  # no larger than the checked file
    try:
        head.load_state_dict(load_safetensors(weights), strict=True)
    except (RuntimeError, SafetensorError) as exc:
        first = str(exc).splitlines()[0]
        raise ConfigError(f"pooling head {folder} does not match its head.json: {first}") from None
    head.weights_sha256 = hashlib.sha256(weights).hexdigest()[:16]
    return head.eval()


def _read_weights(url: str, shapes: dict[str, tuple[int, ...]]) -> bytes:
    """The bytes of ``url`` once its size and header agree with ``shapes`` (float32)."""
    data = sum(4 * math.prod(shape) for shape in shapes.values())
    size = storage.size(url)
    if not 8 < size <= 8 + MAX_JSON_BYTES + data:
        raise ConfigError(f"pooling head {url} has {size:,} bytes; its head.json needs "
                          f"{data:,} bytes of float32 weights plus a header")
    raw = storage.read_bytes(url)
    (length,) = struct.unpack("<Q", raw[:8])
    try:
        header = json.loads(raw[8:8 + length]) if length <= MAX_JSON_BYTES else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    if not isinstance(header, dict):
        raise ConfigError(f"pooling head {url} is not a safetensors file (bad header)")
    header.pop("__metadata__", None)
    found = {k: (v.get("dtype"), tuple(v.get("shape") or ()), tuple(v.get("data_offsets") or ()))
             if isinstance(v, dict) else (None, (), ()) for k, v in header.items()}
    if {k: f[:2] for k, f in found.items()} != {k: ("F32", s) for k, s in shapes.items()}:
        got = ", ".join(f"{k} {f[0]} {list(f[1])}" for k, f in sorted(found.items()))
        raise ConfigError(f"pooling head {url} does not match its head.json: it holds {got}; "
                          f"head.json needs {_describe(shapes)}")
    if size != 8 + length + data or not _contiguous(list(found.values()), data):
        raise ConfigError(f"pooling head {url} is truncated or damaged: {size:,} bytes, "
                          f"expected {8 + length + data:,}")
    return raw


def _contiguous(tensors: list[tuple], data: int) -> bool:
    """The tensors' data_offsets tile [0, data) exactly, each as long as its shape needs."""
    spans = sorted(offsets for _, _, offsets in tensors)
    if any(len(s) != 2 or not all(isinstance(x, int) for x in s) for s in spans):
        return False
    if any(end - begin != 4 * math.prod(shape) for _, shape, (begin, end) in tensors):
        return False
    ends = [0] + [end for _, end in spans]
    return [begin for begin, _ in spans] == ends[:-1] and ends[-1] == data


def _describe(shapes: dict[str, tuple[int, ...]]) -> str:
    return ", ".join(f"{k} F32 {list(s)}" for k, s in sorted(shapes.items()))
