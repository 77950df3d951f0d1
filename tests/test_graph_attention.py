"""Attention through oneDNN Graph (pipeline.graph_attention) is attention, fused on every call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline import attention, graph_attention
from pipeline.attention import attention_bias
from pipeline.fused_bert import FusedBert
from tests.test_fused_bert import batch, real, tiny

pytestmark = pytest.mark.skipif(not graph_attention.available(),
                                reason="this torch has no oneDNN Graph fuser")


def views(rows: int, width: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q, k, v as the fused layer hands them over: strided views of one product's output, the
    query scaled by 1/sqrt(head)."""
    torch.manual_seed(rows * 1000 + width)
    qkv = torch.randn(rows, width, 3, 4, 16)
    qkv[:, :, 0] *= 16**-0.5
    return tuple(qkv.to(dtype).permute(2, 0, 3, 1, 4))


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None
         ) -> torch.Tensor:
    """The reference in fp32, as [rows, tokens, heads x head]."""
    rows, heads, width, dim = q.shape
    mask = None if bias is None else bias[..., :width].float()
    out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                         scale=1.0)
    return out.transpose(1, 2).reshape(rows, width, heads * dim)


@pytest.mark.parametrize("width", [97, 128, 150])  # keys padded up to a step; a whole step
@pytest.mark.parametrize("rows", [13, 3])  # blocks of 8 and 5 rows; one block
def test_graph_attention_is_attention(width: int, rows: int) -> None:
    _, mask = batch(rows=rows, width=width)
    for case in (mask, torch.ones_like(mask)):
        q, k, v = views(rows, width, torch.float32)
        bias = attention_bias(case, torch.float32, graph_attention.key_width(width))
        got = graph_attention.graph_attention(q, k, v, bias)
        assert got.shape == (rows, width, 64) and got.dtype == torch.float32
        torch.testing.assert_close(got, sdpa(q, k, v, bias), atol=1e-5, rtol=1e-5)
        q, k, v = views(rows, width, torch.bfloat16)
        bias = attention_bias(case, torch.bfloat16, graph_attention.key_width(width))
        got = graph_attention.graph_attention(q, k, v, bias)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), sdpa(q, k, v, bias), atol=0.05, rtol=0.02)
        # the same rounding as the blocked products it replaces (scores in bf16 both ways)
        blocked = torch.empty((rows, width, 4, 16), dtype=torch.bfloat16)
        attention._blocked_attention(q, k, v, bias, blocked)
        torch.testing.assert_close(got.float(), blocked.view_as(got).float(), atol=4e-3,
                                   rtol=0.02)


def test_every_call_runs_one_fused_kernel_per_block_of_rows() -> None:
    """TorchScript's executor falls back to unfused ops past a dozen shapes per traced
    function; keyed by input signature, every shape keeps its fused kernel."""
    for dtype in (torch.bfloat16, torch.float32):
        for width in (128, 150, 255, 256):
            for rows in (1, 5, 8, 13, 33):
                q, k, v = views(rows, width, dtype)
                bias = attention_bias(batch(rows=rows, width=width)[1], dtype,
                                      graph_attention.key_width(width))
                for _ in range(2):  # the executor profiles, then optimises
                    graph_attention.graph_attention(q, k, v, bias)
                with torch.profiler.profile() as profile:
                    graph_attention.graph_attention(q, k, v, bias)
                fused = sum(event.count for event in profile.key_averages()
                            if event.key.startswith("LlgaPartition"))
                assert fused == -(-rows // graph_attention.ROW_BLOCK), (dtype, width, rows)


def test_a_shapes_first_call_gives_its_later_calls_bits() -> None:
    """The executor ran a new shape's first calls unfused: in fp32 those came out a last bit
    (1e-6) apart from every later call's, so a text's vector followed how many batches of its
    shape ran before it."""
    graph_attention._traced.cache_clear()
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = views(8, 160, dtype)
        first, *later = (graph_attention.graph_attention(q, k, v, None) for _ in range(3))
        for out in later:
            torch.testing.assert_close(first, out, atol=0, rtol=0)


@pytest.mark.parametrize("enabled", [False, True])
def test_the_fusers_switch_is_left_as_the_caller_set_it(enabled: bool) -> None:
    before = torch.jit.onednn_fusion_enabled()
    torch.jit.enable_onednn_fusion(enabled)
    try:
        graph_attention.graph_attention(*views(2, 128, torch.float32), None)
        assert torch.jit.onednn_fusion_enabled() is enabled
    finally:
        torch.jit.enable_onednn_fusion(before)


def test_runs_only_over_wide_rows_where_it_is_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(graph_attention, "_faster_here", lambda: True)
    assert graph_attention.runs(graph_attention.MIN_KEYS)
    assert not graph_attention.runs(graph_attention.MIN_KEYS - 1)
    monkeypatch.setattr(graph_attention, "_faster_here", lambda: False)
    assert not graph_attention.runs(512)


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_the_fused_model_over_long_rows_matches_the_models_own(
        monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """The fused forward with its attention through oneDNN Graph (whatever this CPU) gives
    transformers' states in fp32, and bf16 states close to them (where AMX runs, both dtypes
    take SDPA instead: not here)."""
    monkeypatch.setattr(graph_attention, "_faster_here", lambda: True)
    monkeypatch.setattr(attention, "amx_here", lambda: False)
    model = tiny(kind, max_position_embeddings=300)
    ids, mask = batch(rows=11, width=200)
    calls = []
    fused_attention = graph_attention.graph_attention

    def counted(*args: torch.Tensor | None) -> torch.Tensor:
        calls.append(args[0].dtype)
        return fused_attention(*args)

    monkeypatch.setattr(graph_attention, "graph_attention", counted)
    with torch.inference_mode():
        want = model(input_ids=ids, attention_mask=mask).last_hidden_state
        fused = FusedBert.from_model(model, onednn_fp32=True)
        got = fused(ids, mask).last_hidden_state
        torch.testing.assert_close(real(got, mask), real(want, mask), atol=3e-5, rtol=1e-4)
        fused.pack(torch.bfloat16)
        half = fused(ids, mask).last_hidden_state
    assert calls == [torch.float32] * 3 + [torch.bfloat16] * 3  # every layer, both forwards
    cosine = F.cosine_similarity(real(half, mask), real(want, mask), dim=-1)
    assert cosine.min() > 0.999


def test_the_forwards_bias_is_built_for_the_kernels_keys(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Once a forward, not once a layer: the bias already spans the kernel's padded keys."""
    monkeypatch.setattr(graph_attention, "_faster_here", lambda: True)
    monkeypatch.setattr(attention, "amx_here", lambda: False)
    _, mask = batch(rows=3, width=150)
    bias = attention_bias(mask, torch.bfloat16)
    assert bias.shape == (3, 1, 1, graph_attention.key_width(150)) == (3, 1, 1, 160)
    assert (bias[..., 150:] < -1e38).all()
    with pytest.raises(ValueError, match="this kernel takes 160"):
        graph_attention.graph_attention(*views(3, 150, torch.bfloat16), bias[..., :150])
