"""What the encoder takes from a model's tokenizer and config, recorded once, read back without
transformers.

Importing transformers for ``AutoConfig`` and ``AutoTokenizer`` took ~0.9 s of a cold
``embedpipe embed`` (2-core VM, py-spy), on the thread loading the model while the main thread
imported Prefect: both hold the GIL, so the start waited for both. Everything the encoder reads
from the two is small: the Rust tokenizer behind the fast tokenizer (after the lower-casing
sentence-transformers adds), its pad and special ids, input names, length limit and truncation
side, the special tokens it wraps around a text, and the config's attributes. ``load`` records
them as JSON under ``EMBEDPIPE_CACHE`` the first time a model loads through transformers and
reads them back on later starts. The key covers every file of the transformer's folder (name,
size, mtime), the model hash (configs of every module), the tokenizer options and the
transformers and tokenizers versions, so a changed file or upgrade loads through transformers
again. A model that runs its own code (``trust_remote_code``) is never recorded: its tokenizer
may do more than its JSON says.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

from pipeline.config import stable_hash
from pipeline.errors import ModelError
from pipeline.settings import cache_root, write_cache

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from pipeline.models.loader import ModelFiles

SCHEMA = 3  # 2: the config's mapped attribute names recorded too; 3: the truncation side
PROBE = "hello world"  # tokenized with and without special tokens: what wraps a text
SIDES = ("right", "left")  # which end of a long text the tokenizer cuts


@dataclass(frozen=True)
class TokenizerFacts:
    """A fast tokenizer as the encoder uses it."""

    backend: str  # the Rust tokenizer's JSON (``tokenizers.Tokenizer.to_str``)
    pad_token_id: int | None
    model_input_names: tuple[str, ...]
    all_special_ids: tuple[int, ...]
    model_max_length: int
    prefix: tuple[int, ...]  # special tokens before a text ([CLS] for BERT)
    suffix: tuple[int, ...]  # and after it ([SEP])
    truncation_side: str = "right"  # "left": a long text keeps its last tokens

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerFast, folder: Path) -> TokenizerFacts:
        """The facts of a loaded transformers fast tokenizer."""
        bare = tokenizer(PROBE, add_special_tokens=False)["input_ids"]
        wrapped = tokenizer(PROBE, add_special_tokens=True)["input_ids"]
        at = next((i for i in range(len(wrapped) - len(bare) + 1)
                   if wrapped[i : i + len(bare)] == bare), None)
        if at is None:
            raise ModelError(f"cannot tell the special tokens of the tokenizer in {folder}")
        side = tokenizer.truncation_side
        if side not in SIDES:
            raise ModelError(f"the tokenizer in {folder} truncates on side {side!r}, not one of "
                             f"{', '.join(SIDES)}")
        return cls(tokenizer.backend_tokenizer.to_str(), tokenizer.pad_token_id,
                   tuple(tokenizer.model_input_names), tuple(tokenizer.all_special_ids),
                   int(min(tokenizer.model_max_length, 2**62)), tuple(wrapped[:at]),
                   tuple(wrapped[at + len(bare) :]), side)

    def ids_tokenizer(self):
        """A copy of the Rust tokenizer that never truncates or pads: what the fast
        tokenizer's ``__call__`` runs for token ids, without building Python dicts of every
        output (``encode_batch_fast`` on it skips the character offsets nobody reads)."""
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(self.backend)
        backend.no_truncation()
        backend.no_padding()
        return backend


class RecordedConfig(SimpleNamespace):
    """A transformers config's attributes (``config_attributes``), read back from a record:
    enough for the fused forward; ``loader.transformers_config`` loads the real one where
    transformers' own model is needed."""


if TYPE_CHECKING:
    from transformers import PretrainedConfig

    ModelConfig = PretrainedConfig | RecordedConfig  # what the encoder and fused forward read


def load(files: ModelFiles, files_hash: str, trust_remote_code: bool
         ) -> tuple[ModelConfig, TokenizerFacts]:
    """(config, tokenizer facts) of the model in ``files`` (whose ``model_hash()`` is
    ``files_hash``): from the record where one holds, else through transformers (and
    recorded, unless the model may run its own code)."""
    from pipeline.models import loader

    loader.ready_kernels()
    key = None if trust_remote_code else _key(files, files_hash)
    path = cache_root() / "recorded" / f"{key}.json" if key else None
    record = _read(path) if path else None
    if record is not None:
        return record
    config = loader.load_config(files, trust_remote_code)
    facts = TokenizerFacts.of(loader.load_tokenizer(files, trust_remote_code),
                              files.transformer_dir)
    if path:
        write_cache(path, {"schema": SCHEMA, "config": config_attributes(config),
                           "tokenizer": asdict(facts)})
    return config, facts


def config_attributes(config: PretrainedConfig) -> dict:
    """``config.to_dict()`` and the names its class maps onto its own fields
    (``attribute_map``: DistilBERT's ``hidden_size`` is its ``dim``), as the config answers
    them: what the encoder reads of any model."""
    return config.to_dict() | {alias: getattr(config, alias) for alias in config.attribute_map}


def _read(path: Path) -> tuple[RecordedConfig, TokenizerFacts] | None:
    try:
        record = json.loads(path.read_text())
        if record.get("schema") != SCHEMA:
            return None
        tokenizer = {k: tuple(v) if isinstance(v, list) else v
                     for k, v in record["tokenizer"].items()}
        return RecordedConfig(**record["config"]), TokenizerFacts(**tokenizer)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None  # absent, unreadable or of another layout: load through transformers


def _key(files: ModelFiles, files_hash: str) -> str:
    folder = files.transformer_dir
    stats = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns)
                   for p in folder.iterdir() if p.is_file())
    return stable_hash([str(folder.resolve()), stats, files_hash,
                        asdict(files.transformer), version("transformers"),
                        version("tokenizers"), SCHEMA])
