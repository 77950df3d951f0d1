"""Hidden states of the frozen encoder, computed once and reused by every epoch.

Token-level heads (attention, positional) need every token's state of the layers they read:
these are packed row after row into one ``[tokens, layers, hidden]`` tensor with offsets
(no padding is stored), in bf16 unless asked otherwise. Mean-based heads (layer_weights,
adapter) only need one mean per layer and text: ``[texts, layers, hidden]`` in fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.batching import token_budget_batches
from pipeline.encoder import Encoder
from pipeline.token_rows import TokenRows


@dataclass(frozen=True)
class StateCache:
    """Row ``i`` owns ``flat[offsets[i]:offsets[i+1]]``: its tokens (or its one mean)."""

    flat: torch.Tensor  # [tokens, layers, hidden]
    offsets: torch.Tensor  # [rows + 1] int64

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def batch(self, rows: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Padded fp32 states per layer ``[batch, tokens, hidden]`` and the bool mask."""
        start = self.offsets[rows]
        length = self.offsets[rows + 1] - start
        steps = torch.arange(int(length.max()))
        mask = steps[None, :] < length[:, None]
        index = torch.where(mask, start[:, None] + steps[None, :], 0)
        states = self.flat[index].float()  # [batch, tokens, layers, hidden]
        return list(states.unbind(dim=2)), mask


def row_lengths(encoder: Encoder, tokens: list[list[int]]) -> np.ndarray:
    """Tokens per forward row, special tokens included, as the embedder truncates them."""
    specials = len(encoder.prefix) + len(encoder.suffix)
    content = encoder.content_length
    return np.fromiter((min(len(t), content) + specials for t in tokens), np.int64, len(tokens))


def row_bytes(lengths: np.ndarray, layers: int, hidden: int, token_level: bool,
              itemsize: int) -> np.ndarray:
    """Cache bytes each row costs."""
    per_row = lengths if token_level else np.ones_like(lengths)
    return per_row * layers * hidden * itemsize


def build_cache(
    encoder: Encoder,
    tokens: list[list[int]],
    layers: tuple[int, ...],
    token_level: bool,
    dtype: torch.dtype,
    progress: Callable[[int], None] | None = None,
) -> StateCache:
    """Run the encoder once over ``tokens`` (content ids per row) and keep ``layers``."""
    lengths = row_lengths(encoder, tokens)
    sizes = lengths if token_level else np.ones_like(lengths)
    offsets = np.zeros(len(tokens) + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    flat = torch.empty((int(offsets[-1]), len(layers), encoder.hidden_size), dtype=dtype)
    token_ids = TokenRows.from_lists(tokens)
    kept = encoder.kept(token_ids.lengths)  # as the embedder cuts: on the tokenizer's side
    batches = token_budget_batches(lengths, encoder.token_budget, encoder.max_batch_rows)
    for rows in batches:
        ids, mask = encoder.pad_rows(token_ids, rows, np.zeros(len(rows), np.int64),
                                     kept.start[rows], kept.end[rows])
        out = encoder.forward(ids, mask, set(layers), attention=False)
        stacked = torch.stack([out.hidden[i] for i in layers], dim=2).cpu()  # [b, t, L, H]
        mask = mask.cpu()
        if token_level:
            dest = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in rows])
            flat[torch.from_numpy(dest)] = stacked[mask].to(dtype)
        else:
            weights = mask[:, :, None, None].float()
            means = (stacked * weights).sum(1) / weights.sum(1)
            flat[torch.from_numpy(offsets[rows])] = means.to(dtype)
        if progress:
            progress(len(rows))
    return StateCache(flat, torch.from_numpy(offsets))

