"""Reading a JSON config of a model folder: one clear line when it is not what it should be."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.errors import ModelError


def read_json(path: Path, kind: type = dict) -> dict | list:
    """The parsed ``path``; a missing, unreadable or wrongly shaped file fails naming it."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelError(f"{path} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"{path} is not readable JSON: {exc}") from None
    if not isinstance(value, kind):
        raise ModelError(f"{path} must hold a JSON {kind.__name__}, not {type(value).__name__}")
    return value


def read_optional_json(path: Path) -> dict:
    """``read_json`` of a config file that may be absent (then: no options)."""
    return read_json(path) if path.is_file() else {}
