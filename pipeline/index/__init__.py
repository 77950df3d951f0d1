"""FAISS indexes over embedding sets: plan, build, catch up, tune, publish, load.

``index_set(IndexRequest(...))`` brings ``OUT/index/<set>/`` up to date; ``open_index``
loads a published index for search.
"""

from pipeline.index.build import IndexRequest, IndexResult, index_set
from pipeline.index.handle import IndexHandle
from pipeline.index.plan import IndexPlan, parse_bytes, plan_index
from pipeline.index.store import IndexMeta, index_url, read_meta
from pipeline.sets import list_sets

__all__ = [
    "IndexHandle", "IndexMeta", "IndexPlan", "IndexRequest", "IndexResult",
    "index_set", "index_url", "list_sets", "open_index", "parse_bytes", "plan_index",
    "read_meta",
]


def open_index(out: str, meta: IndexMeta) -> IndexHandle:
    """A published index, loaded (from a local cache for remote OUT) and tuned as recorded."""
    from pipeline.index import store

    index, idmap = store.load(out, meta)
    return IndexHandle(index, idmap, meta.params)
