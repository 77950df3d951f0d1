"""Reading (query, text) pairs and splitting them into train and held-out by group."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from pipeline import storage
from pipeline.errors import CorpusError

MIN_PAIRS = 20


@dataclass(frozen=True)
class Pairs:
    """Pairs as indices into ``strings`` (every distinct query, and every distinct text, once:
    a string used as both is kept twice, since queries and texts get different prompts)."""

    strings: list[str]
    query: np.ndarray  # [pairs] index into strings
    text: np.ndarray  # [pairs] index into strings
    group: list[str]
    skipped: int  # rows without a usable query or text
    is_query: np.ndarray  # [strings] bool: the string is a query (else a text)

    def __len__(self) -> int:
        return len(self.query)

    def subset(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.query[rows], self.text[rows]


def read_pairs(url: str, query_column: str, text_column: str,
               group_column: str | None = None) -> Pairs:
    """Read the pair columns from a Parquet file, folder or glob (local or s3://).

    Each pair's group (what ``split_groups`` keeps on one side) is its ``group_column`` value,
    or without one its query: every pair of a query is then held out or trained on, never
    both (grouping by text would put a query with several texts on both sides).
    """
    columns = [query_column, text_column] + ([group_column] if group_column else [])
    if len(set(columns)) != len(columns):
        raise CorpusError(f"{url}: query, text and group columns must differ, got {columns}")
    values: dict[str, list] = {column: [] for column in columns}
    for file in storage.expand_parquet(url):  # as Python values: the files' Arrow types
        names = storage.parquet_footer(file)[1].names  # may differ (large_string)
        missing = [c for c in columns if c not in names]
        if missing:
            raise CorpusError(
                f"{file} has no column {', '.join(map(repr, missing))} "
                f"(columns: {', '.join(names)})"
            )
        table = storage.read_parquet(file, columns=columns)
        for column in columns:
            values[column] += table.column(column).to_pylist()
    queries, texts = values[query_column], values[text_column]
    return _index(queries, texts, values[group_column] if group_column else queries, url)


def _index(queries: list, texts: list, groups: list, url: str) -> Pairs:
    ids: dict[tuple[bool, str], int] = {}
    q_idx, t_idx, kept_groups = [], [], []
    for query, text, group in zip(queries, texts, groups, strict=True):
        if not _usable(query) or not _usable(text):
            continue
        q_idx.append(ids.setdefault((True, query), len(ids)))
        t_idx.append(ids.setdefault((False, text), len(ids)))
        kept_groups.append("" if group is None else str(group))
    if len(q_idx) < MIN_PAIRS:
        raise CorpusError(
            f"{url} has {len(q_idx)} usable (query, text) pairs; training a pooling head "
            f"needs at least {MIN_PAIRS}"
        )
    return Pairs([s for _, s in ids], np.asarray(q_idx, np.int64), np.asarray(t_idx, np.int64),
                 kept_groups, len(queries) - len(q_idx),
                 np.fromiter((q for q, _ in ids), bool, len(ids)))


def _usable(value: object) -> bool:
    return isinstance(value, str) and bool(value.strip())


def split_groups(groups: list[str], val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Row indices of (train, held-out): whole groups go to one side, by a stable hash.

    Groups are ordered by the SHA-256 of their name and the first ``val_fraction`` of them
    (at least one) are held out, so the split does not depend on row order or on a seed.
    """
    distinct = sorted(set(groups), key=lambda g: hashlib.sha256(g.encode()).digest())
    if len(distinct) < 2:
        raise CorpusError(
            f"pairs fall into {len(distinct)} group; a held-out split needs at least 2 groups"
        )
    n_val = min(len(distinct) - 1, max(1, round(val_fraction * len(distinct))))
    held = set(distinct[:n_val])
    is_val = np.fromiter((g in held for g in groups), dtype=bool, count=len(groups))
    return np.flatnonzero(~is_val), np.flatnonzero(is_val)
