"""int8 Linear layers through oneDNN's int8 inner product, for the fused CPU forward.

``Int8Linear`` keeps a Linear's weights as int8 with one scale per output channel (symmetric,
as ONNX Runtime's per-channel dynamic quantization) and quantizes its input on every call to
uint8 with one scale and zero point over the whole batch (as ONNX Runtime's
``DynamicQuantizeLinear``: no calibration data), then runs ``torch.ops.onednn.
qlinear_pointwise`` (VNNI / AMX int8 dot products) with the bias, a fused GELU where asked and a
bf16 output.

Only products whose input is hidden-size wide are quantized (``FusedLayer.to_int8``: query/key/
value, the attention output, the FFN's first product). Measured on a 2-core AVX512-BF16 VM, a
[6,144 x 384] x [384 x 1,536] product: int8 with bf16 output 3.9 ms, bf16 8.7 ms; quantizing
its fp32 input ~0.6 ms. The FFN's second product reads the 1,536-wide GELU output: quantizing it
(in bf16, 4x wider) costs about what int8 saves there, and it lowered the cosine to fp32 (MiniLM
on 2,000 PyPI summaries: min 0.963 with it, 0.973-0.981 without), so it stays bf16.
"""

from __future__ import annotations

import torch

QMAX = 255  # uint8 activations
WMAX = 127  # int8 weights, symmetric (no -128: the range stays even about zero)


def onednn_int8_available() -> bool:
    """Whether this torch has oneDNN's int8 inner product and this CPU runs bf16 natively (the
    products' outputs, the attention and the FFN's second product are bf16)."""
    from pipeline.hardware import cpu_bf16_is_faster

    ops = torch.ops.onednn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "qlinear_pointwise")
            and hasattr(ops, "qlinear_prepack") and cpu_bf16_is_faster())


def quantize_uint8(x: torch.Tensor) -> tuple[torch.Tensor, float, int]:
    """``x`` as uint8 with one (scale, zero point) over the whole tensor: its range, widened
    to hold zero, cut into 255 steps; rounded half up. Computed in fp32 (a bf16 ``x`` is
    widened first: 8 bits of mantissa cannot hold 255 steps)."""
    x = x.float()
    low, high = torch.aminmax(x)
    low, high = min(float(low), 0.0), max(float(high), 0.0)
    scale = (high - low) / QMAX or 1.0  # an all-zero input: any scale
    zero = round(-low / scale)
    shifted = torch.add(torch.tensor(zero + 0.5), x, alpha=1.0 / scale)  # one pass: x/s + z + .5
    return shifted.clamp_(0, QMAX).to(torch.uint8), scale, zero  # the cast truncates


class Int8Linear(torch.nn.Module):
    """``linear``'s product with int8 weights and a uint8-quantized input, bf16 out, GELU
    (oneDNN's ``algorithm``: "none" exact, "tanh") fused where ``gelu`` is given."""

    def __init__(self, linear: torch.nn.Linear, gelu: str | None = None) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        self.scales = weight.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / WMAX
        qweight = torch.round(weight / self.scales[:, None]).clamp_(-WMAX, WMAX).to(torch.int8)
        self.packed = torch.ops.onednn.qlinear_prepack(qweight, None)
        self.zeros = torch.zeros(weight.shape[0], dtype=torch.int64)
        self.bias = linear.bias.detach().float()
        self.post_op, self.algorithm = ("gelu", gelu) if gelu else ("none", "")
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, scale, zero = quantize_uint8(x)
        return torch.ops.onednn.qlinear_pointwise(
            q, scale, zero, self.packed, self.scales, self.zeros, self.bias, 1.0, 0,
            torch.bfloat16, self.post_op, [], self.algorithm)
