"""The feed-forward block in int8 (pipeline/int8_ffn.py): both products int8, the first writing
the uint8 the second reads, the few channels far wider than the rest in fp32 apart."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline.int8_ffn import MAX_OUTLIERS, Int8FeedForward, outlier_channels
from pipeline.int8_linear import calibrate, onednn_int8_available

needs_int8 = pytest.mark.skipif(not onednn_int8_available(),
                                reason="no oneDNN int8 product or no native bf16 on this CPU")
HIDDEN, INNER = 64, 256


def test_outlier_channels_are_the_few_far_wider_than_the_rest() -> None:
    span = torch.ones(64)
    assert outlier_channels(span).tolist() == []
    span[[3, 40]] = torch.tensor([2.5, 9.0])
    assert sorted(outlier_channels(span).tolist()) == [3, 40]
    span[:12] = 5.0  # more wide channels than are ever taken apart: the widest is one of many
    assert outlier_channels(span).tolist() == []
    assert outlier_channels(torch.tensor([9.0, 1.0])).tolist() == []  # too few channels to tell
    wide = torch.arange(1.0, 33.0)
    wide[:MAX_OUTLIERS + 2] = 100.0  # never more than MAX_OUTLIERS
    assert len(outlier_channels(wide)) <= MAX_OUTLIERS


class Block(torch.nn.Module):
    """A feed-forward block in int8, called as ``calibrate`` calls a model."""

    def __init__(self, up: torch.nn.Linear, down: torch.nn.Linear, gelu: str = "none") -> None:
        super().__init__()
        self.ffn = Int8FeedForward(up, down, gelu)

    def forward(self, x: torch.Tensor, _mask: torch.Tensor) -> torch.Tensor:
        return self.ffn(x)


def _linears(outliers: list[int]) -> tuple[torch.nn.Linear, torch.nn.Linear]:
    torch.manual_seed(0)
    up, down = torch.nn.Linear(HIDDEN, INNER), torch.nn.Linear(INNER, HIDDEN)
    with torch.no_grad():
        up.weight[outliers] *= 30  # these channels' GELU output spans ~30 times the others'
    return up, down


def _error(block: Block, up: torch.nn.Linear, down: torch.nn.Linear, x: torch.Tensor) -> float:
    expected = x + down(F.gelu(up(x), approximate=block.ffn.gelu))
    with torch.inference_mode():
        return float((block.ffn(x) - expected).norm() / (expected - x).norm())


@needs_int8
@pytest.mark.parametrize("gelu", ["none", "tanh"])
def test_the_block_takes_wide_channels_apart_and_stays_close_to_fp32(gelu: str) -> None:
    up, down = _linears([7, 100])
    batches = [(torch.randn(4, 16, HIDDEN), torch.ones(4, 16)) for _ in range(3)]
    x = torch.randn(2, 9, HIDDEN)
    block, single_scale = Block(up, down, gelu), Block(up, down, gelu)
    block.ffn.settle(calibrate(block, batches))
    assert block.ffn.outliers is not None and len(block.ffn.outliers[1]) == 2
    assert block.ffn.up.output_qparams == block.ffn.down.input_qparams  # uint8 from up to down
    with torch.inference_mode():
        assert block.ffn.up(x).dtype == torch.uint8
        assert block.ffn(x).dtype == torch.float32
    with pytest.raises(ValueError, match="settled already"):
        block.ffn.settle({})
    calibrate(single_scale, batches)  # the same block, every channel under one scale
    single_scale.ffn.up.feed(single_scale.ffn.down)
    apart, together = _error(block, up, down, x), _error(single_scale, up, down, x)
    assert apart < 0.02 and apart < together / 4  # measured: 0.004 against 0.048


@needs_int8
def test_a_block_without_wide_channels_keeps_every_channel_in_int8() -> None:
    up, down = _linears([])
    block = Block(up, down)
    block.ffn.settle(calibrate(block, [(torch.randn(4, 16, HIDDEN), torch.ones(4, 16))]))
    assert block.ffn.outliers is None
    assert _error(block, up, down, torch.randn(2, 9, HIDDEN)) < 0.05
