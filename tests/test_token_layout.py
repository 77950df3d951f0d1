"""A batch's real tokens alone in the fused forward's stream (pipeline.token_layout): where they
lie, and a text's states that do not depend on its batch-mates."""

from __future__ import annotations

import pytest
import torch

from pipeline import attention
from pipeline.fused_bert import FusedBert
from pipeline.token_layout import Layout, PaddedStates, Run
from tests.test_fused_bert import batch, tiny

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="this torch has no oneDNN")


def test_unpadded_runs_hold_each_real_token_once_rows_longest_first() -> None:
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 0, 0], [1, 0, 0, 0]])
    layout = Layout.unpadded(mask)
    # rows 1 (4 tokens), then 0 and 3 (2 each, in their order), then 4; row 2 has none
    assert layout.runs == (Run(0, 1, 4), Run(4, 2, 2), Run(8, 1, 1))
    assert layout.index.tolist() == [4, 5, 6, 7, 0, 1, 12, 13, 16]
    assert layout.tokens == 9 == int(mask.sum())
    # one row of ones a run, which all its rows share
    assert [(tuple(m.shape), bool(m.all())) for m in layout.masks(mask)] == [
        ((1, 4), True), ((1, 2), True), ((1, 1), True)]
    ids = torch.arange(20).view(5, 4)  # a batch's ids or states: its real tokens in order
    assert layout.flat(ids).tolist() == layout.index.tolist()
    x = torch.arange(20.0).view(5, 4, 1)
    flat = layout.flat(x)
    assert flat.view(-1).tolist() == layout.index.float().tolist()
    back = layout.batch(torch.cat([flat, torch.full((7, 1), 99.0)]))  # zero rows after: not read
    assert torch.equal(back, x * mask[..., None])  # zeros at the padding
    narrow = layout.batch(flat.bfloat16())  # a bf16 stream comes back as fp32 states
    assert narrow.dtype == torch.float32 and torch.equal(narrow, back)


def test_padded_states_pad_the_layer_read_and_index_like_a_tuple() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    layout = Layout.unpadded(mask)
    streams = [torch.full((5, 1), float(i)) for i in range(3)]  # 5 tokens; then the last
    last = torch.full((2, 3, 1), 9.0)
    states = PaddedStates(layout, streams, last)
    assert len(states) == 4 and states[-1] is last and states[3] is last
    want = [layout.batch(s) for s in streams]
    assert all(torch.equal(states[i], want[i]) for i in range(3))
    assert torch.equal(states[-4], want[0]) and states[1].dtype == torch.float32
    assert [float(t.sum()) for t in states[1:3]] == [5.0, 10.0]  # zeros at the padding
    assert len(list(states)) == 4
    with pytest.raises(IndexError):
        states[4]


def test_padded_layout_is_the_batch_as_it_is() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    layout = Layout.padded(mask)
    assert layout.runs == (Run(0, 2, 3),) and layout.tokens == 6
    (only,) = layout.masks(mask)
    assert only is mask
    x = torch.randn(2, 3, 4)
    assert torch.equal(layout.batch(layout.flat(x)), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("amx", [True, False])
def test_a_rows_states_are_the_same_bit_for_bit_whatever_its_batch_mates(
        monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, amx: bool) -> None:
    """A row of 20 tokens alone, beside rows of its length and beside rows of 40 and 70 (past
    the width where AMX's bf16 attention leaves the blocked products for SDPA, and the padded
    keys a wider batch would append): the same states, bit for bit."""
    monkeypatch.setattr(attention, "amx_here", lambda: amx)
    fused = FusedBert.from_model(tiny(max_position_embeddings=80), onednn_fp32=True)
    fused.pack(dtype)
    assert fused.unpadded_below() > 70
    ids, mask = batch(rows=6, width=70)
    mask[1:] = 0
    mask[1:3, :20], mask[3, :40], mask[4, :70], mask[5, :3] = 1, 1, 1, 1
    ids = ids.masked_fill(mask == 0, 0)
    with torch.inference_mode():
        alone = fused(ids[1:2, :20], mask[1:2, :20], output_hidden_states=True).hidden_states
        among = fused(ids, mask, output_hidden_states=True).hidden_states
    for one, many in zip(alone, among, strict=True):
        assert torch.equal(one[0], many[1, :20])
        assert not bool(many[1, 20:].any())  # padding: zeros
