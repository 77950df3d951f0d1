"""The Normalize module: unit length (L2). Its folder is optional: old saves ship none."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.errors import ModelError
from pipeline.models.jsonfile import read_optional_json

_IO = "sentence_embedding"


def check_normalize_config(folder: Path) -> None:
    """Refuse a Normalize of token embeddings (multi-vector models)."""
    raw = read_optional_json(folder / "config.json") if folder.is_dir() else {}
    for key in ("module_input_name", "module_output_name"):
        if raw.get(key, _IO) not in (_IO, None):
            raise ModelError(f"{folder}: a Normalize of {raw[key]!r} is not supported")


class Normalize(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, p=2, dim=-1)
