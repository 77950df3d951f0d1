"""Token ids of many texts in one flat array, and padded forward rows cut from it in numpy.

A batch's input is built from index arithmetic over every row at once instead of a Python
list per row: on a tiny encoder (where the host side is what is left) building rows one by
one held the GIL ~1.3 s of every 200,000 rows, time the reader thread then waited for.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TokenRows:
    """Text ``i``'s ids are ``values[offsets[i]:offsets[i + 1]]``."""

    values: np.ndarray  # int64
    offsets: np.ndarray  # int64, one more than there are texts

    @classmethod
    def from_lists(cls, ids: Sequence[Sequence[int]]) -> TokenRows:
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        offsets = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64,
                             count=int(offsets[-1]))
        return cls(values, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def replaced(self, rows: np.ndarray, other: TokenRows) -> TokenRows:
        """These rows with row ``rows[i]`` replaced by ``other``'s row ``i``."""
        lengths = self.lengths
        lengths[rows] = other.lengths
        offsets = np.zeros(len(self) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        kept = np.ones(len(self), bool)
        kept[rows] = False
        kept = np.flatnonzero(kept)
        values = np.empty(int(offsets[-1]), dtype=np.int64)
        values[_spans(offsets, kept)] = self.values[_spans(self.offsets, kept)]
        values[_spans(offsets, rows)] = other.values
        return TokenRows(values, offsets)


def _spans(offsets: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Positions in ``values`` of rows ``rows`` (in that order), one flat array."""
    starts, ends = offsets[rows], offsets[rows + 1]
    lengths = ends - starts
    before = np.cumsum(lengths) - lengths  # of the flat output, ahead of each row
    within = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(before, lengths)
    return np.repeat(starts, lengths) + within


def pad_rows(tokens: TokenRows, rows: np.ndarray, lead: np.ndarray, start: np.ndarray,
             end: np.ndarray, prefix: Sequence[int], suffix: Sequence[int], pad_id: int
             ) -> tuple[np.ndarray, np.ndarray]:
    """Forward row ``i``: ``prefix``, the first ``lead[i]`` ids of text ``rows[i]`` (its
    prompt), that text's ids ``start[i]:end[i]`` counted after those, ``suffix``; right-padded
    with ``pad_id``. Returns (ids int64 [rows, width], mask bool, True on real tokens)."""
    rows, lead, start, end = (np.asarray(a, dtype=np.int64) for a in (rows, lead, start, end))
    before = len(prefix)
    body = lead + (end - start)  # ids taken from the text
    length = before + body + len(suffix)
    width = int(length.max()) if len(rows) else 0
    column = np.arange(width, dtype=np.int64)[None, :]
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    mask = column < length[:, None]
    ids[:, :before] = np.asarray(prefix, dtype=np.int64)
    at = column - before  # position inside the body
    take = (at >= 0) & (at < body[:, None])
    first = tokens.offsets[rows][:, None]
    # the prompt's ids sit at first + at; the text's (``start`` skipped) at first + start + at
    source = np.where(at < lead[:, None], first + at, first + start[:, None] + at)
    ids[take] = tokens.values[source[take]]
    everyone = np.arange(len(rows))
    for k, token in enumerate(suffix):
        ids[everyone, before + body + k] = token
    return ids, mask
