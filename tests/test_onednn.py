"""Linear layers through oneDNN (pipeline.onednn): fp32 where the CPU probe measured it faster,
weights packed once where the dtype is fixed."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import pipeline.encoder
import pipeline.fused_bert
import pipeline.onednn
from pipeline import hardware
from pipeline.config import EncoderConfig, PoolerSpec
from pipeline.embedder import Embedder
from pipeline.onednn import (
    FUSED_MIN_GAIN,
    MIN_GAIN,
    OneDnnLinear,
    PackedLinear,
    pack_linears,
    packs,
    use_onednn_linear,
)

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="this torch has no oneDNN")
TEXTS = ["a tiny text", "another one, a little longer than the first", "x " * 60]


def test_the_probe_times_fp32_through_onednn_too() -> None:
    figures = hardware._run_probe(dict(os.environ))  # the real probe, in its own process
    assert figures is not None
    assert figures["fp32_gflops"] > 0
    assert all(figures[name] > 0 for name in hardware.FP32_KERNEL_FIGURES)


def test_onednn_is_used_only_where_the_probe_measured_it_faster(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def profile(onednn: float | None, onednn_gelu: float | None = None):
        monkeypatch.setattr(hardware, "cpu_profile", lambda: {
            "fp32_gflops": 200.0, "fp32_onednn_gflops": onednn,
            "fp32_gelu_gflops": 150.0, "fp32_onednn_gelu_gflops": onednn_gelu})
    profile(200.0 * MIN_GAIN)
    assert hardware.cpu_fp32_onednn_is_faster(MIN_GAIN)
    profile(200.0 * MIN_GAIN * 0.99)  # about as fast: keep torch's default, bit for bit
    assert not hardware.cpu_fp32_onednn_is_faster(MIN_GAIN)
    assert hardware.cpu_fp32_onednn_is_faster(FUSED_MIN_GAIN)
    profile(None)  # a torch without oneDNN, or a probe that could not time it
    assert not hardware.cpu_fp32_onednn_is_faster(FUSED_MIN_GAIN)
    # the fused forward weighs its up product as it runs it: bias and GELU included
    profile(190.0, onednn_gelu=160.0)  # bare a little slower, with its epilogue faster
    assert not hardware.cpu_fp32_onednn_is_faster(FUSED_MIN_GAIN)
    assert hardware.cpu_fp32_onednn_is_faster(FUSED_MIN_GAIN, fused=True)
    profile(210.0, onednn_gelu=140.0)
    assert hardware.cpu_fp32_onednn_is_faster(FUSED_MIN_GAIN)
    assert not hardware.cpu_fp32_onednn_is_faster(FUSED_MIN_GAIN, fused=True)
    profile(210.0, onednn_gelu=None)
    assert not hardware.cpu_fp32_onednn_is_faster(FUSED_MIN_GAIN, fused=True)


def test_a_onednn_linear_is_the_linear_in_fp32_and_exactly_it_otherwise() -> None:
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    fast = copy.deepcopy(plain)
    reference = {k: v.clone() for k, v in plain.state_dict().items()}
    x = torch.randn(3, 5, 32)
    with torch.inference_mode():
        want = plain(x)
        assert use_onednn_linear(fast) == 2
        assert all(type(m) is OneDnnLinear for m in (fast[0], fast[2]))
        torch.testing.assert_close(fast(x), want, atol=1e-5, rtol=1e-5)
        assert fast(torch.randn(0, 32)).shape == (0, 8)  # empty batch: torch's own kernel
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the bf16 path is torch's own
            assert torch.equal(fast(x), plain(x))
    assert all(type(m) is torch.nn.Linear for m in (plain[0], plain[2]))  # a copy was turned
    assert fast.state_dict().keys() == reference.keys()
    assert all(torch.equal(fast.state_dict()[k], v) for k, v in reference.items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linears_compute_the_linears_products(dtype: torch.dtype) -> None:
    if not packs(dtype, onednn_fp32=True):
        pytest.skip(f"this CPU or torch packs no {dtype} weights for oneDNN")
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 8, bias=False)).to(dtype)
    packed = copy.deepcopy(plain)
    assert pack_linears(packed, dtype) == 2
    assert [type(m) for m in packed] == [PackedLinear, torch.nn.GELU, PackedLinear]
    x = torch.randn(3, 5, 32).to(dtype)
    with torch.inference_mode():
        want = [torch.ops.mkldnn._linear_pointwise(x, plain[0].weight, plain[0].bias, "none",
                                                   [], "")]
        want.append(torch.ops.mkldnn._linear_pointwise(F.gelu(want[0]), plain[2].weight, None,
                                                       "none", [], ""))
        assert torch.equal(packed[0](x), want[0])  # the plain weight's product, bit for bit
        assert torch.equal(packed(x), want[1])
        assert packed(torch.randn(0, 32)).shape == (0, 8)  # an empty batch
        gelu = PackedLinear(plain[0], dtype, gelu="tanh")(x)
        torch.testing.assert_close(gelu, F.gelu(want[0], approximate="tanh"), atol=1e-2,
                                   rtol=1e-2)
        for approximate in ("none", "tanh"):  # ATen's GELU after the product: exactly that
            apart = PackedLinear(plain[0], dtype, gelu=approximate, gelu_apart=True)
            assert torch.equal(apart(x), F.gelu(want[0], approximate=approximate))
        residual = torch.randn(3, 5, 64).to(dtype)
        with_residual = torch.ops.mkldnn._linear_pointwise.binary(x, residual, plain[0].weight,
                                                                   plain[0].bias, "add")
        # added in the epilogue; in fp32 after the product (binary_after), the same bits
        assert packed[0].binary_after == (dtype == torch.float32)
        assert torch.equal(packed[0](x, residual), with_residual)
        if dtype == torch.float32:  # as the add after the product, bit for bit
            assert torch.equal(with_residual, want[0] + residual)
        else:  # rounded to bf16 once, not twice
            torch.testing.assert_close(with_residual, want[0] + residual, atol=2e-2, rtol=2e-2)
        gate = torch.randn(3, 5, 64).to(dtype)
        gated = packed[0](x, gate, "mul")  # multiplied in the epilogue
        if dtype == torch.float32:  # as the multiply after the product, bit for bit
            assert torch.equal(gated, want[0] * gate)
        else:
            torch.testing.assert_close(gated, want[0] * gate, atol=2e-2, rtol=2e-2)
        with pytest.raises(ValueError, match="binary add follows no activation"):
            PackedLinear(plain[0], dtype, gelu="none")(x, residual)
        with pytest.raises(ValueError, match="binary mul follows no activation"):
            PackedLinear(plain[0], dtype, gelu="none", gelu_apart=True)(x, gate, "mul")


def test_a_model_that_keeps_its_own_forward_is_packed_once_its_dtype_is_fixed(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' forward (here: the fused forward turned off) in bf16 over packed weights
    gives what it gave over weights cast to bf16."""
    monkeypatch.setattr(pipeline.fused_bert, "fusable", lambda config, device: False)

    def embedder() -> Embedder:
        cfg = EncoderConfig(model=str(tiny_model_dir), dtype="bf16", device="cpu")
        return Embedder(cfg, [PoolerSpec(name="mean")])

    packed = embedder()
    assert not packed.encoder.fused
    linears = [m for m in packed.encoder.model.modules()
               if isinstance(m, (torch.nn.Linear, PackedLinear))]
    kinds = {type(m) for m in linears}
    assert kinds == ({PackedLinear} if packs(torch.bfloat16, False) else {torch.nn.Linear})
    monkeypatch.setattr(pipeline.encoder, "packs", lambda dtype, onednn_fp32: False)
    cast = embedder()
    assert all(m.weight.dtype == torch.bfloat16 for m in cast.encoder.model.modules()
               if isinstance(m, torch.nn.Linear))
    got, want = packed.encode(TEXTS), cast.encode(TEXTS)
    cosines = (got * want).sum(axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosines.min() > 0.99999  # bit for bit on the CPUs measured; kernels may round apart


def test_the_encoder_uses_onednn_in_fp32_only_where_it_wins(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def embedder(onednn_gflops: float, fuse: bool = True, apart_gflops: float = 0.0
                 ) -> Embedder:
        """oneDNN's up product with its GELU in its epilogue weighed as its bare product,
        with ATen's GELU after it at ``apart_gflops`` (MKL's with GELU: the bare one's 200);
        not ``fuse``: transformers' own forward."""
        monkeypatch.setattr(hardware, "cpu_profile", lambda: {
            "fp32_gflops": 200.0, "fp32_onednn_gflops": onednn_gflops, "bf16_gflops": 200.0,
            "fp32_gelu_gflops": 200.0, "fp32_onednn_gelu_gflops": onednn_gflops,
            "fp32_onednn_gelu_apart_gflops": apart_gflops, "bf16_ok": True,
            "amx_traps": False})
        cfg = EncoderConfig(model=str(tiny_model_dir), dtype="fp32", device="cpu")
        with monkeypatch.context() as patch:
            if not fuse:
                patch.setattr(pipeline.fused_bert, "fusable", lambda config, device: False)
            return Embedder(cfg, [PoolerSpec(name="mean")])

    def kernels(onednn_gflops: float) -> tuple[str, str]:
        """(the fused forward's fp32 kernel, that of a model that keeps its own forward)"""
        fused, own = embedder(onednn_gflops), embedder(onednn_gflops, fuse=False)
        assert fused.encoder.fused and not own.encoder.fused
        turned = any(isinstance(m, PackedLinear) for m in own.encoder.model.modules())
        assert turned == (own.encoder.fp32_kernel == "onednn")  # packed once fp32 was chosen
        return fused.encoder.fp32_kernel, own.encoder.fp32_kernel

    assert kernels(190.0) == ("default", "default")
    # as fast or a little faster: the fused forward gains oneDNN's fused bias and GELU too;
    # transformers' forward keeps torch's default kernel, bit for bit
    assert kernels(220.0) == ("onednn", "default")
    assert kernels(260.0) == ("onednn", "onednn")
    default, fast = embedder(190.0), embedder(260.0)
    np.testing.assert_allclose(fast.encode(TEXTS), default.encode(TEXTS), atol=1e-6)
    assert fast.fingerprint("mean") == default.fingerprint("mean")  # the same set
    assert not any(isinstance(m, OneDnnLinear) for m in fast.encoder.model.modules())
    assert all(layer.onednn_fp32 for layer in fast.encoder.model.layers)
    assert {layer.up.gelu_after for layer in fast.encoder.model.layers} == {None}
    # where ATen's GELU after oneDNN's product won (oneDNN on AVX2), it runs that way, and
    # where that alone beats MKL, oneDNN is chosen for it
    for epilogue in (260.0, 190.0):
        apart = embedder(epilogue, apart_gflops=epilogue * 1.2)
        assert apart.encoder.fp32_kernel == "onednn"
        assert {layer.up.gelu_after for layer in apart.encoder.model.layers} == {"none"}
        np.testing.assert_allclose(apart.encode(TEXTS), default.encode(TEXTS), atol=1e-6)
    close = embedder(260.0, apart_gflops=260.0 * 1.02)  # within the probe's noise
    assert {layer.up.gelu_after for layer in close.encoder.model.layers} == {None}


@pytest.mark.parametrize(("dies_after", "expected"), [
    (1, None),  # bf16 never measured: taken as a trap (the caller re-probes with AMX capped)
    (2, {"fp32_gflops": 1.0, "bf16_gflops": 2.0} | dict.fromkeys(hardware.FP32_KERNEL_FIGURES)),
    (3, {"fp32_gflops": 1.0, "bf16_gflops": 2.0} | dict.fromkeys(hardware.FP32_KERNEL_FIGURES)
     | {"fp32_onednn_gflops": 3.0}),
])
def test_the_probe_output_is_read_line_by_line(
        monkeypatch: pytest.MonkeyPatch, dies_after: int, expected: dict | None) -> None:
    """Figures printed before a crash count, a missing oneDNN figure is None, and only a
    missing bf16 figure reads as bf16 trapping."""
    names = ["fp32_gflops", "bf16_gflops", "fp32_onednn_gflops"]
    lines = "; ".join(f"print(MARK + json.dumps({{{names[i]!r}: {i + 1}.0}}), flush=True)"
                      for i in range(dies_after))
    monkeypatch.setattr(hardware, "_PROBE", f"import json, os; {lines}; os.abort()")
    assert hardware._run_probe(dict(os.environ)) == expected


def test_amx_runs_only_where_advertised_and_not_trapping(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    for advertised, traps, runs in ((True, False, True), (True, True, False),
                                    (False, False, False)):
        monkeypatch.setattr(hardware, "_advertises_amx", lambda a=advertised: a)
        monkeypatch.setattr(hardware, "cpu_profile", lambda t=traps: {"amx_traps": t})
        assert hardware.amx_runs() is runs
