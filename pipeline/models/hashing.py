"""The model hash: SHA-256 over every file that changes a vector, computed once per folder.

Covered: the transformer's config and weights, the tokenizer files, the sentence-transformers
configs (modules, Transformer options, prompts) and every module folder's config and weights
(Pooling, Dense, Normalize); a Transformer kept in a module folder (``0_Transformer/``) has its
tokenizer files there covered too (vocab.txt, merges.txt, sentencepiece models: not JSON),
which leaves the hash of a folder with its transformer at its root as it was. The result is
cached under ``EMBEDPIPE_CACHE``, keyed by the folder and each file's path, size and mtime, so
a start does not re-read the weights.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from pathlib import Path

from pipeline.config import stable_hash
from pipeline.models.prompts import CONFIG as PROMPTS_CONFIG
from pipeline.models.transformer import CONFIG_NAMES
from pipeline.settings import cache_root, write_cache

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
ROOT_FILES = frozenset({
    "config.json", "modules.json", PROMPTS_CONFIG, *CONFIG_NAMES,
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.txt", "vocab.json", "merges.txt", "spiece.model", "sentencepiece.bpe.model",
    "tokenizer.model", "model.safetensors.index.json", "pytorch_model.bin.index.json",
})
_HASH = re.compile(r"^[0-9a-f]{16}$")


def hashed_files(folder: Path, module_dirs: Iterable[Path] = ()) -> list[Path]:
    """The files the hash covers, in a fixed order. ``module_dirs``: every module's folder
    in ``modules.json`` order, so the first is the Transformer's."""
    files = {p for p in folder.iterdir()
             if p.is_file() and (p.name in ROOT_FILES or p.suffix in WEIGHT_SUFFIXES)}
    for index, module in enumerate(module_dirs):
        if module.is_dir() and module != folder:
            files |= {p for p in module.iterdir() if p.is_file()
                      and (p.suffix == ".json" or p.suffix in WEIGHT_SUFFIXES
                           or (index == 0 and p.name in ROOT_FILES))}
    return sorted(files, key=lambda p: p.relative_to(folder).as_posix())


def folder_hash(model: str | None) -> str:
    """``model_hash`` of the folder ``model`` names, without loading or checking anything
    (no torch, no transformers): enough to tell whether a set was made from these files."""
    from pipeline.models.folder import is_sentence_transformers, resolve_model_dir
    from pipeline.models.modules import read_modules

    folder = resolve_model_dir(model)
    dirs = [e.path for e in read_modules(folder)] if is_sentence_transformers(folder) else []
    return model_hash(folder, dirs)


def model_hash(folder: Path, module_dirs: Iterable[Path] = ()) -> str:
    """16 hex digits over ``hashed_files``; read from the cache when no file changed."""
    files = hashed_files(folder, module_dirs)
    stats = [(f.relative_to(folder).as_posix(), f.stat().st_size, f.stat().st_mtime_ns)
             for f in files]
    cache = cache_root() / "model-hash" / f"{stable_hash([str(folder.resolve()), stats])}.json"
    cached = _read_cached(cache)
    if cached:
        return cached
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.relative_to(folder).as_posix().encode())
        with open(file, "rb") as fh:
            for chunk in iter(lambda fh=fh: fh.read(1 << 22), b""):
                digest.update(chunk)
    value = digest.hexdigest()[:16]
    write_cache(cache, {"model_hash": value})
    return value


def _read_cached(path: Path) -> str | None:
    try:
        value = json.loads(path.read_text()).get("model_hash")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and _HASH.match(value) else None


# where dtype int8 runs: oneDNN's int8 product in the fused forward (pipeline.int8_linear), or
# ONNX Runtime (pipeline.quantize); each rounds its own way, so each has its own hash suffix
INT8_SUFFIXES = {"onednn": "-onednn-int8-ffn", "onnxruntime": "-onnx-int8-static"}
# int8 schemes no longer run: a set they made is refused (its vectors cannot be continued)
RETIRED_INT8_SUFFIXES = {
    "-onednn-int8": "oneDNN with input scales taken per batch",
    "-onnx-int8": "ONNX Runtime with input scales taken per batch",
    "-onednn-int8-static": "oneDNN with the feed-forward block's second product in bf16",
}


def quantized_hash(model_hash: str, int8_kernel: str | None) -> str:
    """The hash a set's fingerprint stands on: the model files' hash, and for dtype int8 (an
    ``int8_kernel``) the kernel's suffix: int8 weights are other weights."""
    return model_hash + INT8_SUFFIXES[int8_kernel] if int8_kernel else model_hash


def int8_kernel_of(model_hash: str) -> str | None:
    """The int8 kernel that made vectors of ``model_hash`` (None: not int8)."""
    return next((k for k, suffix in INT8_SUFFIXES.items() if model_hash.endswith(suffix)), None)


def int8_hint(made: str | None, making: str) -> str:
    """Why two model hashes may differ where the int8 kernel is the reason ('' otherwise):
    ``made`` the stored set's (None: not known here), ``making`` this job's."""
    for suffix, why in RETIRED_INT8_SUFFIXES.items():
        if made is not None and made.endswith(suffix):
            return (f"; its int8 vectors came from {why}, which this version no longer runs: "
                    "make the set anew")
    kernel = int8_kernel_of(making)
    if kernel is None:
        other = int8_kernel_of(made) if made is not None else None
        if other is not None and made.removesuffix(INT8_SUFFIXES[other]) == making:
            return (f"; its vectors were made in dtype int8 ({other}), this job's in a float "
                    f"dtype: --dtype int8 --int8-kernel {other} continues it")
        return ""
    if made is None:
        return (f"; dtype int8 runs through {kernel} here: a set made by the other int8 kernel "
                "continues with int8_kernel (--int8-kernel) set to that one")
    other = int8_kernel_of(made)
    base = making.removesuffix(INT8_SUFFIXES[kernel])
    if other is None or other == kernel or made.removesuffix(INT8_SUFFIXES[other]) != base:
        return ""
    return (f"; its int8 vectors came from {other}, this job's from {kernel}: "
            f"int8_kernel {other} (--int8-kernel {other}) continues it")
