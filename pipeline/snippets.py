"""Corpus text joined back to search results by id, for snippets.

The corpus is the one the operator names, or the one recorded in the set's ``_SET.json``
(``corpus``, ``id_column``, ``text_column``). Neither is trusted until ``check`` has seen
that it is a corpus of the set: the id and text columns exist with usable types in every
file, and nearly every id of a sample of the set's ids is found in it. The id columns are read
once (one row group at a time) and kept in memory; texts are read only for the row groups
that hold a result, with a small cache of groups.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import storage
from pipeline.corpus import holds_text, plain_text, text_reason, text_value
from pipeline.errors import EmbedpipeError

SNIPPET_CHARS = 200
SAMPLE_IDS = 64
MIN_FOUND = 0.9  # share of the sample that must be in the corpus (runs may delete a few rows)


class SnippetStore:
    def __init__(self, corpus: str, id_column: str = "id", text_column: str = "text",
                 cache_groups: int = 32) -> None:
        self.corpus = corpus
        self.id_column = id_column
        self.text_column = text_column
        self._groups: list[tuple[str, int, pa.Array]] | None = None
        self._cache: OrderedDict[tuple[str, int], tuple[pa.Array, pa.Array]] = OrderedDict()
        self._cache_groups = cache_groups
        self._lock = threading.Lock()
        self.problem: str | None = None  # why the last ``texts`` call found no corpus to read

    def check(self, set_ids: pa.Array) -> str | None:
        """Why this is not a corpus of the set with ``set_ids`` (one line), or None if it is."""
        try:
            problem = self._schema_problem(set_ids.type)
            if problem:
                return problem
            sample = _sample(set_ids)
            found = len(self.texts(sample.to_pylist())) if len(sample) else 0
        except EmbedpipeError as exc:
            return str(exc)
        if self.problem:
            return self.problem
        if found < MIN_FOUND * len(sample):
            return (f"{self.corpus} is not the set's corpus: only {found} of {len(sample)} "
                    f"sampled ids of the set are in its column {self.id_column!r}")
        return None

    def _schema_problem(self, id_type: pa.DataType) -> str | None:
        for url in storage.expand_parquet(self.corpus):
            _, schema = storage.parquet_footer(url)
            missing = [c for c in (self.id_column, self.text_column) if c not in schema.names]
            if missing:
                return f"{url} has no column {missing[0]!r}"
            if _kind(schema.field(self.id_column).type) != _kind(id_type):
                return (f"{url}: column {self.id_column!r} is "
                        f"{schema.field(self.id_column).type}, but the set's ids are {id_type}")
            if not holds_text(schema.field(self.text_column).type):
                return f"{url}: column {self.text_column!r} is not text"
        return None

    def _load_ids(self) -> list[tuple[str, int, pa.Array]]:
        groups = []
        for url in storage.expand_parquet(self.corpus):
            with storage.parquet_file(url) as pf, storage.explained(url, "read"):
                if self.id_column not in pf.schema_arrow.names:
                    raise _Moved(f"{url} has no column {self.id_column!r}")
                for g in range(pf.metadata.num_row_groups):
                    ids = pf.read_row_group(g, columns=[self.id_column]).column(0)
                    groups.append((url, g, ids.combine_chunks()))
        return groups

    def texts(self, ids: list, chars: int = SNIPPET_CHARS) -> dict:
        """{id: first ``chars`` characters of its text} for the ids found in the corpus.

        The corpus may change under a long-lived searcher (a nightly rewrite before the next
        run): each text is read beside its id, and where the id there is no longer the one
        the id map placed there, or the group or file is gone, the ids are read again once
        (not where they were read by this call). Where that fails too, the ids get no snippet
        and ``problem`` says why: a search's hits never depend on the corpus."""
        with self._lock:
            tries = 1 if self._groups is None else 2  # ids read before may be stale: once more
            for _ in range(tries):
                try:
                    found = self._found(ids, chars)
                except (_Moved, EmbedpipeError) as exc:
                    self._groups, problem = None, f"no snippets from {self.corpus}: {exc}"
                    self._cache.clear()
                    continue
                self.problem = None
                return found
            self.problem = problem
            return {}

    def _found(self, ids: list, chars: int) -> dict:
        if self._groups is None:
            self._groups = self._load_ids()
        found: dict = {}
        wanted = set(ids)
        for url, group, column in self._groups:
            if not wanted:
                break
            value_set = _of_type(list(wanted), column.type)
            pos = pc.index_in(value_set, value_set=column).to_numpy(zero_copy_only=False)
            hits = [(v, int(p)) for v, p in zip(value_set.to_pylist(), pos, strict=True)
                    if not np.isnan(p)]
            if not hits:
                continue
            group_ids, texts = self._text_group(url, group)
            for value, row in hits:
                if row >= len(group_ids) or group_ids[row].as_py() != value:
                    raise _Moved(f"{url} changed since its ids were read")
                text = _embedded_text(value, row, group_ids, texts)
                if text is not None:
                    found[value] = _clip(text, chars)
                    wanted.discard(value)
        return found

    def _text_group(self, url: str, group: int) -> tuple[pa.Array, pa.Array]:
        """A row group's ids and texts, read together (cached)."""
        key = (url, group)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        with storage.explained(url, "read"), storage.parquet_file(url) as pf:
            columns = [self.id_column, self.text_column]
            gone = not set(columns) <= set(pf.schema_arrow.names)
            if gone or group >= pf.metadata.num_row_groups:
                raise _Moved(f"{url} changed since its ids were read")
            table = pf.read_row_group(group, columns=columns)
        ids, texts = (table.column(c).combine_chunks() for c in (self.id_column, self.text_column))
        self._cache[key] = (ids, plain_text(texts))
        while len(self._cache) > self._cache_groups:
            self._cache.popitem(last=False)
        return self._cache[key]


class _Moved(Exception):
    """A row the id map placed is no longer there: the corpus changed since it was read."""


def _kind(kind: pa.DataType) -> str:
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    if pa.types.is_integer(kind):
        return "integer"
    if (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or pa.types.is_string_view(kind)):
        return "string"
    return str(kind)


def _sample(ids: pa.Array) -> pa.Array:
    """Up to SAMPLE_IDS ids spread evenly over ``ids``."""
    picks = np.unique(np.linspace(0, len(ids) - 1, min(len(ids), SAMPLE_IDS)).astype(np.int64))
    return ids.take(pa.array(picks)) if len(ids) else ids


def _of_type(values: list, dtype: pa.DataType) -> pa.Array:
    """The ``values`` an array of ``dtype`` can hold (integers in its range), as one: a set's
    ids may lie beyond a corpus file's integer type, and beyond int64 (uint64)."""
    if pa.types.is_integer(dtype):
        bounds = np.iinfo(dtype.to_pandas_dtype())
        values = [v for v in values if isinstance(v, int) and bounds.min <= v <= bounds.max]
    else:
        values = [v for v in values if isinstance(v, str)]
    return pa.array(values, dtype)


def _embedded_text(value: object, row: int, ids: pa.Array, texts: pa.Array) -> str | None:
    """The text a run embedded for ``value`` in this group: the first of its rows from ``row``
    on whose text is text with a visible character (``--dedupe`` keeps the first valid row of
    an id, not one a run skipped), or None if no row of this group holds one."""
    text = text_value(texts[row].as_py())
    if text_reason(text) is None:
        return text
    same = pc.equal(ids, pa.scalar(value, ids.type)).to_numpy(zero_copy_only=False)
    for at in np.flatnonzero(same[row + 1:]) + row + 1:
        text = text_value(texts[int(at)].as_py())
        if text_reason(text) is None:
            return text
    return None


def _clip(text: str, chars: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= chars else flat[: chars - 1] + "…"
