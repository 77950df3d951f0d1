"""Loading a model: the one place a folder becomes a tokenizer, a transformer and a head.

``read_model_files`` reads and checks every config (modules, Transformer options, Pooling,
Dense, Normalize, prompts) without touching weights, so an unsupported model fails before
any work. ``load_*`` then build what those files describe.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.errors import ConfigError, ModelError
from pipeline.models.dense import load_dense, read_dense_config
from pipeline.models.folder import is_sentence_transformers, resolve_model_dir
from pipeline.models.hashing import model_hash
from pipeline.models.jsonfile import read_json
from pipeline.models.modules import ModuleEntry, read_modules
from pipeline.models.normalize import Normalize, check_normalize_config
from pipeline.models.pooling import PoolingConfig, read_pooling_config
from pipeline.models.prompts import Prompts, read_prompts
from pipeline.models.similarity import DEFAULT as DEFAULT_SIMILARITY
from pipeline.models.similarity import Similarity, read_similarity
from pipeline.models.transformer import TransformerConfig, read_transformer_config

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

    from pipeline.models.recorded import ModelConfig

PLAIN_MAX_LENGTH = 512  # a plain HF folder: at most this many tokens unless told otherwise


@dataclass(frozen=True)
class ModelFiles:
    """A model folder's configs, read and checked; no weights loaded."""

    folder: Path
    transformer_dir: Path
    transformer: TransformerConfig
    pooling: PoolingConfig
    head: tuple[ModuleEntry, ...]
    prompts: Prompts
    module_dirs: tuple[Path, ...] = ()  # every module's folder (empty: a plain HF folder)
    similarity: Similarity = DEFAULT_SIMILARITY  # how the model compares vectors (search follows)

    @property
    def sentence_transformers(self) -> bool:
        return bool(self.module_dirs)

    def model_hash(self) -> str:
        return model_hash(self.folder, self.module_dirs)


def read_model_files(model: str | None) -> ModelFiles:
    folder = resolve_model_dir(model)
    if not is_sentence_transformers(folder):
        return ModelFiles(folder, folder, TransformerConfig(), PoolingConfig(None), (), Prompts())
    entries = read_modules(folder)
    transformer_dir = entries[0].path
    if not (transformer_dir / "config.json").is_file():
        raise ModelError(f"{transformer_dir} holds no transformer (no config.json)")
    for entry in entries[2:]:
        if entry.kind == "Dense":
            read_dense_config(entry.path)
        else:
            check_normalize_config(entry.path)
    return ModelFiles(folder, transformer_dir, read_transformer_config(transformer_dir),
                      read_pooling_config(entries[1].path), entries[2:], read_prompts(folder),
                      tuple(e.path for e in entries), read_similarity(folder))


def refuse_remote_code(files: ModelFiles, trust_remote_code: bool) -> None:
    """A folder whose config or tokenizer config maps classes to its own code (``auto_map``)
    would run that code when loaded: refused unless the operator asked for it."""
    if trust_remote_code:
        return
    for name in ("config.json", "tokenizer_config.json"):
        path = files.transformer_dir / name
        config = read_json(path, object) if path.is_file() else {}
        if isinstance(config, dict) and config.get("auto_map"):
            raise ModelError(
                f"model {files.folder}: its {name} asks to run code from the model folder "
                "(auto_map); refused: pass --trust-remote-code only if you trust that code"
            )


def load_tokenizer(files: ModelFiles, trust_remote_code: bool) -> PreTrainedTokenizerFast:
    """The fast tokenizer with the Transformer's tokenizer arguments and lower-casing."""
    _quiet_transformers()
    from transformers import AutoTokenizer

    kwargs = dict(files.transformer.tokenizer_args)
    if files.transformer.max_seq_length is not None:
        kwargs.setdefault("model_max_length", files.transformer.max_seq_length)
    tokenizer = AutoTokenizer.from_pretrained(
        str(files.transformer_dir), use_fast=True, local_files_only=True,
        trust_remote_code=trust_remote_code, **kwargs,
    )
    if not getattr(tokenizer, "is_fast", False):
        raise ModelError(f"{files.transformer_dir} has no fast tokenizer (tokenizer.json)")
    if files.transformer.do_lower_case:
        _lower_case(tokenizer)
    return tokenizer


def _lower_case(tokenizer: PreTrainedTokenizerFast) -> None:
    """Lower-case before the tokenizer's own normaliser, as sentence-transformers does."""
    from tokenizers.normalizers import Lowercase
    from tokenizers.normalizers import Sequence as NormalizerSequence

    backend = tokenizer.backend_tokenizer
    current = backend.normalizer
    if current is not None and "Lowercase" in repr(current):
        return
    steps = [Lowercase()]
    if isinstance(current, NormalizerSequence):
        steps += list(current)
    elif current is not None:
        steps.append(current)
    backend.normalizer = NormalizerSequence(steps)


def ready_kernels() -> None:
    """Ready torch's CPU kernels and TorchInductor's cache dir: before a model's first load
    step, since both must happen before torch's first CPU kernel and transformers' import (see
    ``pipeline.hardware``, ``pipeline.compiled``)."""
    from pipeline.compiled import place_kernel_cache
    from pipeline.hardware import prepare_cpu_kernels

    prepare_cpu_kernels()
    place_kernel_cache()


def load_config(files: ModelFiles, trust_remote_code: bool) -> PretrainedConfig:
    """The transformer's config (with the Transformer module's config arguments)."""
    ready_kernels()
    _quiet_transformers()
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(files.transformer_dir), **files.transformer.config_args,
                                      **_hub(trust_remote_code))


def transformers_config(config: ModelConfig, files: ModelFiles, trust_remote_code: bool
                        ) -> PretrainedConfig:
    """``config`` as transformers' own object (a recorded one is loaded again): what
    transformers' model classes need."""
    from pipeline.models.recorded import RecordedConfig

    return load_config(files, trust_remote_code) if isinstance(config, RecordedConfig) else config


def load_transformer(files: ModelFiles, trust_remote_code: bool, eager: bool,
                     config: PretrainedConfig) -> torch.nn.Module:
    """The transformer in eval mode, its weights in float32; eager attention only where asked
    (a pooler reads the attention weights, or the int8 path exports the graph), else SDPA
    where the architecture has it (transformers' choice: MPNet, for one, has only eager).

    float32 whatever dtype the checkpoint stores: transformers 5 loads a checkpoint in its
    stored dtype, so an fp16-saved model would otherwise run fp16 products where the run says
    fp32 (on a CPU, slowly); ``pipeline.precision`` chooses the dtype the products run in."""
    import torch

    _quiet_transformers()
    from transformers import AutoModel

    attn = "eager" if eager else None
    with _reports_kept():  # _check_loaded says in one line what the report would in a table
        model, loading = AutoModel.from_pretrained(
            str(files.transformer_dir), config=config, attn_implementation=attn,
            dtype=torch.float32, output_loading_info=True, ignore_mismatched_sizes=True,
            **_model_args(files), **_hub(trust_remote_code))
    _check_loaded(files, loading)
    return model.eval()


UNUSED_WEIGHTS = ("pooler.",)  # the base model's pooler: embedpipe reads hidden states only


def _check_loaded(files: ModelFiles, loading: dict) -> None:
    """Refuse what transformers would start at random: a weight missing from the checkpoint
    (but the unused pooler's) or of another shape than the config's (vectors would differ
    from one load to the next, under the same model hash)."""
    where = files.transformer_dir
    mismatched = sorted(loading.get("mismatched_keys") or ())
    if mismatched:
        name, stored, wanted = mismatched[0]
        raise ModelError(f"model {where}: weight {name} has shape {tuple(stored)} in the "
                         f"checkpoint but {tuple(wanted)} in the model's config")
    missing = sorted(k for k in loading.get("missing_keys") or ()
                     if not k.startswith(UNUSED_WEIGHTS))
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ModelError(f"model {where}: the checkpoint has no weight {missing[0]}{more} "
                         "(transformers would start it at random)")


def read_fused_weights(files: ModelFiles, wanted: dict[str, tuple[int, ...]], base: str
                       ) -> dict[str, torch.Tensor] | None:
    """The weights ``wanted`` (the model's own names and their shapes, as a fused forward's
    ``checkpoint_weights`` gives them; float32), read from the model's one
    ``model.safetensors``, where a task model's checkpoint may hold them under ``base``, without
    transformers' model classes (importing them took ~1.2 s of MiniLM's ~1.9 s load). None
    where transformers' own loader must decide: model arguments, a sharded or pickled
    checkpoint, or names or shapes it would rename, leave missing or refuse."""
    import torch
    from safetensors import SafetensorError, safe_open

    path = files.transformer_dir / "model.safetensors"
    if _model_args(files) or not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as stored:
            names = set(stored.keys())
            prefix = f"{base}." if f"{base}.{next(iter(wanted))}" in names else ""
            if any(prefix + name not in names for name in wanted):
                return None
            state = {name: stored.get_tensor(prefix + name).to(torch.float32) for name in wanted}
    except SafetensorError as exc:
        raise ModelError(f"{path} is not a safetensors file: {exc}") from None
    if any(tuple(state[name].shape) != shape for name, shape in wanted.items()):
        return None
    return state


_PASSED_ON = ("attn_implementation", "local_files_only", "dtype", "torch_dtype")  # set here


def _model_args(files: ModelFiles) -> dict:
    return {k: v for k, v in files.transformer.model_args.items() if k not in _PASSED_ON}


def _quiet_transformers() -> None:
    """No download progress bars from transformers (nothing downloads: local files only)."""
    from transformers.utils import logging

    logging.disable_progress_bar()


@contextlib.contextmanager
def _reports_kept() -> Iterator[None]:
    """transformers' warnings (its load report's table) kept off stderr within the block."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def _hub(trust_remote_code: bool) -> dict:
    return {"local_files_only": True, "trust_remote_code": trust_remote_code}


def max_length(files: ModelFiles, config: ModelConfig,
               tokenizer: PreTrainedTokenizerFast | None = None) -> int:
    """Tokens per row as sentence-transformers truncates: a saved max_seq_length, else the
    tokenizer's limit (a plain HF folder: at most 512), capped at the positions a row can
    read (``usable_positions``: sentence-transformers' cap at ``max_position_embeddings``
    leaves a model numbering tokens after its padding index failing on a long text; where it
    gives vectors, this cap gives the same). Without the loaded ``tokenizer``, its limit as
    ``load_tokenizer`` sets it (a job's checks before any load)."""
    limit = (int(tokenizer.model_max_length) if tokenizer is not None
             else _tokenizer_limit(files))
    if not files.sentence_transformers:
        limit = min(limit, PLAIN_MAX_LENGTH)
    return min(limit, usable_positions(config))


def _tokenizer_limit(files: ModelFiles) -> int:
    """The tokenizer's ``model_max_length`` as ``load_tokenizer`` makes it, unloaded: its
    arguments', else max_seq_length, else its tokenizer_config.json's (else none: no limit)."""
    given = files.transformer.tokenizer_args.get("model_max_length")
    if given is None:
        given = files.transformer.max_seq_length
    if given is None:
        config = files.transformer_dir / "tokenizer_config.json"
        given = read_json(config).get("model_max_length") if config.is_file() else None
    return int(given) if isinstance(given, int | float) and given > 0 else 1 << 62


def load_failed(folder: Path, exc: BaseException) -> ModelError:
    """What transformers raised reading model ``folder`` (OSError, ValueError, KeyError), as
    one line."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ModelError(f"cannot load an encoder from {folder}: {first}")


def check_max_length(max_length: int, config: ModelConfig, folder: Path) -> None:
    """A job's ``max_length`` fits the rows model ``folder`` reads; else one line."""
    usable = usable_positions(config)
    if max_length > usable:
        skipped = position_offset(config)
        less = f" less the {skipped} its embeddings skip" if skipped else ""
        raise ConfigError(
            f"max_length {max_length} exceeds the {usable} tokens model {folder} reads in a "
            f"row (its {model_positions(config)} positions{less})"
        )


def usable_positions(config: ModelConfig) -> int:
    """The longest row the model reads: its positions less those its embeddings skip."""
    return model_positions(config) - position_offset(config)


def model_positions(config: ModelConfig) -> int:
    """The model's position embeddings (512 where its config names none)."""
    return int(getattr(config, "max_position_embeddings", None) or 512)


def position_offset(config: ModelConfig) -> int:
    """Positions the transformer's embeddings never use: models that number real tokens from
    a padding index + 1 (``bert_family.position_padding``) read position ``padding_idx + n``
    for a row of ``n`` tokens; 0 elsewhere."""
    from pipeline.bert_family import position_padding

    padding = position_padding(config)
    return 0 if padding is None else padding + 1


def load_head(files: ModelFiles):
    """The Dense and Normalize modules after Pooling, as one module (possibly empty)."""
    from pipeline.models.head import ModelHead

    steps = [load_dense(e.path) if e.kind == "Dense" else Normalize() for e in files.head]
    return ModelHead(steps).eval()
