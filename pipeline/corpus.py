"""Read a Parquet corpus: describe its files, find duplicate ids, stream a shard's valid rows.

Only the id and text columns are ever read, one row group at a time, so memory is bounded
by the largest row group, never by the corpus. Every row is either handed on (valid id,
non-blank string text) or skipped with a ``SkipReason``; nothing disappears.
"""

from __future__ import annotations

import hashlib
import os
import re
import unicodedata
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.utils import glob_translate
from pydantic import BaseModel, ConfigDict

from pipeline import storage
from pipeline.config import stable_hash
from pipeline.errors import CorpusError, StorageError
from pipeline.names import HASHES, PART_PREFIX, QUARANTINE
from pipeline.shards import FileLayout, Shard

SkipReason = Literal["null_id", "null_text", "not_string", "empty_text", "duplicate_id"]
# not visible text on their own: control, format and private-use characters, and combining
# marks with no base character (BERT's tokenizers drop most); and the replacement character,
# which stands for bytes that were not text (a lone surrogate: a query's bytes that were not
# UTF-8, refused as such by search.check_queries)
_DROPPED = frozenset(("Cc", "Cf", "Co", "Mn", "Mc", "Me"))
_REPLACEMENT = "\ufffd"


class CorpusInfo(BaseModel):
    """The corpus as planned: its files (relative names, row groups) and the id column type."""

    model_config = ConfigDict(frozen=True)

    url: str
    files: tuple[FileLayout, ...]
    id_type: str  # the corpus id type ("uint32", "string", ...): every part stores ids as this
    rows: int


def describe(url: str, id_column: str, text_column: str, out: str | None = None
             ) -> CorpusInfo:
    """Open every file's footer, check columns and id types; fail with one line if unusable
    (or if ``out``, the run's OUT, lies inside the corpus: see ``_apart``)."""
    pattern = storage.is_pattern(url)  # on S3 a request: asked once
    urls = storage.expand_parquet(url, pattern)
    root = _root_path(url, pattern)
    if out is not None:
        _apart(url, urls, out, pattern)
    layouts, id_types, unsigned, not_text = [], {}, [], {}
    for file_url in urls:
        meta, schema = _footer(file_url)
        missing = [c for c in (id_column, text_column) if c not in schema.names]
        if missing:
            raise CorpusError(
                f"{file_url} has no column {', '.join(map(repr, missing))} "
                f"(its columns: {', '.join(schema.names)}); pass --id-column/--text-column"
            )
        id_types[file_url] = _id_type(schema.field(id_column).type, file_url, id_column)
        if not holds_text(schema.field(text_column).type):
            not_text[file_url] = schema.field(text_column).type
        if id_types[file_url] == pa.uint64() and not _signed_ids_fit(meta, id_column):
            unsigned.append(file_url)
        groups = [meta.row_group(i) for i in range(meta.num_row_groups)]
        layouts.append(
            FileLayout(
                name=_relative(file_url, root),
                url=file_url,
                group_rows=tuple(g.num_rows for g in groups),
                group_bytes=tuple(g.total_byte_size for g in groups),
                group_content=tuple(_group_content(g, (id_column, text_column))
                                    for g in groups),
            )
        )
    kinds = {"int" if pa.types.is_integer(t) else "str" for t in id_types.values()}
    if len(kinds) > 1:
        listed = ", ".join(f"{u}: {t}" for u, t in list(id_types.items())[:4])
        raise CorpusError(f"id column {id_column!r} has different types across files ({listed})")
    _check_some_text(not_text, len(urls), text_column)
    rows = sum(sum(f.group_rows) for f in layouts)
    if rows == 0:
        raise CorpusError(f"corpus {url} is empty: {len(urls)} Parquet file(s), 0 rows")
    id_type = _common_type(set(id_types.values()), kinds, bool(unsigned))
    if id_type == "int64" and unsigned:
        raise CorpusError(
            f"ids of {unsigned[0]} are uint64 beyond int64 (or unknown: no statistics), but "
            "other files' ids are signed: no one integer type holds both; store them as one type"
        )
    return CorpusInfo(url=url, files=tuple(layouts), id_type=id_type, rows=rows)


def _group_content(group: pq.RowGroupMetaData, columns: tuple[str, str]) -> str:
    """What the footer says of the content of a row group's id and text columns: their
    compressed and plain sizes, and their statistics (min, max, nulls) where written. A file
    rewritten in place usually changes it, but not always (a same-length edit that compresses
    to the same size, two rows' texts swapped): the per-row content hashes of
    ``--incremental`` are exact."""
    found = {}
    for j in range(group.num_columns):
        chunk = group.column(j)
        if chunk.path_in_schema in columns:
            stats = chunk.statistics
            found[chunk.path_in_schema] = [
                chunk.total_compressed_size, chunk.total_uncompressed_size,
                [stats.min, stats.max] if stats is not None and stats.has_min_max else None,
                stats.null_count if stats is not None and stats.has_null_count else None,
            ]
    return stable_hash([found.get(c) for c in columns])


def _footer(file_url: str) -> tuple[pq.FileMetaData, pa.Schema]:
    try:
        return storage.parquet_footer(file_url)
    except StorageError as exc:
        raise CorpusError(f"corrupt or unreadable Parquet file {file_url}: {_line(exc)}") from None
    except (OSError, pa.ArrowException) as exc:
        raise CorpusError(f"corrupt or unreadable Parquet file {file_url}: {_line(exc)}") from None


def _signed_ids_fit(meta: pq.FileMetaData, id_column: str) -> bool:
    """Whether the footer's statistics show every uint64 id of the file within int64."""
    for i in range(meta.num_row_groups):
        group = meta.row_group(i)
        [stats] = [group.column(j).statistics for j in range(group.num_columns)
                   if group.column(j).path_in_schema == id_column]
        if stats is None or not stats.has_min_max or stats.max > (1 << 63) - 1:
            return False
    return True


# files OUT's writers write that a glob could read back (the layout pipeline.names gives)
_OUT_FILES = (f"sets/mean/{PART_PREFIX}0.parquet", f"sets/mean/{HASHES}/0.parquet",
              f"{QUARANTINE}/0.parquet")


def _apart(url: str, urls: list[str], out: str, pattern: bool) -> None:
    """One line where the corpus lies inside OUT (in what OUT's writers write and prune), or
    OUT inside the corpus (a folder corpus holding it, corpus files under it, a glob that
    will match its parts): the run's own parts would be read as corpus the next time."""
    folder = not pattern and [storage.canonical(u) for u in urls] != [storage.canonical(url)]
    if storage.is_under(url, out):
        what = "folder" if folder else "glob" if pattern else "file"
        raise CorpusError(f"the corpus {what} {url} lies inside OUT {out}: keep the corpus "
                          "outside OUT")
    within = [u for u in urls if storage.is_under(u, out)]
    if pattern and not within:  # OUT's parts are not there yet: the first run would pass and
        within = _reached(url, out)  # every later one fail
    if within or (folder and storage.is_under(out, url)):
        raise CorpusError(
            f"OUT {out} lies inside the corpus {url}: its own parts would be read as corpus; "
            "put OUT outside the corpus folder"
        )


def _reached(pattern_url: str, out: str) -> list[str]:
    """The files OUT's writers will write that glob ``pattern_url`` would match."""
    _, pattern = storage.filesystem(pattern_url)
    _, base = storage.filesystem(out)
    regex = re.compile(glob_translate(pattern))
    return [storage.join(out, f) for f in _OUT_FILES if regex.match(f"{base.rstrip('/')}/{f}")]


def _common_type(types: set[pa.DataType], kinds: set[str], beyond_int64: bool) -> str:
    """The files' id type if they agree, else the widest of its kind: int64 (uint64 where a
    file's ids go beyond int64 and every file is unsigned), or large_string for text."""
    if len(types) == 1:
        return str(next(iter(types)))
    if kinds != {"int"}:
        return "large_string"
    unsigned = all(pa.types.is_unsigned_integer(t) for t in types)
    return "uint64" if beyond_int64 and unsigned else "int64"


def _line(exc: BaseException) -> str:
    """The first line of an error message (pyarrow's run over several)."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _id_type(dtype: pa.DataType, file_url: str, column: str) -> pa.DataType:
    if pa.types.is_integer(dtype) or _is_text(dtype):
        return dtype
    raise CorpusError(
        f"id column {column!r} of {file_url} is {dtype}; ids must be integers or strings "
        "stored as string or large_string: cast the column to one of them"
    )


def holds_text(dtype: pa.DataType) -> bool:
    """Whether a text column of ``dtype`` can hold text, however it is stored
    (``plain_text``): strings, or binary read as UTF-8 row by row. Any other type (numbers,
    lists) skips every row of its file as ``not_string``, but a null as ``null_text`` (every
    row of an all-null column)."""
    if pa.types.is_dictionary(dtype):
        dtype = dtype.value_type
    return (_is_text(dtype) or pa.types.is_string_view(dtype) or pa.types.is_binary(dtype)
            or pa.types.is_large_binary(dtype) or pa.types.is_binary_view(dtype))


def _check_some_text(not_text: dict[str, pa.DataType], files: int, column: str) -> None:
    """A corpus whose every file's text column cannot hold text would skip every row and
    leave an empty set, reported as a success (a wrong --text-column): refused. Files among
    others that do hold text have their rows skipped and quarantined, as bad rows are."""
    if not_text and len(not_text) == files:
        url, dtype = next(iter(not_text.items()))
        raise CorpusError(f"{url}: text column {column!r} is {dtype}, not text; pass "
                          "--text-column naming a string column")


def _root_path(url: str, pattern: bool) -> str:
    """The fixed folder of a corpus URL (``pattern``: a glob): file names are stored relative
    to it."""
    fs, path = storage.filesystem(url)
    if pattern:
        static = path[: min(path.index(ch) for ch in storage.GLOB_CHARS if ch in path)]
        return static.rsplit("/", 1)[0]
    with storage.explained(url, "open"):
        return path.rstrip("/") if fs.isdir(path) else os.path.dirname(path)


def _relative(file_url: str, root: str) -> str:
    _, path = storage.filesystem(file_url)
    root = root.rstrip("/")
    return path[len(root) + 1 :] if root and path.startswith(root + "/") else path.lstrip("/")


def arrow_id_type(id_type: str) -> pa.DataType:
    """The Arrow type named ``id_type`` (``int64``, ``string``, ...); a ValueError where it
    names no integer or text type (a ``_SET.json``'s is read from disk)."""
    kind = pa.type_for_alias(id_type)
    if not (pa.types.is_integer(kind) or _is_text(kind)):
        raise ValueError(f"{id_type!r} is not an id type (integers or text)")
    return kind


def id_type_holds(stored: str, corpus: str) -> bool:
    """Whether every id of type ``corpus`` converts to ``stored`` and back unchanged: text to
    text (``string`` and ``large_string`` alike), an integer to an integer type holding its
    range (``int32`` to ``int64``, ``uint32`` to ``int64``; not ``int64`` to ``uint64``)."""
    wide, narrow = arrow_id_type(stored), arrow_id_type(corpus)
    if pa.types.is_integer(wide) and pa.types.is_integer(narrow):
        return bool(np.can_cast(narrow.to_pandas_dtype(), wide.to_pandas_dtype(), "safe"))
    return _is_text(wide) and _is_text(narrow)


def _is_text(dtype: pa.DataType) -> bool:
    return pa.types.is_string(dtype) or pa.types.is_large_string(dtype)


# ---- content hashes and id keys -------------------------------------------------------------


def text_hash(text: str) -> int:
    """64-bit content hash of a text (what nightly runs compare to find changed rows)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def id_keys(ids: pa.Array) -> np.ndarray:
    """A uint64 key per non-null id: the value itself for integers, a hash for strings."""
    ids = ids.drop_null()
    if pa.types.is_unsigned_integer(ids.type):
        return ids.cast(pa.uint64()).to_numpy(zero_copy_only=False)
    if pa.types.is_integer(ids.type):
        return ids.cast(pa.int64()).to_numpy(zero_copy_only=False).view(np.uint64)
    return np.fromiter(
        (text_hash(v) for v in ids.to_pylist()), dtype=np.uint64, count=len(ids)
    )


# ---- duplicate ids --------------------------------------------------------------------------


class Duplicates(BaseModel):
    """Ids seen more than once: ``drop`` maps file name -> row numbers of the later copies."""

    examples: list[str] = []
    rows: int = 0  # rows that are later copies of an earlier id
    drop: dict[str, list[int]] = {}

    def describe(self) -> str:
        shown = ", ".join(self.examples[:5])
        return f"{self.rows} row(s) repeat an earlier id; first duplicates: {shown}"


def find_duplicates(info: CorpusInfo, id_column: str, text_column: str) -> Duplicates:
    """Two streaming passes over the id column (8 bytes per row stay in memory); the second,
    where some id repeats, also reads the texts of the row groups that hold a repeated id.
    Of an id's rows the first with a valid text is kept and the later ones are dropped; rows
    before it, whose text is skipped anyway, are left to be skipped for their text, so an id
    with a valid row is never lost."""
    keys = [id_keys(ids) for *_, ids in _id_groups(info, id_column)]
    if not keys:
        return Duplicates()
    every = np.sort(np.concatenate(keys))
    repeated = np.unique(every[1:][every[1:] == every[:-1]])
    if not len(repeated):
        return Duplicates()
    kept: set[object] = set()
    drop: dict[str, list[int]] = {}
    examples: list[str] = []
    for layout, pf, group, start, ids in _id_groups(info, id_column):
        values = ids.to_pylist()
        hits = [i for i, v in enumerate(values) if v is not None and _maybe_repeated(v, repeated)]
        if not hits:
            continue
        texts = _texts(read_group(pf, layout.url, group, [text_column]).column(0)
                       .combine_chunks())
        for i in hits:
            if values[i] in kept:
                drop.setdefault(layout.name, []).append(start + i)
                if len(examples) < 10 and repr(values[i]) not in examples:
                    examples.append(repr(values[i]))
            elif _reason(False, False, texts[i]) is None:
                kept.add(values[i])
    return Duplicates(examples=examples, rows=sum(map(len, drop.values())), drop=drop)


def _maybe_repeated(value: object, repeated: np.ndarray) -> bool:
    key = value & 0xFFFF_FFFF_FFFF_FFFF if isinstance(value, int) else text_hash(value)
    i = np.searchsorted(repeated, np.uint64(key))
    return bool(i < len(repeated) and repeated[i] == key)


def _id_groups(info: CorpusInfo, id_column: str
               ) -> Iterator[tuple[FileLayout, pq.ParquetFile, int, int, pa.Array]]:
    """(file, its opened Parquet file, row group, its first row in the file, its ids) for
    every row group, one at a time, as shards read them."""
    for layout in info.files:
        pf = _open(layout.url)
        start = 0
        for group in range(pf.num_row_groups):
            ids = read_group(pf, layout.url, group, [id_column]).column(0).combine_chunks()
            yield layout, pf, group, start, ids
            start += len(ids)


def read_group(pf: pq.ParquetFile, url: str, group: int, columns: list[str]) -> pa.Table:
    """``columns`` of one row group; a damaged page is one line naming the file and group."""
    try:
        return pf.read_row_group(group, columns=columns)
    except (OSError, pa.ArrowException) as exc:
        raise CorpusError(
            f"corrupt Parquet file {url}: row group {group} unreadable: {_line(exc)}"
        ) from None


def _open(url: str) -> pq.ParquetFile:
    try:
        return storage.parquet_file(url)
    except StorageError as exc:
        raise CorpusError(f"corrupt or unreadable Parquet file {url}: {exc}") from None


# ---- reading a shard ------------------------------------------------------------------------


@dataclass
class Chunk:
    """One row group of a shard, validated: the rows to embed and the rows skipped."""

    ids: pa.Array  # valid ids, as the corpus id type
    texts: list[str]
    hashes: np.ndarray  # uint64 content hash per valid row
    skipped_ids: pa.Array  # ids of skipped rows (may hold nulls)
    skipped_rows: list[int] = field(default_factory=list)  # file row numbers
    skipped_reasons: list[str] = field(default_factory=list)

    @property
    def skipped(self) -> dict[str, int]:
        return dict(Counter(self.skipped_reasons))


def read_shard(
    shard: Shard,
    id_column: str,
    text_column: str,
    id_type: str,
    drop_rows: frozenset[int] = frozenset(),
) -> Iterator[Chunk]:
    """Stream a shard one row group at a time (ids and texts only)."""
    pf = _open(shard.url)
    start = shard.offset
    target = arrow_id_type(id_type)
    for group in shard.groups:
        table = read_group(pf, shard.url, group, [id_column, text_column])
        ids = table.column(id_column).combine_chunks().cast(target)
        yield validate(ids, table.column(text_column).combine_chunks(), start, drop_rows)
        start += table.num_rows


def validate(ids: pa.Array, texts: pa.Array, start: int, drop_rows: frozenset[int]) -> Chunk:
    """Split rows into valid ones and skipped ones with a reason each."""
    values = _texts(texts)
    id_null = ids.is_null().to_numpy(zero_copy_only=False)
    keep, texts_out, hashes = [], [], []
    bad_idx, bad_reasons = [], []
    for i, text in enumerate(values):
        reason = _reason(bool(id_null[i]), start + i in drop_rows, text)
        if reason:
            bad_idx.append(i)
            bad_reasons.append(reason)
        else:
            keep.append(i)
            texts_out.append(text)
            hashes.append(text_hash(text))
    return Chunk(
        ids=ids.take(pa.array(keep, pa.int64())),
        texts=texts_out,
        hashes=np.array(hashes, dtype=np.uint64),
        skipped_ids=ids.take(pa.array(bad_idx, pa.int64())),
        skipped_rows=[start + i for i in bad_idx],
        skipped_reasons=bad_reasons,
    )


_NOT_STRING = object()


def plain_text(texts: pa.Array) -> pa.Array:
    """A text column as plain (large) strings or binary where it is stored another way:
    dictionary-encoded (pandas ``category``, polars ``Categorical``) or as views."""
    if pa.types.is_dictionary(texts.type):
        texts = texts.dictionary_decode()
    if pa.types.is_string_view(texts.type):
        return texts.cast(pa.large_string())
    if pa.types.is_binary_view(texts.type):
        return texts.cast(pa.large_binary())
    return texts


def _texts(texts: pa.Array) -> list:
    """Python values of the text column; anything that is not text becomes ``_NOT_STRING``."""
    texts = plain_text(texts)
    if pa.types.is_string(texts.type) or pa.types.is_large_string(texts.type):
        return texts.to_pylist()
    if pa.types.is_binary(texts.type) or pa.types.is_large_binary(texts.type):
        return [text_value(v) for v in texts.to_pylist()]
    return [None if v is None else _NOT_STRING for v in texts.to_pylist()]


def text_value(value: object) -> object:
    """A text column's value as a run reads it: bytes decoded as UTF-8 (``_NOT_STRING`` where
    they are not), anything else as it is."""
    if not isinstance(value, bytes):
        return value
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return _NOT_STRING


def _reason(id_null: bool, duplicate: bool, text: object) -> SkipReason | None:
    if id_null:
        return "null_id"
    if duplicate:
        return "duplicate_id"
    return text_reason(text)


def text_reason(text: object) -> SkipReason | None:
    """Why a run skips a row's text, or None where it embeds it."""
    if text is None:
        return "null_text"
    if not isinstance(text, str):
        return "not_string"
    if blank(text):
        return "empty_text"
    return None


def blank(text: str) -> bool:
    """No visible character: only whitespace, control and format characters (Unicode Cc, Cf:
    NUL, a zero-width space, a byte-order mark, a soft hyphen), private-use ones, combining
    marks without a base, replacement characters, which BERT's tokenizers drop: such a text
    got the vector of an empty one, the same for every such row. Stops at the first visible
    character."""
    if text[:1].isalnum():  # most texts: at once
        return False
    return all(c.isspace() or c == _REPLACEMENT or unicodedata.category(c) in _DROPPED
               for c in text)
