"""Pure planning of token windows: which slice of each text's tokens each forward row sees.

A text of ``n`` content tokens (special tokens excluded) becomes one piece when windows are
off (the first ``content`` tokens, or the last ones for a tokenizer that truncates on the left;
the rest is truncated and counted) or several overlapping windows of ``content`` tokens every
``stride`` tokens, the last one ending at the text's end (no token is truncated).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

Side = Literal["right", "left"]  # the end a long text loses: the tokenizer's truncation side


@dataclass(frozen=True)
class Pieces:
    """Row ``row[i]`` is covered by content tokens ``start[i]:end[i]`` in piece ``i``."""

    row: np.ndarray
    start: np.ndarray
    end: np.ndarray

    def __len__(self) -> int:
        return len(self.row)

    @property
    def lengths(self) -> np.ndarray:
        return self.end - self.start


def truncate(lengths: np.ndarray, content: int | np.ndarray, side: Side = "right") -> Pieces:
    """One piece per text: its first ``content`` tokens (one number, or one per text), or
    with ``side = "left"`` its last ones."""
    lengths = np.asarray(lengths, dtype=np.int64)
    rows = np.arange(len(lengths), dtype=np.int64)
    if side == "left":
        return Pieces(rows, np.maximum(lengths - content, 0), lengths)
    return Pieces(rows, np.zeros_like(rows), np.minimum(lengths, content))


def window_starts(length: int, content: int, stride: int) -> list[int]:
    """Start offsets of the windows covering ``length`` tokens (at least one window)."""
    if length <= content:
        return [0]
    starts = list(range(0, length - content, stride))
    starts.append(length - content)  # the last window ends exactly at the text's end
    return starts


def windows(lengths: np.ndarray, content: int | np.ndarray, stride: int) -> Pieces:
    """Overlapping windows of ``content`` tokens (one number, or one per text: what a prompt
    leaves of the window) every ``stride`` tokens for each text."""
    lengths = np.asarray(lengths, dtype=np.int64)
    contents = np.broadcast_to(np.asarray(content, dtype=np.int64), lengths.shape)
    if stride <= 0 or (contents < stride).any():
        raise ValueError(f"stride must be in 1..{int(contents.min())}, got {stride}")
    rows, starts = [], []
    for row, (length, size) in enumerate(zip(lengths.tolist(), contents.tolist(), strict=True)):
        for start in window_starts(length, size, stride):
            rows.append(row)
            starts.append(start)
    row_arr = np.asarray(rows, dtype=np.int64)
    start_arr = np.asarray(starts, dtype=np.int64)
    end_arr = np.minimum(start_arr + contents[row_arr], lengths[row_arr])
    return Pieces(row_arr, start_arr, end_arr)
