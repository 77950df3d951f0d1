"""Reading a JSON config of a model folder: one clear line when it is not what it should be."""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import ModelError
from pipeline.storage import parse_json


def read_json(path: Path, kind: type = dict) -> dict | list:
    """The parsed ``path``; a missing, unreadable or wrongly shaped file fails naming it."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ModelError(f"{path} is missing") from None
    except OSError as exc:
        raise ModelError(f"cannot read {path}: {exc.strerror or exc}") from None
    value = parse_json(raw, str(path), ModelError)
    if not isinstance(value, kind):
        raise ModelError(f"{path} must hold a JSON {kind.__name__}, not {type(value).__name__}")
    return value


def read_optional_json(path: Path) -> dict:
    """``read_json`` of a config file that may be absent (then: no options)."""
    return read_json(path) if path.is_file() else {}
