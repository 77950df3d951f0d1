"""The Transformer module's saved options (``sentence_bert_config.json`` and its old names).

What changes vectors is honoured: ``max_seq_length``, ``do_lower_case`` and the tokenizer,
model and config arguments (``trust_remote_code`` is dropped from them, as
sentence-transformers does). Options of multimodal or multi-vector models (another task,
another output, per-task lengths, query expansion, processing overrides) are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import ModelError
from pipeline.models.jsonfile import read_json

CONFIG_NAMES = tuple(
    f"sentence_{name}_config.json"
    for name in ("bert", "roberta", "distilbert", "camembert", "albert", "xlm-roberta", "xlnet")
)
_TEXT_ONLY = {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}
_ARGS = {"tokenizer_args": "processor_kwargs", "model_args": "model_kwargs",
         "config_args": "config_kwargs"}
_IGNORED = {"unpad_inputs"}  # how the batch is laid out, not what it computes


@dataclass(frozen=True)
class TransformerConfig:
    """What the Transformer module asks of the tokenizer and the model."""

    max_seq_length: int | None = None
    do_lower_case: bool = False
    tokenizer_args: dict = field(default_factory=dict)
    model_args: dict = field(default_factory=dict)
    config_args: dict = field(default_factory=dict)


def read_transformer_config(folder: Path) -> TransformerConfig:
    """The options saved next to the transformer in ``folder`` (none when no file is there)."""
    path = next((folder / n for n in CONFIG_NAMES if (folder / n).is_file()), None)
    if path is None:
        return TransformerConfig()
    raw = dict(read_json(path))
    _refuse_unsupported(raw, path)
    args = {}
    for old, new in _ARGS.items():  # the old names win, as in sentence-transformers
        old_value, new_value = raw.pop(old, None), raw.pop(new, None)
        args[old] = _args(new_value if old_value is None else old_value, path, old)
    max_len = raw.pop("max_seq_length", None)
    if max_len is not None and (not isinstance(max_len, int) or max_len < 3):
        raise ModelError(f"{path}: max_seq_length must be an integer above 2, got {max_len!r}")
    return TransformerConfig(max_len, bool(raw.pop("do_lower_case", False)), **args)


def _refuse_unsupported(raw: dict, path: Path) -> None:
    task = raw.pop("transformer_task", "feature-extraction")
    modality = raw.pop("modality_config", _TEXT_ONLY)
    output = raw.pop("module_output_name", "token_embeddings")
    if task != "feature-extraction" or modality != _TEXT_ONLY or output != "token_embeddings":
        raise ModelError(
            f"{path}: a Transformer with task {task!r}, modalities {sorted(modality)} and output "
            f"{output!r} is not supported (embedpipe runs text feature-extraction models)"
        )
    for key in ("processing_kwargs", "query_length", "document_length", "query_expansion"):
        if raw.pop(key, None):
            raise ModelError(f"{path}: the Transformer option {key!r} is not supported")
    for key in _IGNORED:
        raw.pop(key, None)


# arguments that say where transformers reads files or which code it runs: a model folder's
# files must not choose them (weights or a tokenizer from outside the folder would escape
# its hash, and so the set's fingerprint); trust_remote_code is the operator's alone
_WHERE_FROM = {"subfolder", "cache_dir", "local_files_only", "revision", "code_revision",
               "token", "use_auth_token", "force_download", "proxies", "resume_download",
               "trust_remote_code", "pretrained_model_name_or_path", "from_tf", "from_flax"}


def _args(value: object, path: Path, name: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ModelError(f"{path}: {name} must be a JSON object, got {value!r}")
    for key in value:
        if key in _WHERE_FROM or key.endswith(("_file", "_files", "_dir", "_path")):
            raise ModelError(f"{path}: {name} may not set {key!r}: a model folder's files "
                             "cannot say where its files are read from")
    return dict(value)
