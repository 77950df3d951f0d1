"""int8 Linear layers through oneDNN's int8 inner product, for the fused CPU forward.

``Int8Linear`` keeps a Linear's weights as int8 with one scale per output channel (symmetric,
as ONNX Runtime's per-channel dynamic quantization), quantizes its input to uint8 with one
scale and zero point, then runs ``torch.ops.onednn.qlinear_pointwise`` (VNNI / AMX int8 dot
products) with the bias, a fused GELU where asked and a bf16 output (or uint8 for the next
product to read, ``Int8Linear.feed``).

The input's scale is fixed once, when the model is made int8 (``calibrate``): the range each
product's input spans over ``calibration_batches``, rows of random token ids drawn with a fixed
seed from the model's vocabulary (no data needed; the same scales on every machine). So a
text's vector depends on its text alone, not on its batch-mates: with a scale taken from each
batch (ONNX Runtime's ``DynamicQuantizeLinear``, this module's first scheme) the same 2,000
PyPI summaries encoded again in another order moved by cosine 0.9765 at worst (MiniLM); with
the fixed scales they came back identical, at the same cosine to fp32 (mean 0.9960 per
batch, 0.9962 fixed; min 0.9782 / 0.9777) and recall@10 (0.532 / 0.5315; fp32 0.5325). That
held on an AVX512-BF16 EPYC VM; where AMX runs, a text's padding still moved it (min cosine
0.9952): attention over more keys rounds its bf16 output differently, and a fixed scale turns a
last-bit change into a step of the uint8 grid now and then. Since the fused forward computes a
batch's real tokens alone (``pipeline.token_layout``) they come back identical there too (1.0).
Inputs outside the calibrated range are clipped to it.

Every Linear of a layer runs here (``FusedLayer.to_int8``): query/key/value, the attention
output, and the feed-forward block, whose first product writes uint8 for its second to read
(``feed``; ``pipeline.int8_ffn``). Measured on a 2-core AVX512-BF16 VM, a [6,144 x 384] x
[384 x 1,536] product: int8 with bf16 output 3.9 ms, bf16 8.7 ms; quantizing its fp32 input
~0.6 ms.
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
    products' outputs and the attention are bf16)."""
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


ChannelRanges = tuple[torch.Tensor, torch.Tensor]  # (low, high) per input channel


def calibrate(model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]
              ) -> dict[Int8Linear, ChannelRanges]:
    """Fix the input scale of each ``Int8Linear`` in ``model`` to the range its inputs span
    in ``model``'s forward over ``batches`` of (ids, mask) (scaled per batch meanwhile); the
    range of each of their input channels returned."""
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    for layer in layers:
        none = torch.zeros(layer.in_features)  # uint8_qparams widens a range to hold 0 anyway
        layer.input_qparams, layer.observed = None, (none, none)
    with torch.inference_mode():
        for ids, mask in batches:
            model(ids, mask)
    ranges = {layer: layer.observed for layer in layers}
    for layer, (low, high) in ranges.items():
        layer.input_qparams = uint8_qparams(float(low.min()), float(high.max()))
        layer.observed = None
    return ranges


class Int8Linear(torch.nn.Module):
    """``linear``'s product with int8 weights and a uint8-quantized input, bf16 out (uint8
    once it ``feed``s the next product), GELU (oneDNN's ``algorithm``: "none" exact, "tanh")
    fused where ``gelu`` is given. The input's (scale, zero point) is ``input_qparams`` once
    ``calibrate`` fixed it, else each input's own; a uint8 input is taken as quantized with
    ``input_qparams`` already."""

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
        self.observed: ChannelRanges | None = None  # while calibrating
        self.output_qparams: tuple[float, int] | None = None  # uint8 out (``feed``)

    def feed(self, after: Int8Linear) -> None:
        """Write uint8 from now on, quantized with the fixed input scale of ``after`` (its
        only reader, once ``calibrate`` fixed it), so that ``after`` reads it as it is."""
        if after.input_qparams is None:
            raise ValueError("the next product's input scale is not fixed yet: calibrate first")
        self.output_qparams = after.input_qparams

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.uint8:  # from a product that ``feed``s this one
            scale, zero = self.input_qparams
            q = x
        else:
            q, scale, zero = quantize_uint8(x, self._qparams(x))
        out_scale, out_zero, out_dtype = 1.0, 0, torch.bfloat16
        if self.output_qparams is not None:
            (out_scale, out_zero), out_dtype = self.output_qparams, None  # None: uint8
        return torch.ops.onednn.qlinear_pointwise(
            q, scale, zero, self.packed, self.scales, self.zeros, self.bias, out_scale,
            out_zero, out_dtype, self.post_op, [], self.algorithm)

    def _qparams(self, x: torch.Tensor) -> tuple[float, int]:
        """The input's fixed (scale, zero point), else (not fixed, or calibrating) ``x``'s
        own range's; calibration keeps each channel's."""
        if self.observed is not None:
            low, high = torch.aminmax(x.reshape(-1, self.in_features).float(), dim=0)
            self.observed = (torch.minimum(self.observed[0], low),
                             torch.maximum(self.observed[1], high))
            return uint8_qparams(float(low.min()), float(high.max()))
        if self.input_qparams is not None:
            return self.input_qparams
        return uint8_qparams(*value_range(x))
