"""Pure planning of token windows: which slice of each text's tokens each forward row sees.

A text of ``n`` content tokens (special tokens excluded) becomes one piece when windows are
off (the first ``content`` tokens; the rest is truncated and counted) or several overlapping
windows of ``content`` tokens every ``stride`` tokens, the last one ending at the text's end.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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


def truncate(lengths: np.ndarray, content: int) -> Pieces:
    """One piece per text: its first ``content`` tokens."""
    lengths = np.asarray(lengths, dtype=np.int64)
    rows = np.arange(len(lengths), dtype=np.int64)
    return Pieces(rows, np.zeros_like(rows), np.minimum(lengths, content))


def window_starts(length: int, content: int, stride: int) -> list[int]:
    """Start offsets of the windows covering ``length`` tokens (at least one window)."""
    if length <= content:
        return [0]
    starts = list(range(0, length - content, stride))
    starts.append(length - content)  # the last window ends exactly at the text's end
    return starts


def windows(lengths: np.ndarray, content: int, stride: int) -> Pieces:
    """Overlapping windows of ``content`` tokens every ``stride`` tokens for each text."""
    if not 0 < stride <= content:
        raise ValueError(f"stride must be in 1..{content}, got {stride}")
    rows, starts = [], []
    for row, length in enumerate(np.asarray(lengths, dtype=np.int64)):
        for start in window_starts(int(length), content, stride):
            rows.append(row)
            starts.append(start)
    row_arr = np.asarray(rows, dtype=np.int64)
    start_arr = np.asarray(starts, dtype=np.int64)
    end_arr = np.minimum(start_arr + content, np.asarray(lengths, dtype=np.int64)[row_arr])
    return Pieces(row_arr, start_arr, end_arr)
