"""The Dense module: a linear layer and its saved activation (a parameter-free ``torch.nn`` one).

The activation is named by class in ``config.json`` (``torch.nn.modules.activation.Tanh``);
only the activations listed here are built, by name: no code is imported because a file
names it. Weights come from ``model.safetensors`` (or a tensors-only ``pytorch_model.bin``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pipeline.errors import ModelError
from pipeline.models.jsonfile import read_json

ACTIVATIONS = ("CELU", "ELU", "GELU", "Hardsigmoid", "Hardswish", "Hardtanh", "Identity",
               "LeakyReLU", "LogSigmoid", "Mish", "ReLU", "ReLU6", "SELU", "SiLU", "Sigmoid",
               "Softplus", "Softsign", "Tanh", "Tanhshrink")
_IO = "sentence_embedding"


@dataclass(frozen=True)
class DenseConfig:
    in_features: int
    out_features: int
    bias: bool = True
    activation: str = "Tanh"  # sentence-transformers' default when the config names none
    use_residual: bool = False


def read_dense_config(folder: Path) -> DenseConfig:
    path = folder / "config.json"
    raw = read_json(path)
    for key in ("module_input_name", "module_output_name"):
        if raw.get(key, _IO) not in (_IO, None):
            raise ModelError(f"{path}: a Dense reading or writing {raw[key]!r} is not supported")
    name = raw.get("activation_function") or "torch.nn.modules.activation.Tanh"
    if not isinstance(name, str):
        raise ModelError(f"{path}: activation_function must be a class name, got {name!r}")
    activation = name.rsplit(".", 1)[-1]
    if not name.startswith("torch.nn.") or activation not in ACTIVATIONS:
        raise ModelError(
            f"{path}: activation {name!r} is not supported (supported: torch.nn "
            f"{', '.join(ACTIVATIONS)})"
        )
    try:
        return DenseConfig(int(raw["in_features"]), int(raw["out_features"]),
                           bool(raw.get("bias", True)), activation,
                           bool(raw.get("use_residual", False)))
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelError(f"{path}: in_features and out_features must be integers ({exc})") from None


class Dense(nn.Module):
    """``activation(linear(x))`` (+ ``x`` or its projection with ``use_residual``)."""

    def __init__(self, cfg: DenseConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.linear = nn.Linear(cfg.in_features, cfg.out_features, bias=cfg.bias)
        self.activation = getattr(nn, cfg.activation)()
        if cfg.use_residual and cfg.in_features != cfg.out_features:
            self.residual = nn.Linear(cfg.in_features, cfg.out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.activation(self.linear(x))
        if self.cfg.use_residual:
            out = out + (self.residual(x) if hasattr(self, "residual") else x)
        return out


def load_dense(folder: Path) -> Dense:
    """The Dense saved in ``folder``, its weights checked against its config."""
    dense = Dense(read_dense_config(folder))
    tensors = _read_weights(folder)
    _check_shapes(folder, dense, tensors)
    dense.load_state_dict(tensors, strict=True)
    return dense.eval()


def _check_shapes(folder: Path, dense: Dense, tensors: object) -> None:
    """Refuse weights that are not the tensors ``dense``'s config makes, naming the first
    that differs (torch's own error names them lines below its header)."""
    wanted = {name: tuple(t.shape) for name, t in dense.state_dict().items()}
    if not isinstance(tensors, dict) or not all(
            isinstance(t, torch.Tensor) for t in tensors.values()):
        raise ModelError(f"{folder}: the Dense weights file holds no plain name-to-tensor map")
    stored = {str(name): tuple(t.shape) for name, t in tensors.items()}
    problems = [f"weight {n} is {stored[n]}, its config.json makes {wanted[n]}"
                for n in wanted if n in stored and stored[n] != wanted[n]]
    problems += [f"weight {n} is missing" for n in wanted if n not in stored]
    problems += [f"weight {n} is not one its config.json makes" for n in stored
                 if n not in wanted]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ModelError(f"{folder}: Dense weights do not match its config.json: "
                         f"{problems[0]}{more}")


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / "model.safetensors").is_file():
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(folder / "model.safetensors"))
        except SafetensorError as exc:
            raise ModelError(f"{folder}/model.safetensors is not a safetensors file: "
                             f"{exc}") from None
    if (folder / "pytorch_model.bin").is_file():
        try:  # tensors only: the restricted unpickler runs no code from the file
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return torch.load(folder / "pytorch_model.bin", map_location="cpu",
                                  weights_only=True)
        except Exception as exc:  # torch's text advises loading it unrestricted: not here
            raise ModelError(
                f"{folder}/pytorch_model.bin is not a plain tensor file ({type(exc).__name__}: "
                "it holds more than tensors, or is damaged); refused, nothing in it ran; save "
                "the Dense with sentence-transformers as model.safetensors") from None
    raise ModelError(f"{folder} has no model.safetensors or pytorch_model.bin for its Dense")
