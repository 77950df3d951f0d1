"""FAISS indexes over embedding sets: plan, build, catch up, tune, publish, load.

``index_set(IndexRequest(...))`` brings ``OUT/index/<set>/`` up to date; ``open_index``
loads a published index for search. The names below load their module on first use, so that
``pipeline.index.plan`` (what the CLI's ``--kind`` help reads) imports without FAISS.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.index.handle import IndexHandle
    from pipeline.index.store import IndexMeta

_HOMES = {  # each name this package exports: the module it lives in
    "IndexRequest": "pipeline.index.build", "IndexResult": "pipeline.index.build",
    "index_set": "pipeline.index.build", "index_targets": "pipeline.index.build",
    "IndexHandle": "pipeline.index.handle",
    "IndexPlan": "pipeline.index.plan", "parse_bytes": "pipeline.index.plan",
    "plan_index": "pipeline.index.plan", "IndexMeta": "pipeline.index.store",
    "index_url": "pipeline.index.store", "read_meta": "pipeline.index.store",
    "holds_set_vectors": "pipeline.index.store",
    "list_sets": "pipeline.sets",
}

__all__ = [*_HOMES, "open_index"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(_HOMES[name]), name)
    return value  # kept here: the next lookup finds it without this hook


def open_index(out: str, meta: IndexMeta) -> IndexHandle:
    """A published index, loaded (from a local cache for remote OUT) and tuned as recorded."""
    from pipeline.index import store
    from pipeline.index.handle import IndexHandle

    index, idmap = store.load(out, meta)
    return IndexHandle(index, idmap, meta.params)
