"""``modules.json``: which modules a sentence-transformers model chains, and where they live.

Only module types embedpipe runs exactly are accepted; any other fails before any work with
one line naming it. Types are matched by their class name inside the ``sentence_transformers``
package (old saves say ``sentence_transformers.models.Pooling``, new ones
``sentence_transformers.sentence_transformer.modules.pooling.Pooling``); nothing is imported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import ModelError
from pipeline.models.folder import MODULES_JSON
from pipeline.models.jsonfile import read_json

SUPPORTED = ("Transformer", "Pooling", "Dense", "Normalize")
HEAD_KINDS = ("Dense", "Normalize")
_PATH = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*$")


@dataclass(frozen=True)
class ModuleEntry:
    """One module: its kind (one of SUPPORTED) and its folder inside the model folder."""

    kind: str
    path: Path


def read_modules(folder: Path) -> tuple[ModuleEntry, ...]:
    """The modules of ``folder`` in order: Transformer, Pooling, then Dense / Normalize."""
    source = folder / MODULES_JSON
    raw = read_json(source, list)
    entries = tuple(_entry(folder, source, item) for item in raw)
    kinds = [e.kind for e in entries]
    if kinds[:2] != ["Transformer", "Pooling"] or any(k not in HEAD_KINDS for k in kinds[2:]):
        raise ModelError(
            f"{source}: modules {kinds} are not supported; embedpipe runs Transformer, Pooling, "
            "then any Dense and Normalize modules"
        )
    return entries


def _entry(folder: Path, source: Path, item: object) -> ModuleEntry:
    if not isinstance(item, dict) or not isinstance(item.get("type"), str):
        raise ModelError(f"{source}: every module needs a 'type', got {item!r}")
    kind_path = item["type"]
    kind = kind_path.rsplit(".", 1)[-1]
    if not kind_path.startswith("sentence_transformers.") or kind not in SUPPORTED:
        raise ModelError(
            f"{source}: module type {kind_path!r} is not supported (supported: "
            f"{', '.join(SUPPORTED)})"
        )
    path = item.get("path", "")
    if not isinstance(path, str) or (path and (not _PATH.match(path) or ".." in path.split("/"))):
        raise ModelError(f"{source}: module path {path!r} is not a folder inside the model")
    where = folder / path if path else folder
    if not where.resolve().is_relative_to(folder.resolve()):  # a link out of the folder
        raise ModelError(f"{source}: module path {path!r} leads out of the model folder "
                         f"(to {where.resolve()})")
    return ModuleEntry(kind, where)
