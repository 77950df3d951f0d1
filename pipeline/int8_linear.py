"""int8 Linear layers through oneDNN's int8 inner product, for the fused CPU forward.

``Int8Linear`` keeps a Linear's weights as int8 with one scale per output channel (symmetric,
as ONNX Runtime's per-channel dynamic quantization), quantizes its input to uint8 with one
scale and zero point, then runs ``torch.ops.onednn.qlinear_pointwise`` (VNNI / AMX int8 dot
products) with the bias, a fused GELU where asked and a bf16 output.

The input's scale is fixed once, when the model is made int8 (``calibrate``): the range each
product's input spans over ``calibration_batches``, rows of random token ids drawn with a fixed
seed from the model's vocabulary (no data needed; the same scales on every machine). So a
text's vector depends on its text alone, not on its batch-mates: with a scale taken from each
batch (ONNX Runtime's ``DynamicQuantizeLinear``, this module's first scheme) the same 2,000
PyPI summaries encoded again in another order moved by cosine 0.9765 at worst (MiniLM); with
the fixed scales they came back identical, at the same cosine to fp32 (mean 0.9960 per
batch, 0.9962 fixed; min 0.9782 / 0.9777) and recall@10 (0.532 / 0.5315; fp32 0.5325). Inputs
outside the calibrated range are clipped to it.

Only products whose input is hidden-size wide are quantized (``FusedLayer.to_int8``: query/key/
value, the attention output, the FFN's first product). Measured on a 2-core AVX512-BF16 VM, a
[6,144 x 384] x [384 x 1,536] product: int8 with bf16 output 3.9 ms, bf16 8.7 ms; quantizing
its fp32 input ~0.6 ms. The FFN's second product reads the 1,536-wide GELU output: quantizing it
(in bf16, 4x wider) costs about what int8 saves there, and it lowered the cosine to fp32 (MiniLM
on 2,000 PyPI summaries: min 0.963 with it, 0.973-0.981 without), so it stays bf16.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

QMAX = 255  # uint8 activations
WMAX = 127  # int8 weights, symmetric (no -128: the range stays even about zero)
CALIBRATION_LENGTHS = (8, 16, 32, 64, 128, 256)  # tokens per row, special tokens included
CALIBRATION_ROWS = 8  # per length (32: the same cosine to fp32 and recall@10 on MiniLM)


def onednn_int8_available() -> bool:
    """Whether this torch has oneDNN's int8 inner product and this CPU runs bf16 natively (the
    products' outputs, the attention and the FFN's second product are bf16)."""
    from pipeline.hardware import cpu_bf16_is_faster

    ops = torch.ops.onednn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "qlinear_pointwise")
            and hasattr(ops, "qlinear_prepack") and cpu_bf16_is_faster())


def uint8_qparams(low: float, high: float) -> tuple[float, int]:
    """(scale, zero point) cutting [low, high], widened to hold zero, into 255 steps."""
    low, high = min(low, 0.0), max(high, 0.0)
    scale = (high - low) / QMAX or 1.0  # an all-zero input: any scale
    return scale, round(-low / scale)


def value_range(x: torch.Tensor) -> tuple[float, float]:
    """(min, max) of ``x``."""
    low, high = torch.aminmax(x)
    return float(low), float(high)


def quantize_uint8(x: torch.Tensor, qparams: tuple[float, int]
                   ) -> tuple[torch.Tensor, float, int]:
    """``x`` as uint8 with ``qparams`` (scale, zero point); rounded half up, clipped to the
    range. Computed in fp32 (a bf16 ``x`` is widened first: 8 bits of mantissa cannot hold 255
    steps)."""
    scale, zero = qparams
    shifted = torch.add(torch.tensor(zero + 0.5), x.float(), alpha=1.0 / scale)  # x/s + z + .5
    return shifted.clamp_(0, QMAX).to(torch.uint8), scale, zero  # the cast truncates


def calibration_batches(vocab_size: int, special_ids: Iterable[int], prefix: Sequence[int],
                        suffix: Sequence[int], max_length: int
                        ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ids, mask) batches of ``CALIBRATION_ROWS`` rows per length in ``CALIBRATION_LENGTHS``
    (up to ``max_length``): the special tokens around random ids from the vocabulary less its
    special tokens, drawn with a fixed seed, no padding."""
    rng = np.random.default_rng(0)
    vocab = np.setdiff1d(np.arange(vocab_size), np.fromiter(special_ids, dtype=np.int64))
    batches = []
    for length in (n for n in CALIBRATION_LENGTHS if n <= max_length):
        inner = max(1, length - len(prefix) - len(suffix))
        body = rng.choice(vocab, size=(CALIBRATION_ROWS, inner))
        ids = np.concatenate([np.tile(prefix, (CALIBRATION_ROWS, 1)), body,
                              np.tile(suffix, (CALIBRATION_ROWS, 1))], axis=1).astype(np.int64)
        batches.append((torch.from_numpy(ids), torch.ones(ids.shape, dtype=torch.long)))
    return batches


def calibrate(model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]
              ) -> None:
    """Fix the input scale of each ``Int8Linear`` in ``model`` to the range its inputs span
    in ``model``'s forward over ``batches`` of (ids, mask) (scaled per batch meanwhile)."""
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    for layer in layers:
        layer.input_qparams, layer.observed = None, (0.0, 0.0)
    with torch.inference_mode():
        for ids, mask in batches:
            model(ids, mask)
    for layer in layers:
        layer.input_qparams, layer.observed = uint8_qparams(*layer.observed), None


class Int8Linear(torch.nn.Module):
    """``linear``'s product with int8 weights and a uint8-quantized input, bf16 out, GELU
    (oneDNN's ``algorithm``: "none" exact, "tanh") fused where ``gelu`` is given. The input's
    (scale, zero point) is ``input_qparams`` once ``calibrate`` fixed it, else each input's
    own."""

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
        self.input_qparams: tuple[float, int] | None = None
        self.observed: tuple[float, float] | None = None  # (low, high) while calibrating

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qparams = self.input_qparams
        if qparams is None or self.observed is not None:  # not fixed: this batch's own range
            low, high = value_range(x)
            if self.observed is not None:  # calibrating: the range kept
                self.observed = (min(self.observed[0], low), max(self.observed[1], high))
            qparams = uint8_qparams(low, high)
        q, scale, zero = quantize_uint8(x, qparams)
        return torch.ops.onednn.qlinear_pointwise(
            q, scale, zero, self.packed, self.scales, self.zeros, self.bias, 1.0, 0,
            torch.bfloat16, self.post_op, [], self.algorithm)
