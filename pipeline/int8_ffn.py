"""A BERT layer's feed-forward block (up, GELU, down) in int8, its few outlier channels in fp32.

The block's second product reads the GELU output, four times wider than the hidden state. In
int8 it costs half the bf16 product (MiniLM's, [4,096 x 1,536] x [1,536 x 384] on a 2-core
AVX512-BF16 VM: 2.5 against 5.3 ms) if nothing quantizes that output on its own pass: the first
product writes it as uint8 itself, quantized in its epilogue with the scale the second one reads
(``Int8Linear.feed``; 3.2 ms, 3.7 with a bf16 output).

One scale covers a whole tensor, and a few of the GELU output's channels span far more than the
rest: MiniLM over 1,000 PyPI summaries, the widest channel's largest value by layer 24.8, 20.4,
17.5 (the second 14.7), 13.8, 8.5, 8.4 against 5.3, 5.1, 5.1, 4.7, 6.4, 4.4 for the ninth. Those
channels (``outlier_channels``: at most ``MAX_OUTLIERS`` a layer, each ``OUTLIER_FACTOR`` times
wider than the ``MAX_OUTLIERS + 1``-th widest) leave the int8 products (their weights zeroed:
GELU(0) = 0 adds nothing) and go through a small fp32 product of their own, added onto the
residual; the scale then covers the rest. On 2,000 summaries (MiniLM), cosine to fp32: the
second product in bf16 min 0.9797 / mean 0.9963; in int8 with one scale for all 0.9612 /
0.9929; with the outliers apart 0.9787 / 0.9958, as fast as without (one channel in three of
the six layers, two in a fourth, none in the last two).
"""

from __future__ import annotations

from collections.abc import Mapping
from copy import deepcopy

import torch
import torch.nn.functional as F

from pipeline.int8_linear import ChannelRanges, Int8Linear, uint8_qparams

MAX_OUTLIERS = 8  # channels per layer
OUTLIER_FACTOR = 2.0  # times the widest channel that stays


def outlier_channels(span: torch.Tensor) -> torch.Tensor:
    """The indices of the channels whose ``span`` (largest magnitude, one per channel) is over
    ``OUTLIER_FACTOR`` times the ``MAX_OUTLIERS + 1``-th largest: at most ``MAX_OUTLIERS``."""
    if len(span) <= MAX_OUTLIERS:
        return torch.empty(0, dtype=torch.long)
    top = span.sort(descending=True)
    widest = top.values[:MAX_OUTLIERS]
    return top.indices[:MAX_OUTLIERS][widest > OUTLIER_FACTOR * top.values[MAX_OUTLIERS]]


class Int8FeedForward(torch.nn.Module):
    """``x + down(GELU(up(x)))`` (fp32 ``x``) with both products in int8 once ``settle``d: up
    writes uint8 that down reads as it is; the outlier channels in fp32 apart. Until then
    (calibration) up writes bf16 and each product scales its input per batch."""

    def __init__(self, up: torch.nn.Linear, down: torch.nn.Linear, gelu: str) -> None:
        super().__init__()
        self.gelu = gelu  # torch's and oneDNN's name alike: "none" or "tanh"
        self.up, self.down = Int8Linear(up, gelu=gelu), Int8Linear(down)
        self.linears: tuple[torch.nn.Linear, torch.nn.Linear] | None = (up, down)
        self.outliers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def settle(self, ranges: Mapping[Int8Linear, ChannelRanges]) -> None:
        """Fix the products from the input ranges ``calibrate`` returned: the outlier channels
        of down's input taken apart, up feeding down its uint8."""
        if self.linears is None:
            raise ValueError("this feed-forward block is settled already")
        (up, down), self.linears = self.linears, None
        low, high = ranges[self.down]
        apart = outlier_channels(torch.maximum(low.abs(), high.abs()))
        if len(apart):
            kept = torch.ones(len(low), dtype=torch.bool)
            kept[apart] = False
            qparams = self.up.input_qparams
            self.up, self.down = (Int8Linear(_zeroed(up, rows=apart), gelu=self.gelu),
                                  Int8Linear(_zeroed(down, columns=apart)))
            self.up.input_qparams = qparams
            self.down.input_qparams = uint8_qparams(float(low[kept].min()),
                                                    float(high[kept].max()))
            self.outliers = (up.weight[apart].float(), up.bias[apart].float(),
                             down.weight[:, apart].float().T.contiguous())
        self.up.feed(self.down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down(self.up(x))
        if self.outliers is None:
            return x + out
        up_weight, up_bias, down_weight = self.outliers
        apart = F.gelu(F.linear(x, up_weight, up_bias), approximate=self.gelu)
        flat = torch.addmm(x.reshape(-1, x.shape[-1]), apart.reshape(-1, len(up_bias)),
                           down_weight)
        return flat.view_as(x) + out


def _zeroed(linear: torch.nn.Linear, rows: torch.Tensor | None = None,
            columns: torch.Tensor | None = None) -> torch.nn.Linear:
    """A copy of ``linear`` with the weights of output ``rows`` (and their bias) or input
    ``columns`` zeroed."""
    copy = deepcopy(linear)
    with torch.no_grad():
        if rows is not None:
            copy.weight[rows], copy.bias[rows] = 0, 0
        if columns is not None:
            copy.weight[:, columns] = 0
    return copy
