"""Linear layers through oneDNN: fp32 where its kernel beats torch's default one, and, once a
CPU run's dtype is fixed, products over weights packed once (``PackedLinear``).

torch's CPU ``F.linear`` in fp32 runs MKL's sgemm. On some CPUs MKL takes a narrower path than
the hardware has: on a 2-core AMD EPYC (Zen 5, AVX-512) VM, a [4096, 384] x [384, 1536]
product ran 214 GFLOP/s through MKL and 483-497 through oneDNN, which torch also ships (its bf16
products already run there, and Inductor emits this same op for frozen CPU graphs). The CPU
probe (``pipeline.hardware``) times both once per machine; where oneDNN is >= ``MIN_GAIN``
faster, the encoder's Linear layers become ``OneDnnLinear``: fp32 inputs go through
``torch.ops.mkldnn._linear_pointwise``, anything else (autocast, half weights) through
``nn.Linear`` as before. Vectors stay fp32: MiniLM's cosine to the default kernel >= 0.9999999
(3,000 summaries: 514 -> 943 docs/s). Where MKL is as fast, nothing changes.

The fused forward (``pipeline.fused_bert``) calls oneDNN's product itself and takes it where it
runs at least as fast as MKL's (``FUSED_MIN_GAIN``): there oneDNN also adds the bias and applies
GELU in the product, where MKL's ``addmm`` first copies the bias into its [rows, out] output (a
pass over memory at 8,192-token batches) and GELU is a pass of its own. The probe weighs the two
as the forward runs its up product (a packed weight, bias and GELU: ``fp32_onednn_gelu_gflops``
against ``addmm`` then ``gelu``), not bare: on a 2-core AMX Xeon VM the bare products ran 373
(oneDNN, plain weight) against 405 GFLOP/s (MKL), which kept MKL, while with the epilogue
oneDNN won (312-354 against 179-318), and MiniLM's fp32 forward ran 300 long texts in
6.14-6.21 s instead of 6.59-7.26. With oneDNN and MKL
capped to AVX2 on that EPYC (the probe: oneDNN 230, MKL 203 GFLOP/s, 1.13x), MiniLM's fused
fp32 forward ran 3,000 summaries in 5.45-5.75 s instead of 5.87-6.18 and 300 long texts in
10.8-11.1 s instead of 11.8-12.0. Its products take their weights packed once into the
layout oneDNN's kernel reads (``PackedLinear``): over a plain weight the kernel repacks it on
every call.
"""

from __future__ import annotations

from typing import Literal

import torch

MIN_GAIN = 1.2  # oneDNN must beat MKL by this much to be used (else: bit-identical default)
FUSED_MIN_GAIN = 1.0  # the fused forward's products: oneDNN where it is as fast as MKL
ROW_STEP = 1024  # ``product_rows``: past this many rows, a multiple of it (or of an 8th octave)
MIN_ROWS = 16  # the smallest: a query's few tokens
Binary = Literal["add", "mul"]  # what a product's epilogue does with a second tensor


def product_rows(rows: int) -> int:
    """How many rows a product over ``rows`` rows runs through oneDNN (the rest zeros): a size
    from a short ladder, so that a run's products take a few shapes, each JIT-compiled once.

    oneDNN compiles a kernel for every shape it meets (4-7 ms for a [rows, 384] x [384, 1,536]
    bf16 product on a 2-core AMX Xeon VM, against 2-3 ms to run it) and keeps a bounded number
    (``pipeline.hardware.ONEDNN_CACHES``; each held ~1.7 MB there). A run's batches take a
    new number of rows almost every batch (3,000 PyPI summaries: 20 batches, 20 shapes, 4
    products each: 360 ms compiling against 650 running), and a long run's batch shapes recur
    too far apart for a bounded cache to keep them. The ladder: powers of two from ``MIN_ROWS`` up
    to ``ROW_STEP``, multiples of it up to 8 x ``ROW_STEP``, then 8 sizes an octave: 14 sizes
    up to 8,192."""
    if rows <= ROW_STEP:
        return max(MIN_ROWS, 1 << max(rows - 1, 0).bit_length())
    step = max(ROW_STEP, 1 << ((rows - 1).bit_length() - 3))
    return -(-rows // step) * step


class OneDnnLinear(torch.nn.Linear):
    """``nn.Linear`` whose fp32 product runs in oneDNN (same parameters, same state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.dtype == self.weight.dtype == torch.float32 and x.numel()
                and not torch.is_autocast_enabled(x.device.type)):
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return super().forward(x)


class PackedLinear(torch.nn.Module):
    """A Linear's product through oneDNN in ``dtype``, its weight reordered once into the
    blocked layout oneDNN's kernel reads (``_reorder_linear_weight``), the bias added and GELU
    (oneDNN's ``gelu`` algorithm: "none" exact, "tanh") applied in the product where given, or a
    residual added (a gate multiplied in) after the bias. The same arithmetic as
    ``_linear_pointwise`` over the plain weight, bit for bit (tested): only the reorder, which
    oneDNN's kernel otherwise repeats on every call, is gone. A [6,144 x 384] x [384 x 1,536]
    bf16 product took 12.8 ms over the plain weight and 10.7 ms over the packed one (oneDNN's
    verbose log, 2-core AVX512-BF16 EPYC VM). ``gelu_apart``: the GELU as ATen's pass in place
    after the product instead, where that was measured faster
    (``pipeline.hardware.fp32_gelu_apart``).

    In fp32 (``binary_after``) the residual or gate runs as ATen's pass in place over the
    product's output, the same result bit for bit: oneDNN's fp32 binary post-op was slower
    over a batch's rows, [4,096 x 384] x [384 x 384] + residual 5.46 ms against 5.15 (AVX2
    kernels) and 3.27 against 2.99 (AVX-512) on a 2-core AMX Xeon VM, while in bf16 the
    epilogue won (0.42 against 0.63 ms); at 512 rows the two were within 1.5% either way.
    MiniLM's fp32 encode: 300 long texts 9.42 -> 9.21 s capped to AVX2, 5.90 -> 5.71 s with
    AVX-512, 3,000 summaries 5.27 -> 5.07 s capped (see bench/RESULTS.md)."""

    def __init__(self, linear: torch.nn.Linear, dtype: torch.dtype, gelu: str | None = None,
                 gelu_apart: bool = False) -> None:
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().to(dtype),
                                                              None)
        self.bias = None if linear.bias is None else linear.bias.detach().to(dtype)
        in_epilogue = gelu is not None and not gelu_apart
        self.post_op, self.algorithm = ("gelu", gelu) if in_epilogue else ("none", "")
        self.gelu_after = gelu if gelu is not None and gelu_apart else None
        self.binary_after = dtype == torch.float32
        self.dtype, self.in_features, self.out_features = (dtype, linear.in_features,
                                                           linear.out_features)

    def forward(self, x: torch.Tensor, other: torch.Tensor | None = None,
                binary: Binary = "add") -> torch.Tensor:
        """The product, with ``other`` (in this product's dtype; no GELU here) added to it
        (``binary`` "add": a residual) or multiplied into it ("mul": a gate) where given: in
        its epilogue, oneDNN's binary post-op on the fp32 accumulator before the output is
        rounded, or, ``binary_after``, in place over the fp32 output."""
        x = x.to(self.dtype)
        if other is not None and (self.post_op != "none" or self.gelu_after is not None):
            raise ValueError(f"a binary {binary} follows no activation in one product")
        if other is None or self.binary_after:
            out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, self.post_op,
                                                     [], self.algorithm)
            if self.gelu_after is not None:
                torch.ops.aten.gelu_(out, approximate=self.gelu_after)
            if other is not None:
                return out.add_(other) if binary == "add" else out.mul_(other)
            return out
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.packed, self.bias,
                                                         binary)


def packs(dtype: torch.dtype, onednn_fp32: bool) -> bool:
    """Whether a CPU forward in ``dtype`` runs its products as ``PackedLinear`` here: bf16
    where torch reorders bf16 weights (a CPU with AVX512 or AVX-NE-CONVERT), fp32 where
    oneDNN's fp32 kernel is the one chosen (``onednn_fp32``; else MKL's, as before)."""
    if dtype == torch.float32:
        return onednn_fp32 and torch.backends.mkldnn.is_available()
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linears(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Turn every ``nn.Linear`` of ``model`` into a ``PackedLinear`` in ``dtype``, in place;
    how many (a model's dtype fixed: run under autocast in it, or in fp32)."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(module, name, PackedLinear(child, dtype))
                count += 1
    return count


def use_onednn_linear(model: torch.nn.Module) -> int:
    """Turn every ``nn.Linear`` of ``model`` into a ``OneDnnLinear`` in place; how many."""
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = OneDnnLinear  # no new state: the same weights, now in oneDNN
            count += 1
    return count
