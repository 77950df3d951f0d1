"""The opt-in int8 CPU path: the encoder run by ONNX Runtime with int8 MatMul weights.

The first time a model is used with ``dtype int8`` its transformer is exported to ONNX (eager
attention, so the padding mask stays in the graph), fused by ONNX Runtime's transformer
optimizer where it knows the architecture (attention, skip layer norm, bias GELU in BERT-like
models), and its MatMul weights quantized to int8 with one scale per output channel; each
product's input is quantized with one (scale, zero point) fixed at the build from the range it
spans over the random vocabulary rows that calibrate the oneDNN kernel (``pipeline.onnx_scales``:
no calibration data, and a text's vector does not depend on its batch-mates). The file is
cached under ``EMBEDPIPE_CACHE``, keyed by the model hash, the outputs, the ONNX Runtime version
and the scheme, and checked against its recorded SHA-256 before each load.

Why ONNX Runtime and not torch's dynamic quantization of the Linear layers (the earlier int8
path), measured on the packaged MiniLM and the same 2,000 PyPI summaries, AVX2-only CPU, two
runs: torch int8 372 vs fp32 231 docs/s (1.61x), recall@10 -0.0065, cosine to fp32 0.973 mean;
ONNX Runtime int8 412 vs fp32 233 docs/s (1.77x), recall@10 -0.0010, cosine 0.992 mean.
Vectors change, so an int8 set has its own fingerprint (``pipeline.models.hashing.quantized_hash``).

Where the fused CPU forward runs and oneDNN's int8 product and bf16 run natively, ``dtype
int8`` runs there instead (``pipeline.int8_linear``): no export, and faster and closer to fp32
on an AVX512-BF16 CPU (README, Performance).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import tempfile
import threading
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from pipeline import storage
from pipeline.config import stable_hash
from pipeline.errors import ConfigError, ModelError
from pipeline.onnx_scales import declared_inputs, fix_input_scales
from pipeline.settings import cache_root

INT8 = "int8"
OPSET = 17
ORT_BERT_TYPES = frozenset({"bert", "roberta", "xlm-roberta"})  # ORT's BERT fusions apply
SCHEME = "fixed-input-scales"  # in the cache key: a file of the per-batch scheme is not reused


def check_onnx_int8(need_attention: bool) -> None:
    """Before int8 through ONNX Runtime is chosen: a one-line ConfigError where it cannot run
    this job (the attention pooler: ONNX Runtime's graph gives no attention weights; the fused
    forward's oneDNN int8 path computes them)."""
    if need_attention:
        raise ConfigError("the attention pooler needs the model's attention weights, which "
                          "dtype int8 through ONNX Runtime does not give: use fp32, or "
                          "int8_kernel onednn where it runs")


def check_onnxruntime() -> None:
    """A one-line ConfigError where ONNX Runtime and onnx are not installed."""
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            "dtype int8 runs this model in ONNX Runtime here, which is not installed "
            f"({exc.name}): pip install 'embedpipe[int8]'"
        ) from None


class OnnxInt8Model:
    """Stands in for the transformer (same call, same outputs) with int8 ONNX Runtime sessions:
    one for the last layer alone, one with every layer's hidden states, each built on first use.
    """

    def __init__(self, model: torch.nn.Module, model_hash: str, token_types: bool,
                 calibration: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """``model``: loaded with eager attention (SDPA's mask shortcuts do not export), after
        ``check_onnx_int8``; ``calibration``: the (ids, mask) batches that fix the products' input
        scales when the int8 file is built (``pipeline.int8_linear.calibration_batches``)."""
        self.config = model.config
        self._model = model
        self._hash = model_hash
        self._inputs = ["input_ids", "attention_mask"] + (["token_type_ids"] if token_types else [])
        self._calibration = calibration
        self._sessions: dict[bool, tuple[Any, list[str]]] = {}
        self._lock = threading.Lock()

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 token_type_ids: torch.Tensor | None = None, output_hidden_states: bool = False,
                 output_attentions: bool = False) -> SimpleNamespace:
        if output_attentions:
            raise ConfigError("dtype int8 (ONNX Runtime) gives no attention weights")
        session, names = self._session(output_hidden_states)
        outputs = session.run(None, self._feeds(names, input_ids, attention_mask, token_type_ids))
        tensors = [torch.from_numpy(o) for o in outputs]
        hidden = tuple(tensors[1:]) if output_hidden_states else None
        return SimpleNamespace(last_hidden_state=tensors[0], hidden_states=hidden)

    @staticmethod
    def _feeds(names: Sequence[str], input_ids: torch.Tensor, attention_mask: torch.Tensor,
               token_type_ids: torch.Tensor | None = None) -> dict[str, np.ndarray]:
        """The inputs ``names`` (token type ids all zero where none are given)."""
        given = {"input_ids": input_ids, "attention_mask": attention_mask}
        if "token_type_ids" in names:
            given["token_type_ids"] = (torch.zeros_like(input_ids) if token_type_ids is None
                                       else token_type_ids)
        return {name: given[name].cpu().numpy() for name in names}

    def _session(self, hidden: bool) -> tuple[Any, list[str]]:
        """The session and the inputs its graph declares (``declared_inputs``), made once."""
        with self._lock:
            if hidden not in self._sessions:
                session = _session(self._cached_file(hidden))
                self._sessions[hidden] = (session, declared_inputs(session))
            return self._sessions[hidden]

    def _cached_file(self, hidden: bool) -> Path:
        import onnxruntime

        key = stable_hash([self._hash, hidden, self._inputs, onnxruntime.__version__, OPSET,
                           SCHEME])
        path = cache_root() / "onnx-int8" / f"{key}.onnx"
        if _verified(path):
            return path
        with tempfile.TemporaryDirectory(prefix="embedpipe-onnx-") as work:
            data = self._build(Path(work), hidden).read_bytes()
        storage.write_bytes(str(path), data)  # the model, then its checksum: both atomic
        storage.write_json(str(path.with_suffix(".json")),
                           {"sha256": hashlib.sha256(data).hexdigest()})
        return path

    def _build(self, work: Path, hidden: bool) -> Path:
        """Export, fuse (where ORT knows the architecture), quantize, fix the products' input
        scales: the int8 model's path."""
        from onnxruntime.quantization import QuantType, quantize_dynamic

        exported, fused, quantized = work / "model.onnx", work / "fused.onnx", work / "int8.onnx"
        try:
            self._export(exported, hidden)
            source = _fuse(exported, fused, self.config) or exported
            with warnings.catch_warnings(), _quiet_root_logger():
                warnings.simplefilter("ignore")
                quantize_dynamic(source, quantized, weight_type=QuantType.QInt8, per_channel=True,
                                 extra_options={"DefaultTensorType": 1})  # onnx FLOAT
            fix_input_scales(quantized, [self._feeds(self._inputs, ids, mask)
                                         for ids, mask in self._calibration],
                             torch.get_num_threads())
        except (RuntimeError, ValueError, TypeError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ModelError(f"cannot build the int8 ONNX model: {first}") from None
        return quantized

    def _export(self, target: Path, hidden: bool) -> None:
        layers = int(self.config.num_hidden_layers)
        outputs = ["last_hidden_state"] + ([f"hidden_{i}" for i in range(layers + 1)]
                                           if hidden else [])
        axes = {name: {0: "batch", 1: "tokens"} for name in self._inputs + outputs}
        ids = torch.ones(2, 8, dtype=torch.long)
        mask = torch.ones(2, 8, dtype=torch.long)
        mask[1, 5:] = 0  # padding in the example, so the mask is not traced away
        example = {"input_ids": ids, "attention_mask": mask,
                   "token_type_ids": torch.zeros_like(ids)}
        with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                _Outputs(self._model, self._inputs, hidden),
                tuple(example[name] for name in self._inputs), str(target),
                input_names=self._inputs, output_names=outputs, dynamic_axes=axes,
                opset_version=OPSET, dynamo=False,
            )


class _Outputs(torch.nn.Module):
    """The transformer as a function of positional inputs to a flat tuple of outputs."""

    def __init__(self, model: torch.nn.Module, inputs: list[str], hidden: bool) -> None:
        super().__init__()
        self.model, self.inputs, self.hidden = model, inputs, hidden

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.model(**dict(zip(self.inputs, tensors, strict=True)),
                         output_hidden_states=self.hidden)
        return (out.last_hidden_state, *(out.hidden_states if self.hidden else ()))


def _fuse(source: Path, target: Path, config: Any) -> Path | None:
    """ORT's transformer fusions for BERT-like models; None where it does not know the type."""
    if getattr(config, "model_type", None) not in ORT_BERT_TYPES:
        return None
    from onnxruntime.transformers.optimizer import optimize_model

    optimized = optimize_model(str(source), model_type="bert", opt_level=1,
                               num_heads=int(config.num_attention_heads),
                               hidden_size=int(config.hidden_size))
    optimized.save_model_to_file(str(target))
    return target


@contextlib.contextmanager
def _quiet_root_logger() -> Iterator[None]:
    """ONNX Runtime's quantizer advises "pre-processing" through the root logger on every
    build: advice to developers, not a message for the user's terminal."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(previous)


def _session(path: Path) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # ORT's threads spin within a run, then stop: spinning on after it, they held the cores the
    # poolers' torch kernels and the tokenizer run on next (2,000 summaries, MiniLM int8, 2
    # cores: 1,207-1,592 docs/s spinning on, 1,389-1,606 stopping, never spinning 1,562-1,623)
    options.add_session_config_entry("session.force_spinning_stop", "1")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _verified(path: Path) -> bool:
    """The cached file exists and is the one recorded (else it is built again)."""
    try:
        recorded = json.loads(path.with_suffix(".json").read_text()).get("sha256")
    except (OSError, ValueError, AttributeError):
        return False
    return path.is_file() and recorded == storage.sha256(str(path))
