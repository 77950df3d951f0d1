"""A learned pooling head's two files, read as untrusted input and without torch.

``head.json`` (``HeadConfig``) and ``head.safetensors``: each must be a regular file (a symlink
only to one inside the head's folder) and is read only up to its bound; ``head.json`` is
validated (its ``layers`` too), the tensor shapes it implies (``expected_shapes``) are checked
against the file size and the safetensors header before any tensor is allocated, so a bad
JSON, a device or FIFO, a truncated file, a malformed header, a huge shape or a shape that
disagrees with the JSON fails in one line, early. ``head_file_digests`` gives a job's keys
the files' digests this way; ``pipeline.poolers.heads.load_head`` builds the module.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Collection
from typing import Annotated

from fsspec.implementations.local import LocalFileSystem
from pydantic import AllowInfNan, BaseModel, Field, model_validator

from pipeline import storage
from pipeline.config import AS_LIST, HEAD_JSON, HEAD_WEIGHTS, STRICT, HeadKind, resolve_layer
from pipeline.errors import ConfigError

MAX_JSON_BYTES = 1 << 20  # head.json and the safetensors header are small
MAX_LAYERS = 1024  # no encoder has more layers; a head reads each at most once


class HeadConfig(BaseModel):
    model_config = STRICT

    kind: HeadKind
    hidden_size: int = Field(gt=0)
    num_layers: int = Field(gt=0, le=MAX_LAYERS)
    model_hash: str
    layers: Annotated[tuple[int, ...], AS_LIST] = (-1,)
    max_positions: int = Field(default=512, gt=0)
    adapter: bool = False
    out_dim: int | None = Field(default=None, gt=0)
    format_version: int = 1
    # what training measured: a diverged run's loss may be NaN, and is kept as it was
    metrics: dict[str, Annotated[float, AllowInfNan()]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_layers(self) -> HeadConfig:
        """Non-empty, each a layer of a ``num_layers`` encoder, none twice (-1 and L alike)."""
        top = self.num_layers
        bad = [i for i in self.layers if not -(top + 1) <= i <= top]
        if not self.layers or bad:
            raise ValueError(f"layers must be a non-empty list of layers {-(top + 1)}..{top} "
                             f"of a {top}-layer encoder, got {list(self.layers)[:8]}")
        if len(set(self.resolved_layers)) != len(self.layers):
            raise ValueError(f"layers must be distinct, got {list(self.layers)[:8]}")
        return self

    @property
    def resolved_layers(self) -> tuple[int, ...]:
        """``layers`` as 0 (embeddings) .. ``num_layers``."""
        return tuple(resolve_layer(i, self.num_layers) for i in self.layers)

    def identity(self) -> dict:
        """Every field that decides the head's vectors (not its recorded metrics), with the
        layers resolved so that ``-1`` and ``num_layers`` name the same vectors."""
        return self.model_dump(mode="json", exclude={"metrics"}) | {
            "layers": list(self.resolved_layers)}

    @property
    def dim(self) -> int:
        if self.has_adapter:
            return self.out_dim or self.hidden_size
        return self.hidden_size

    @property
    def has_adapter(self) -> bool:
        return self.adapter or self.kind == "adapter"


def expected_shapes(cfg: HeadConfig) -> dict[str, tuple[int, ...]]:
    """The float32 tensors (name: shape) a head of ``cfg`` has, computed without making it."""
    h = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {}
    if cfg.kind == "attention":
        shapes |= {"scorer.weight": (1, h), "scorer.bias": (1,)}
    if cfg.kind == "positional":
        shapes["position_logits"] = (cfg.max_positions,)
    if cfg.kind == "layer_weights":
        shapes["layer_logits"] = (len(cfg.layers),)
    if cfg.has_adapter:
        out = cfg.out_dim or h
        shapes |= {"adapter.weight": (out, h), "adapter.bias": (out,)}
    return shapes


CONFIG_KEY = "head_config"  # the safetensors metadata key of ``config_digest``


def read_head_config(folder: str) -> HeadConfig:
    """``head.json`` of ``folder``, validated; one ConfigError line when it is not one."""
    return _head_config(folder)[0]


def check_trained_for(folder: str, cfg: HeadConfig, model_hashes: Collection[str],
                      model: str) -> None:
    """Refuse a head trained for another encoder than ``model`` (whose hash is one of
    ``model_hashes``): its weights read states they were not trained on."""
    if cfg.model_hash not in model_hashes:
        from pipeline.models.hashing import int8_hint

        making = sorted(model_hashes)
        raise ConfigError(f"pooling head {folder} was trained for encoder {cfg.model_hash}, "
                          f"not for {model} ({' or '.join(making)})"
                          + "".join(dict.fromkeys(int8_hint(cfg.model_hash, h) for h in making)))


def check_positions(name: str, folder: str, cfg: HeadConfig, tokens: int, source: str) -> None:
    """Refuse a positional head (one weight per position) for rows of up to ``tokens`` tokens
    (``source`` says what sets that) where it covers fewer positions."""
    if cfg.kind == "positional" and cfg.max_positions < tokens:
        raise ConfigError(
            f"pooler {name!r}: positional head {folder} covers {cfg.max_positions} token "
            f"positions, rows here take up to {tokens} tokens ({source}): set max_length (or a "
            f"window size) of at most {cfg.max_positions}, or use a head trained with "
            f"max_positions >= {tokens}"
        )


def head_file_digests(folder: str) -> list[str]:
    """The SHA-256 of ``head.json`` and ``head.safetensors`` (what a job's keys take), each
    read as ``load_head`` reads it: a regular file inside the folder, no larger than its
    checked ``head.json`` allows (a device, a FIFO or a huge file is one line, never read)."""
    cfg, config_bytes = _head_config(folder)
    weights, _ = read_weights(storage.join(folder, HEAD_WEIGHTS), folder, expected_shapes(cfg))
    return [hashlib.sha256(raw).hexdigest() for raw in (config_bytes, weights)]


def _head_config(folder: str) -> tuple[HeadConfig, bytes]:
    url = storage.join(folder, HEAD_JSON)
    size = _checked_size(url, folder)
    if size > MAX_JSON_BYTES:
        raise ConfigError(f"pooling head {url} is larger than {MAX_JSON_BYTES:,} bytes")
    data = _read_at_most(url, size)
    raw = storage.parse_json(data, f"pooling head {url}", ConfigError)
    if not isinstance(raw, dict):
        raise ConfigError(f"pooling head {url} is not a JSON object")
    from pipeline.config import parse

    return parse(HeadConfig, raw, f"pooling head {url}"), data


def config_digest(cfg: HeadConfig) -> str:
    """A digest of what in head.json decides the head's vectors (``HeadConfig.identity``)."""
    from pipeline.config import stable_hash

    return stable_hash(cfg.identity())


def check_saved_config(metadata: dict, cfg: HeadConfig, folder: str) -> None:
    """The weights carry the digest of the head.json they were saved with (``save_head``, in
    the safetensors ``metadata``), so their hash, which the set's fingerprint takes, covers
    head.json too: a head.json edited since (another layer read, another kind) is refused.
    Heads saved before the digest carry none and load as they did."""
    saved = metadata.get(CONFIG_KEY)
    if saved is not None and saved != config_digest(cfg):
        raise ConfigError(
            f"pooling head {folder}: its {HEAD_JSON} is not the one its weights were saved "
            f"with (layers, kind or sizes changed since): restore it or train the head again"
        )


def _checked_size(url: str, folder: str) -> int:
    """Bytes of ``url``, a regular file (not a device or FIFO) that stays inside ``folder``."""
    fs, path = storage.filesystem(url)
    with storage.explained(url, "read"):
        info = fs.info(path)
    if info.get("type") != "file":
        raise ConfigError(f"pooling head {url} is not a regular file")
    if isinstance(fs, LocalFileSystem):
        real, base = os.path.realpath(path), os.path.realpath(storage.filesystem(folder)[1])
        if os.path.commonpath([real, base]) != base:
            raise ConfigError(f"pooling head {url} links to {real}, outside the head's folder")
    return int(info["size"])


def _read_at_most(url: str, size: int) -> bytes:
    """The bytes of ``url``, whose checked (and bounded) size was ``size``: no more are read,
    and one ConfigError line says so if it has grown or shrunk since."""
    with storage.explained(url, "read"), storage.open_file(url) as fh:  # still a regular file
        raw = fh.read(size + 1)
    if len(raw) != size:
        raise ConfigError(f"pooling head {url} changed while it was read "
                          f"({size:,} bytes before)")
    return raw


def read_weights(url: str, folder: str, shapes: dict[str, tuple[int, ...]]
                  ) -> tuple[bytes, dict]:
    """The bytes of ``url`` once its size and header agree with ``shapes`` (float32), and the
    header's metadata."""
    data = sum(4 * math.prod(shape) for shape in shapes.values())
    size = _checked_size(url, folder)
    if not 8 < size <= 8 + MAX_JSON_BYTES + data:
        raise ConfigError(f"pooling head {url} has {size:,} bytes; its head.json needs "
                          f"{data:,} bytes of float32 weights plus a header")
    raw = _read_at_most(url, size)
    (length,) = struct.unpack("<Q", raw[:8])
    found, metadata = _header(raw, length, url)
    if {k: f[:2] for k, f in found.items()} != {k: ("F32", s) for k, s in shapes.items()}:
        got = ", ".join(f"{k} {f[0]} {list(f[1])}" for k, f in sorted(found.items()))
        raise ConfigError(f"pooling head {url} does not match its head.json: it holds {got}; "
                          f"head.json needs {_describe(shapes)}")
    if len(raw) != 8 + length + data or not _contiguous(list(found.values()), data):
        raise ConfigError(f"pooling head {url} is truncated or damaged: {len(raw):,} bytes, "
                          f"expected {8 + length + data:,}")
    return raw, metadata


Entry = tuple[str, tuple[int, ...], tuple[int, int]]


def _header(raw: bytes, length: int, url: str) -> tuple[dict[str, Entry], dict]:
    """The safetensors header's tensors as (dtype, shape, data_offsets), each checked, and
    its metadata (string to string, ``{}`` where there is none)."""
    try:
        header = json.loads(raw[8:8 + length]) if length <= MAX_JSON_BYTES else None
    except (ValueError, RecursionError):  # not JSON or UTF-8, nested too deep, a huge int
        header = None
    if not isinstance(header, dict):
        raise ConfigError(f"pooling head {url} is not a safetensors file (bad header)")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise ConfigError(f"pooling head {url} is not a safetensors file (bad metadata)")
    found = {name: _entry(value) for name, value in header.items()}
    bad = sorted(name for name, entry in found.items() if entry is None)
    if bad:
        raise ConfigError(f"pooling head {url} is not a safetensors file: header entry "
                          f"{bad[0]!r} lacks a dtype, a shape of sizes or two data offsets")
    return found, metadata


def _entry(value: object) -> Entry | None:
    """One header entry, or None unless it has a dtype string, a list of sizes and a
    ``[begin, end]`` byte range (non-negative integers, begin <= end)."""
    if not isinstance(value, dict) or not isinstance(value.get("dtype"), str):
        return None
    shape, offsets = value.get("shape"), value.get("data_offsets")
    if not _naturals(shape) or not _naturals(offsets) or len(offsets) != 2:
        return None
    if offsets[0] > offsets[1]:
        return None
    return value["dtype"], tuple(shape), (offsets[0], offsets[1])


def _naturals(value: object) -> bool:
    """A JSON list of non-negative integers (booleans are not)."""
    return isinstance(value, list) and all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value)


def _contiguous(tensors: list[Entry], data: int) -> bool:
    """The tensors' data_offsets tile [0, data) exactly, each as long as its shape needs."""
    if any(end - begin != 4 * math.prod(shape) for _, shape, (begin, end) in tensors):
        return False
    spans = sorted(offsets for _, _, offsets in tensors)
    ends = [0] + [end for _, end in spans]
    return [begin for begin, _ in spans] == ends[:-1] and ends[-1] == data


def _describe(shapes: dict[str, tuple[int, ...]]) -> str:
    return ", ".join(f"{k} F32 {list(s)}" for k, s in sorted(shapes.items()))
