"""Fixed input scales for an int8 ONNX model made by ONNX Runtime's dynamic quantizer.

``quantize_dynamic`` puts a ``DynamicQuantizeLinear`` before each int8 product: it takes one
(scale, zero point) from the range of the whole batch's input, so a text's vector moves with
its batch-mates and their padding (MiniLM, 2,000 summaries encoded twice in other orders:
cosine min 0.966). Here each of them becomes a ``QuantizeLinear`` with a (scale, zero point)
fixed from the range its input spans over calibration batches (``fix_input_scales``), the way
``pipeline.int8_linear.calibrate`` fixes the oneDNN kernel's: the products, their kernels and
their weights stay as they were; inputs outside the range clip.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pipeline.int8_linear import uint8_qparams

DYNAMIC = "DynamicQuantizeLinear"


def fix_input_scales(path: Path, feeds: Sequence[dict[str, np.ndarray]], threads: int) -> None:
    """Rewrite the model at ``path``: each ``DynamicQuantizeLinear`` a ``QuantizeLinear`` whose
    scale and zero point are constants from the range its input spans when the model runs on
    ``feeds`` (quantized per batch meanwhile)."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(path))
    dynamic = [node for node in model.graph.node if node.op_type == DYNAMIC]
    ranges = _observed_ranges(model, [node.input[0] for node in dynamic], feeds, threads)
    nodes = []
    for node in model.graph.node:
        if node.op_type != DYNAMIC:
            nodes.append(node)
            continue
        quantized, scale_name, zero_name = node.output  # consumers read these names
        scale, zero = uint8_qparams(*ranges[node.input[0]])
        model.graph.initializer.extend([
            numpy_helper.from_array(np.array(scale, dtype=np.float32), scale_name),
            numpy_helper.from_array(np.array(zero, dtype=np.uint8), zero_name),
        ])
        nodes.append(helper.make_node("QuantizeLinear", [node.input[0], scale_name, zero_name],
                                      [quantized], name=f"{node.name}_fixed"))
    del model.graph.node[:]
    model.graph.node.extend(_integer_products_to_float(nodes))
    onnx.save(model, str(path))


def _integer_products_to_float(nodes: list) -> list:
    """Each ``MatMulInteger -> Cast -> Mul(Mul(input scale, weight scale))`` chain of the
    quantizer as one ``MatMulIntegerToFloat`` (ONNX Runtime's contrib op). ORT's own fusion
    folds that chain only after a ``DynamicQuantizeLinear``; left apart, its three passes
    made MiniLM's int8 encode 4-7% slower."""
    from onnx import helper

    made = {out: node for node in nodes for out in node.output}
    used: dict[str, list] = {}
    for node in nodes:
        for name in node.input:
            used.setdefault(name, []).append(node)
    dropped, fused = set(), {}
    for product in (node for node in nodes if node.op_type == "MatMulInteger"):
        chain = _dequantize_chain(product, made, used)
        if chain is None:
            continue
        cast, mul, scales, (a_scale, b_scale) = chain
        a, b, a_zero, b_zero = product.input
        fused[id(product)] = helper.make_node(
            "MatMulIntegerToFloat", [a, b, a_scale, b_scale, a_zero, b_zero],
            list(mul.output), name=f"{product.name}_to_float", domain="com.microsoft")
        dropped |= {id(cast), id(mul)} | ({id(scales)} if len(used[scales.output[0]]) == 1
                                          else set())
    return [fused.get(id(node), node) for node in nodes if id(node) not in dropped]


def _dequantize_chain(product, made: dict, used: dict) -> tuple | None:
    """(cast, mul, scales, (input scale, weight scale)) after an integer product whose input
    a fixed ``QuantizeLinear`` made, or None where the graph differs."""
    if len(product.input) != 4 or len(used.get(product.output[0], ())) != 1:
        return None
    [cast] = used[product.output[0]]
    if cast.op_type != "Cast" or len(used.get(cast.output[0], ())) != 1:
        return None
    [mul] = used[cast.output[0]]
    other = [name for name in mul.input if name != cast.output[0]]
    scales = made.get(other[0]) if mul.op_type == "Mul" and len(other) == 1 else None
    quantize = made.get(product.input[0])
    if scales is None or scales.op_type != "Mul" or quantize is None \
            or quantize.op_type != "QuantizeLinear" or quantize.input[1] not in scales.input:
        return None
    a_scale = quantize.input[1]
    b_scale = scales.input[1] if scales.input[0] == a_scale else scales.input[0]
    return cast, mul, scales, (a_scale, b_scale)


def _observed_ranges(model, names: list[str], feeds: Sequence[dict[str, np.ndarray]],
                     threads: int) -> dict[str, tuple[float, float]]:
    """(min, max) of each tensor in ``names`` over runs of ``model`` on ``feeds``."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(helper.make_tensor_value_info(name, TensorProto.FLOAT, None)
                              for name in names)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(probe.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    low, high = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0.0)
    inputs = declared_inputs(session)
    for feed in feeds:
        for name, value in zip(names, session.run(names, {i: feed[i] for i in inputs}),
                               strict=True):
            low[name] = min(low[name], float(value.min()))
            high[name] = max(high[name], float(value.max()))
    return {name: (low[name], high[name]) for name in names}


def declared_inputs(session) -> list[str]:
    """The inputs an ONNX Runtime ``session``'s graph takes: the export drops an input the
    model ignores (token type ids where the tokenizer gives them and the architecture has
    none)."""
    return [i.name for i in session.get_inputs()]
