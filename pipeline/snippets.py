"""Corpus text joined back to search results by id, for snippets.

The corpus location comes from the set's ``_SET.json`` (``corpus``, ``id_column``,
``text_column``). The id columns are read once (one row group at a time) and kept in memory;
texts are read only for the row groups that hold a result, with a small cache of groups.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import storage

SNIPPET_CHARS = 200


class SnippetStore:
    def __init__(self, corpus: str, id_column: str = "id", text_column: str = "text",
                 cache_groups: int = 32) -> None:
        self.corpus = corpus
        self.id_column = id_column
        self.text_column = text_column
        self._groups: list[tuple[str, int, pa.Array]] | None = None
        self._cache: OrderedDict[tuple[str, int], pa.Array] = OrderedDict()
        self._cache_groups = cache_groups
        self._lock = threading.Lock()

    def _load_ids(self) -> list[tuple[str, int, pa.Array]]:
        groups = []
        for url in storage.expand_parquet(self.corpus):
            pf = storage.parquet_file(url)
            with storage.explained(url, "read"):
                for g in range(pf.metadata.num_row_groups):
                    ids = pf.read_row_group(g, columns=[self.id_column]).column(0)
                    groups.append((url, g, ids.combine_chunks()))
        return groups

    def texts(self, ids: list, chars: int = SNIPPET_CHARS) -> dict:
        """{id: first ``chars`` characters of its text} for the ids found in the corpus."""
        with self._lock:
            if self._groups is None:
                self._groups = self._load_ids()
            found: dict = {}
            wanted = set(ids)
            for url, group, column in self._groups:
                if not wanted:
                    break
                value_set = pa.array(list(wanted)).cast(column.type, safe=False)
                pos = pc.index_in(value_set, value_set=column).to_numpy(zero_copy_only=False)
                hits = [(v, int(p)) for v, p in zip(value_set.to_pylist(), pos, strict=True)
                        if not np.isnan(p)]
                if not hits:
                    continue
                texts = self._text_group(url, group)
                for value, row in hits:
                    text = texts[row].as_py()
                    found[value] = _clip(text, chars)
                    wanted.discard(value)
            return found

    def _text_group(self, url: str, group: int) -> pa.Array:
        key = (url, group)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        pf = storage.parquet_file(url)
        with storage.explained(url, "read"):
            texts = pf.read_row_group(group, columns=[self.text_column]).column(0)
        self._cache[key] = texts.combine_chunks()
        while len(self._cache) > self._cache_groups:
            self._cache.popitem(last=False)
        return self._cache[key]


def _clip(text: object, chars: int) -> str:
    if not isinstance(text, str):
        return ""
    flat = " ".join(text.split())
    return flat if len(flat) <= chars else flat[: chars - 1] + "…"
