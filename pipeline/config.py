"""Validated configuration: encoder, poolers, windows and the embedding job.

Everything a user stores or passes between processes is one of these models, so a typo in
a TOML file or a flag fails at once with the field named, not deep inside a worker.
"""

from __future__ import annotations

import hashlib
import json
import math
import tomllib
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    model_validator,
)

from pipeline.errors import ConfigError
from pipeline.names import SET_NAME

LayerCombine = Literal["mean", "max", "concat", "weighted"]
WindowAgg = Literal["mean", "max", "weighted", "first"]
Device = Literal["auto", "cpu", "cuda"]
DType = Literal["auto", "fp32", "bf16", "fp16", "int8"]  # int8: opt-in, CPU only
# where dtype int8 runs: auto = oneDNN in the fused forward where this model and CPU allow it,
# else ONNX Runtime; each makes its own vectors (a set keeps the one that made it)
Int8Kernel = Literal["auto", "onednn", "onnxruntime"]
Runner = Literal["threads", "processes", "dask"]
HeadKind = Literal["attention", "positional", "layer_weights", "adapter"]  # learned pooler heads
HEAD_JSON = "head.json"  # a learned pooling head folder: its config and weights
HEAD_WEIGHTS = "head.safetensors"
CacheDType = Literal["auto", "fp32", "bf16"]  # encoder states cached for head training


def resolve_layer(index: int, num_layers: int) -> int:
    """Map ``-1`` (last) .. ``-(L+1)`` (embeddings) and ``0..L`` onto ``0..L``."""
    if not -(num_layers + 1) <= index <= num_layers:
        raise ConfigError(
            f"layer {index} is out of range for a model with {num_layers} layers "
            f"(valid: {-(num_layers + 1)}..{num_layers})"
        )
    return index % (num_layers + 1)


# What a user stores (TOML, Prefect parameters, JSON) is taken at its type: `true` is no row
# count and "no" no boolean (pydantic's lax mode reads them as 1 and false), and a number is
# finite (JSON has no inf: Prefect would store a lease_wait of inf as null). STRICT is the
# model config; a tuple field is AS_LIST: it takes the list JSON and TOML give, and its items
# stay strict.
STRICT = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)
AS_LIST = Strict(False)


class _Strict(BaseModel):
    model_config = STRICT


class PoolerSpec(_Strict):
    """One named pooler set: a registered strategy and its options.

    ``name`` names the set on disk; ``strategy`` names the registered pooler (it defaults
    to ``name``, so ``PoolerSpec(name="mean")`` is the built-in mean).
    """

    name: str = Field(pattern=SET_NAME.pattern)
    strategy: str | None = None
    layers: Annotated[tuple[int, ...], AS_LIST] = (-1,)
    layer_combine: LayerCombine = "mean"
    layer_weights: Annotated[tuple[float, ...], AS_LIST] | None = None
    normalize: bool = True
    truncate_dim: int | None = Field(default=None, gt=0)
    window_agg: WindowAgg | None = None
    head: str | None = None
    model_head: bool = False  # apply the model's own Dense / Normalize modules after pooling

    @model_validator(mode="after")
    def _check(self) -> PoolerSpec:
        if self.strategy is None:
            object.__setattr__(self, "strategy", self.name)
        if not self.layers:
            raise ValueError("layers must name at least one layer")
        if len(set(self.layers)) != len(self.layers):
            raise ValueError(f"layers has duplicates: {list(self.layers)}")
        if self.layer_combine == "weighted":
            self._check_weights()
        elif self.layer_weights is not None:
            raise ValueError("layer_weights is only used with layer_combine = 'weighted'")
        if self.strategy == "learned" and not self.head:
            raise ValueError("the 'learned' pooler needs head = <folder with head.safetensors>")
        return self

    def _check_weights(self) -> None:
        """``weighted`` is a weighted mean of the layers (each weight over their sum): every
        weight >= 0 and their sum finite and above 0, else the vectors would be NaN or inf."""
        weights = self.layer_weights
        if weights is None or len(weights) != len(self.layers):
            raise ValueError("layer_combine = 'weighted' needs one layer_weights per layer")
        if not all(w >= 0 for w in weights) or not 0 < sum(weights) < math.inf:
            raise ValueError(
                f"pooler {self.name!r}: layer_weights {list(weights)} must each be >= 0, their "
                "sum finite and above 0 (layer_combine = 'weighted' is a weighted mean of the "
                "layers)"
            )

    def spec_dict(self) -> dict:
        """The options that change the vectors (what the fingerprint covers)."""
        return self.model_dump(exclude={"name"}, mode="json")


class WindowConfig(_Strict):
    """Long texts are cut into windows of ``size`` tokens (specials included) every ``stride``."""

    size: int = Field(gt=2)
    stride: int = Field(gt=0)
    agg: WindowAgg = "mean"

    @model_validator(mode="after")
    def _check(self) -> WindowConfig:
        if self.stride > self.size - 2:
            raise ValueError(
                f"window stride {self.stride} leaves gaps: it must be <= window size - 2 "
                f"({self.size - 2}) so every token is covered"
            )
        return self


class EncoderConfig(_Strict):
    """Which model runs and how: enough to rebuild the encoder inside any worker."""

    model: str | None = None  # folder or Hugging Face name; None = packaged all-MiniLM-L6-v2
    device: Device = "auto"
    dtype: DType = "auto"
    max_length: int | None = Field(default=None, gt=2)
    window: WindowConfig | None = None
    # padded tokens and rows per forward batch; None: the device's (encoder.BATCH_LIMITS)
    token_budget: int | None = Field(default=None, gt=0)
    max_batch_rows: int | None = Field(default=None, gt=0)
    trust_remote_code: bool = False
    # the transformer through torch.compile (pipeline.compiled): a compile on the first batch,
    # then faster batches; the same vectors within float rounding (not part of a set's key)
    compile: bool = False
    int8_kernel: Int8Kernel = "auto"
    # prompts of a sentence-transformers model (config_sentence_transformers.json), by name:
    # None = the model's default_prompt_name for documents and its "query" prompt for
    # queries; "" = no prompt
    prompt_name: str | None = None
    query_prompt_name: str | None = None

    @model_validator(mode="after")
    def _compiled_in_torch(self) -> EncoderConfig:
        if self.compile and self.dtype == "int8":
            raise ValueError("compile runs the torch model; dtype int8 runs its own int8 "
                             "kernels: choose one")
        if self.int8_kernel != "auto" and self.dtype != "int8":
            raise ValueError(f"int8_kernel {self.int8_kernel} is for dtype int8, not "
                             f"{self.dtype}")
        return self


def _located(path: str) -> str:
    """``path`` if it names a place: not blank ("" would be taken for the working folder),
    and a URL names its bucket (``s3://`` alone joins to ``s3:/...``: a local folder)."""
    if not path.strip():
        raise ValueError("is empty: name a local path or an s3:// URL")
    if "::" in path:  # the chain's first scheme is no bucket's (storage refuses chains)
        raise ValueError(f"{path!r} is a chained URL, which is not supported: give a local "
                         "path or an s3:// URL")
    scheme, sep, rest = path.partition("://")
    if sep and scheme != "file" and not rest.split("/", 1)[0].strip():
        raise ValueError(f"{path!r} names no bucket: give {scheme}://BUCKET/PATH")
    return path


Location = Annotated[str, AfterValidator(_located)]  # a local path or URL to read or write

DAY_S = 86_400.0  # the longest time a setting may name (a lease, a wait: a thread's is never inf)
LeaseWait = Annotated[float, Field(ge=0)]  # seconds to wait for another writer of OUT


class EmbedJob(_Strict):
    """An embedding job over a corpus: what ``embedpipe embed`` and ``backfill`` run."""

    corpus: Location
    out: Location
    encoder: EncoderConfig = EncoderConfig()
    # left out: one set, the model's own (``model``) for a sentence-transformers folder,
    # ``mean`` for a plain Hugging Face encoder (pipeline.models.folder.default_set_name);
    # chosen for the final model and left unset, so a dump with exclude_unset chooses again
    # once installation settings fill in the model; a run then takes the sets already in OUT
    # instead where there are any (pipeline.assembly.keep_sets_current)
    poolers: Annotated[tuple[PoolerSpec, ...], AS_LIST] = ()
    id_column: str = "id"
    text_column: str = "text"
    rows_per_shard: int = Field(default=20_000, gt=0)
    runner: Runner = "threads"
    workers: int = Field(default=1, gt=0)
    dask_address: str | None = None
    quarantine: bool = False
    dedupe: bool = False
    lease_wait: LeaseWait = 0

    @model_validator(mode="after")
    def _default_set(self) -> EmbedJob:
        if "poolers" not in self.model_fields_set:
            from pipeline.models.folder import default_set_name

            default = PoolerSpec(name=default_set_name(self.encoder.model))
            object.__setattr__(self, "poolers", (default,))
        return self

    @model_validator(mode="after")
    def _unique_sets(self) -> EmbedJob:
        names = [p.name for p in self.poolers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"pooler set names must be unique, repeated: {dupes}")
        if not names:
            raise ValueError("at least one pooler is needed")
        return self

    @model_validator(mode="after")
    def _dask_address_with_dask(self) -> EmbedJob:
        if self.dask_address is not None and self.runner != "dask":
            raise ValueError(f"a Dask scheduler address is for runner 'dask', not "
                             f"{self.runner!r} (add --runner dask)")
        return self


def parse(model: type[BaseModel], data: dict, source: str) -> BaseModel:
    """Validate ``data`` into ``model``; a failure becomes one ConfigError line naming fields."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'config'}: {err['msg']}"
            for err in exc.errors()
        )
        raise ConfigError(f"invalid {source}: {problems}") from None


def load_toml(path: str | Path) -> dict:
    """Read a TOML config file into a plain dict (merged with flags by the caller)."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None


def stable_hash(payload: object, length: int = 16) -> str:
    """A short hash of JSON-able data that does not depend on key order."""
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:length]
