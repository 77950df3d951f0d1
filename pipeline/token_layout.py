"""Where a batch's tokens lie in the fused CPU forward's flat stream ([tokens, hidden]).

Padded, the stream is the batch's [rows x width] tokens as they are, padding included, and
attention runs once over the batch, its padding masked. Unpadded (``Layout.unpadded``), the
stream holds the real tokens alone, rows sorted longest first so that rows of one length lie
side by side (a ``Run``), and attention runs once a run, over exactly that many keys, no padding
to mask. The products then skip the padding's rows too, and a text's vector no longer depends
on its batch-mates: with padding, the same text computed beside a longer one went through
attention over more keys (other blocks of torch's kernels, or another kernel: bf16 rows of
under 32 tokens take the blocked products where AMX runs, wider ones SDPA), whose rounding
differs in the last bit; int8's fixed-scale quantization turned that into a cosine of 0.9952
between a text's two vectors (MiniLM, 2,000 PyPI summaries encoded in two orders, on a 2-core
AMX Xeon VM; bf16 0.99998).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Run:
    """``rows`` rows of ``width`` tokens each, side by side in the stream from ``start``."""

    start: int
    rows: int
    width: int

    @property
    def span(self) -> slice:
        return slice(self.start, self.start + self.rows * self.width)


@dataclass(frozen=True)
class Layout:
    """A batch's tokens in the stream: ``runs`` over its first ``tokens`` rows; ``index``,
    where unpadded, each one's position in the padded batch flat ([rows x width])."""

    shape: tuple[int, int]  # the padded batch's (rows, width)
    runs: tuple[Run, ...]
    index: torch.Tensor | None = None

    @classmethod
    def padded(cls, mask: torch.Tensor) -> Layout:
        rows, width = mask.shape
        return cls((rows, width), (Run(0, rows, width),))

    @classmethod
    def unpadded(cls, mask: torch.Tensor) -> Layout:
        """The real tokens of ``mask`` ([rows, width], nonzero at real tokens), rows longest
        first (ties in their order), each row's tokens in their order."""
        real = mask.bool()
        lengths = real.sum(1)
        order = torch.argsort(lengths, descending=True, stable=True)
        row, column = real[order].nonzero(as_tuple=True)
        index = order[row] * mask.shape[1] + column
        widths, counts = torch.unique_consecutive(lengths[order], return_counts=True)
        runs, start = [], 0
        for width, rows in zip(widths.tolist(), counts.tolist(), strict=True):
            if width:
                runs.append(Run(start, rows, width))
            start += rows * width
        return cls(tuple(mask.shape), tuple(runs), index)

    @property
    def tokens(self) -> int:
        """Rows of the stream that hold the batch's tokens (zero rows may follow)."""
        return self.runs[-1].span.stop if self.runs else 0

    def masks(self, mask: torch.Tensor) -> list[torch.Tensor]:
        """Each run's attention mask: the batch's ``mask`` where padded (one run); where
        unpadded, one row of ones a run (every key real, every row alike: what is built from
        it, once, serves all the run's rows, ``ProductLayer._attend``)."""
        if self.index is None:
            return [mask]
        return [torch.ones((1, run.width), dtype=torch.long) for run in self.runs]

    def first_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each row's first token lies in the stream, run by run, and that row's place
        in the batch."""
        starts = [torch.arange(run.rows) * run.width + run.start for run in self.runs]
        at = torch.cat(starts) if starts else torch.zeros(0, dtype=torch.long)
        padded = at if self.index is None else self.index[at]  # in the padded batch, flat
        return at, padded // self.shape[1]

    def flat(self, x: torch.Tensor) -> torch.Tensor:
        """The padded batch's [rows, width, ...] (its ids, or states) as the stream's
        [tokens, ...]."""
        x = x.reshape(-1, *x.shape[2:])
        return x if self.index is None else x[self.index]

    def batch(self, x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The stream's first ``tokens`` rows as the padded batch's [rows, width, hidden] in
        ``dtype`` (zeros at the padding where unpadded; cast before it is padded)."""
        rows, width = self.shape
        x = x[: self.tokens].to(dtype)
        if self.index is None:
            return x.view(rows, width, -1)
        out = x.new_zeros((rows * width, x.shape[-1]))
        out[self.index] = x
        return out.view(rows, width, -1)


class PaddedStates(Sequence[torch.Tensor]):
    """A forward's states of every layer as the padded batch's (``Layout.batch``), each padded
    when read, the last one given as it is: what reads a few layers (a pooler's ``layers``)
    pays for those alone. Read each once: a second read pads again."""

    def __init__(self, layout: Layout, states: Sequence[torch.Tensor], last: torch.Tensor
                 ) -> None:
        self._layout, self._states, self._last = layout, states, last

    def __len__(self) -> int:
        return len(self._states) + 1

    def __getitem__(self, i: int | slice) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        if not -len(self) <= i < len(self):
            raise IndexError(f"layer {i} of {len(self)} states")
        i %= len(self)
        return self._last if i == len(self._states) else self._layout.batch(self._states[i])
