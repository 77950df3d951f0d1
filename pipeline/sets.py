"""A pooler set on disk: ``OUT/sets/<set>/``, owned by one object, ``SetFolder``.

Layout (readers take the parts whose shard has a marker, ``_SET.json`` and ``_changes``)::

    part-<shard>.parquet        id, embedding (fixed_size_list<float32>[dim])
    _SET.json                   SetMeta
    _changes/<generation>.json  parts written and ids deleted by the run of that generation
    _hashes/<shard>.parquet     id, hash (uint64 content hash of the text), born (the
                                generation that made the row's vector: a reused vector keeps
                                its own) per row of the part, and the generation that wrote it
                                (schema metadata)
    _done/<shard>.json          ShardMarker, written after the part and its hashes
    _removed/<gen>-<shard>.json ids a run of that generation removed, written BEFORE the part
                                that drops them, so a crash cannot lose a deletion
    _removed/<gen>-<shard>.parquet  id, hash, embedding, born of the stored rows that left the shard
                                in that generation: another shard of the run may receive them
                                (rows reordered or moved between files); gone at the run's end
    _moved/<generation>.json    the done shards whose rows may have moved in that run (named
                                once, not in every shard's request); gone at the run's end

A shard counts as done only through its marker, and the marker is written last, so a crash
at any point leaves either a complete shard or one that the next run redoes; readers see the
parts of done shards only, and a run retires a part left without its marker once its shard
left the plan.

Nothing read from the folder is trusted: the set name (argument and ``_SET.json``), shard ids
(markers, ``_removed`` and ``_moved`` files) and part names (``_changes``) are validated by
``pipeline.names`` before they become a path, so no file in OUT can address a path outside it.
Every write goes through ``pipeline.storage`` and is atomic.
"""

from __future__ import annotations

import uuid
import warnings
from collections.abc import Callable, Iterable
from typing import Annotated, NamedTuple

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, field_validator

from pipeline import storage
from pipeline.config import stable_hash
from pipeline.corpus import arrow_id_type
from pipeline.errors import ConfigError, EmbedpipeWarning, FingerprintError, StorageError
from pipeline.models.hashing import int8_hint
from pipeline.models.similarity import Similarity
from pipeline.names import HASHES, PART_PREFIX, QUARANTINE, file_name, set_name
from pipeline.vectors import vector_column, vectors_of

META_FILE = "_SET.json"


class SetMeta(BaseModel):
    """``_SET.json``: what made the set's vectors and how far the set has got."""

    model_config = ConfigDict(extra="ignore")

    name: str
    fingerprint: str
    model: str
    model_hash: str
    encoder: dict
    pooler: dict
    # what else made the pooler's vectors (a learned head's weights digest: Pooler.identity);
    # None: a set recorded before embedpipe kept it
    pooler_identity: dict | None = None
    dim: int
    dtype: str  # the dtype its vectors were computed in; "bf16+fp32": runs used both
    normalize: bool
    # the model's similarity_fn_name; None: a set recorded before embedpipe kept it
    similarity: Similarity | None = None
    max_length: int
    window: dict | None = None
    # the job options and files that made the vectors (pipeline.run.job_key): a later run with
    # the same key is known to make the same fingerprint without loading the model
    job_key: str | None = None
    id_type: str = "string"  # an Arrow type: an integer or text (checked as it is read)
    corpus: str | None = None  # where the texts are: search joins snippets back by id
    id_column: str = "id"
    text_column: str = "text"
    shards_done: int = 0
    rows_written: int = 0
    # the rows per shard its last finished run planned with: a later run that gives none
    # keeps that layout (a set's parts are not all rewritten); None: not recorded
    rows_per_shard: int | None = Field(default=None, gt=0)
    rows_skipped: dict[str, int] = {}
    generation: int = 0
    # made with the set's folder: a set removed and made again under the same name gets
    # another, so an index (``_INDEX.json``'s ``set_token``) of the old one is never taken as
    # its own; None: a set made before embedpipe kept one
    token: str | None = None

    def differences(self, other: SetMeta) -> str:
        """``; differs in: ...``: what of the recorded inputs of a fingerprint (model files,
        max length, window, pooler, a learned head's files) differs from ``other``'s; '' where
        none shows it."""
        fields = {"model files": lambda m: m.model_hash, "max length": lambda m: m.max_length,
                  "window": lambda m: m.window,
                  "pooler": lambda m: {k: v for k, v in m.pooler.items() if k != "name"}}
        if None not in (self.pooler_identity, other.pooler_identity):  # else: not recorded
            fields["pooler files"] = lambda m: m.pooler_identity
        diffs = [f"{label} {get(self)} -> {get(other)}" for label, get in fields.items()
                 if get(self) != get(other)]
        return f"; differs in: {'; '.join(diffs)}" if diffs else ""

    @property
    def metric(self) -> str:
        """The FAISS metric that ranks as the model compares vectors: cosine (over unit
        vectors, see ``unit_search``) and dot by inner product, euclidean by L2. A set recorded
        without its similarity: inner product when normalised, else L2 (as it was indexed)."""
        if self.similarity is None:
            return "ip" if self.normalize else "l2"
        if self.similarity == "manhattan":
            raise ConfigError(f"set {self.name!r}: its model compares vectors by manhattan "
                              "distance, which search here does not offer (cosine, dot, euclidean)")
        return "l2" if self.similarity == "euclidean" else "ip"

    @field_validator("id_type")
    @classmethod
    def _an_id_type(cls, id_type: str) -> str:
        arrow_id_type(id_type)
        return id_type

    def check_columns(self, id_column: str, text_column: str, out: str) -> None:
        """Refuse a job that reads other corpus columns than the set's vectors were made from:
        its shards' markers would still match, and the set would keep (or mix) the old
        column's vectors."""
        if (self.id_column, self.text_column) != (id_column, text_column):
            raise FingerprintError(
                f"set {self.name!r} in {out} was made from the corpus columns "
                f"{self.text_column!r} (ids {self.id_column!r}), this job reads "
                f"{text_column!r} (ids {id_column!r}); pass --text-column "
                f"{self.text_column} --id-column {self.id_column}, or use another set name "
                "or OUT"
            )

    @property
    def unit_search(self) -> bool:
        """Search scales vectors and queries to unit length: cosine over vectors the model
        does not normalise itself."""
        return self.similarity == "cosine" and not self.normalize


# Rows a marker may count: a file's rows fit in 2**53, so every count sums exactly as floats
# (Prefect's artifacts, JSON readers) read it; a marker counting more, or fewer than none, is
# not one and its shard is redone.
Count = Annotated[int, Field(ge=0, le=2**53)]


class ShardMarker(BaseModel):
    """``_done/<shard>.json``: the shard's part (if it has rows) and hashes are complete."""

    model_config = ConfigDict(extra="ignore")

    shard: str
    file: str
    first_group: NonNegativeInt
    end_group: NonNegativeInt
    signature: str
    # the shard's content digest (``pipeline.shards.Shard.content``); None: written before
    # markers kept it (the signature alone is then compared)
    content: str | None = None
    rows: Count
    skipped: dict[str, Count] = {}
    generation: NonNegativeInt  # the generation that last wrote the part
    # the writer lease (its acquisition's token) of the run that wrote it, if it held one: a
    # retry of the shard in that run finds its own marker, not a taker's
    writer: str | None = None


def _marker(raw: bytes) -> ShardMarker | None:
    """A done marker's file as a marker; None where it is not one (damaged JSON, missing
    fields): its shard is redone."""
    try:
        return ShardMarker.model_validate_json(raw)
    except ValueError:
        return None


class ShardHashes(NamedTuple):
    """A shard's ``_hashes`` file: its part's ids, their texts' content hashes, the generation
    that wrote the part (-1: no file), and the generation each row's vector was made in."""

    ids: pa.Array
    hashes: np.ndarray
    generation: int
    born: np.ndarray


def _shard_hashes(table: pa.Table, generation: int, id_type: pa.DataType, url: str
                  ) -> ShardHashes:
    """A hashes or leftovers table's keys (its other columns checked by the caller); ids not
    of the set's ``id_type`` are one line (they are joined to the ids the run reads)."""
    _check_id_type(table.schema, id_type, url)
    hashes = table.column("hash").combine_chunks().to_numpy(zero_copy_only=False)
    return ShardHashes(table.column("id").combine_chunks(), hashes, generation,
                       _born(table, generation))


def _born(table: pa.Table, generation: int) -> np.ndarray:
    """The ``born`` column of a hashes or leftovers table; where there is none (a file from
    before it was kept) or it is not a generation up to ``generation``: ``generation`` for
    every row, which makes the index re-add them (never keep a vector it may not hold)."""
    rows = table.num_rows
    if "born" in table.column_names and table.schema.field("born").type == pa.int64():
        born = table.column("born").combine_chunks().to_numpy(zero_copy_only=False)
        if len(born) == rows and (born >= 0).all() and (born <= generation).all():
            return born
    return np.full(rows, generation, np.int64)


def _leftovers_schema(schema: pa.Schema) -> bool:
    """Whether ``schema`` is that of ``SetFolder.write_leftovers``'s files (``born`` may be
    missing: a file of a run from before it was kept, resumed)."""
    if schema.names[:3] != ["id", "hash", "embedding"] or schema.field("hash").type != pa.uint64():
        return False
    if schema.names[3:] not in ([], ["born"]):
        return False
    vectors = schema.field("embedding").type
    return pa.types.is_fixed_size_list(vectors) and vectors.value_type == pa.float32()


class SetChanges(BaseModel):
    """``_changes/<generation>.json``: part names (validated) and ids deleted by that run."""

    model_config = ConfigDict(extra="ignore")

    generation: int
    parts: list[str]
    deleted_ids: list


class RemovalRecord(BaseModel):
    """``_removed/<generation>-<shard>.json`` (its ids are checked by ``stored_ids``)."""

    model_config = ConfigDict(extra="ignore")

    ids: object = None


class MovedShards(BaseModel):
    """``_moved/<generation>.json``: the done shards whose rows may have moved in that run."""

    model_config = ConfigDict(extra="ignore")

    generation: int
    shards: list[str]


def stored_ids(values: object, id_type: pa.DataType, where: str) -> pa.Array:
    """Ids read from a JSON file (a removal record, a changes file) as an array of the set's
    ``id_type``: a list of integers in its range, or of strings; anything else (a float
    truncated, a string in an integer set, a list, a null) is one line naming ``where``."""
    if not isinstance(values, list):
        raise StorageError(f"{where}: its ids are not a list")
    kind = int if pa.types.is_integer(id_type) else str
    odd = [type(v).__name__ for v in values if type(v) is not kind][:1]
    if odd:
        raise StorageError(f"{where}: its ids are not the set's {id_type} (one is {odd[0]})")
    try:
        return pa.array(values, id_type)
    except (pa.ArrowException, OverflowError, UnicodeError):
        raise StorageError(f"{where}: its ids are not the set's {id_type} (one is out of its "
                           "range, or not text)") from None


def check_part_schema(url: str, schema: pa.Schema, dim: int, id_type: pa.DataType) -> None:
    """A part of another shape, or whose ids are not of the set's ``id_type`` (every part of
    a set stores that one), is refused by name."""
    if "id" not in schema.names or "embedding" not in schema.names:
        raise StorageError(f"{url} is not a set part: it needs columns id and embedding")
    _check_id_type(schema, id_type, url)
    kind = schema.field("embedding").type
    if not pa.types.is_fixed_size_list(kind) or kind.value_type != pa.float32():
        raise FingerprintError(f"{url}: embedding is {kind}, not fixed_size_list<float32>")
    if kind.list_size != dim:
        raise FingerprintError(
            f"{url} holds {kind.list_size}-dim vectors but the set's _SET.json says dim {dim}; "
            "the set mixes vectors of two shapes"
        )


def _check_id_type(schema: pa.Schema, id_type: pa.DataType, url: str) -> None:
    """A file of the set stores its ids as the set's ``id_type`` (they are joined to others)."""
    if schema.field("id").type != id_type:
        raise StorageError(f"{url}: its ids are {schema.field('id').type}, not the set's "
                           f"{id_type}")


def check_ids(ids: pa.Array | pa.ChunkedArray, url: str) -> pa.Array | pa.ChunkedArray:
    """A part's ids, refused by name where one is null (no row of a set lacks its id)."""
    if ids.null_count:
        raise StorageError(f"{url}: {ids.null_count:,} of its ids are null; restore the part, "
                           "or remove its done marker so that embed redoes the shard")
    return ids


def repeated_ids(ids: Iterable[pa.Array | pa.ChunkedArray], name: str, out: str,
                 then: str = "") -> None:
    """Refuse a set whose parts hold one id more than once, naming one such id."""
    chunks = [c for column in ids for c in getattr(column, "chunks", [column])]
    if not chunks:
        return
    counts = pc.value_counts(pa.chunked_array(chunks))
    repeated = counts.filter(pc.greater(counts.field("counts"), 1)).field("values")
    if len(repeated):
        repeated = repeated.to_pylist()[:3]
        raise StorageError(f"set {name!r} in {out} holds ids more than once (e.g. {repeated}); "
                           f"a run is still writing or did not finish: rerun it{then}")


def part_name(shard: str) -> str:
    return f"{PART_PREFIX}{file_name(shard, 'a shard id')}.parquet"


def shard_of(part: str) -> str | None:
    """The shard id of a part's file name (``part_name``'s inverse); None where ``part`` is
    not one."""
    if not (part.startswith(PART_PREFIX) and part.endswith(".parquet")):
        return None
    return file_name(part[len(PART_PREFIX):-len(".parquet")], "a shard id")


def quarantine_url(out: str, shard: str) -> str:
    return storage.join(out, QUARANTINE, f"{file_name(shard, 'a shard id')}.parquet")


def quarantined_shards(out: str) -> set[str]:
    """Ids of the shards that have a quarantine file under ``OUT/_quarantine``."""
    urls = storage.list_files(storage.join(out, QUARANTINE), ".parquet")
    return {url.rsplit("/", 1)[-1].removesuffix(".parquet") for url in urls}


def list_sets(out: str) -> list[str]:
    """Names of the sets under ``OUT/sets`` that have metadata (folders only, names checked).

    A folder whose name is not a valid set name is refused, as is one whose ``_SET.json``
    names another set: either means the folder was not written by embedpipe.
    """
    found = []
    for url in storage.list_dirs(storage.join(out, "sets")):
        folder = SetFolder(out, url.rstrip("/").rsplit("/", 1)[-1])
        if folder.read_meta() is not None:
            found.append(folder.name)
    return sorted(found)


def scan_set(out: str, name: str) -> pl.LazyFrame:
    """The set's rows as a polars LazyFrame with columns ``id`` and ``embedding``."""
    return SetFolder(out, name).scan()


class SetFolder:
    """One set's files: where each lives, and how it is read, validated and written."""

    def __init__(self, out: str, name: str) -> None:
        self.out = out
        self.name = set_name(name, storage.join(out, "sets"))
        self.url = storage.join(out, "sets", self.name)

    def __repr__(self) -> str:
        return f"SetFolder({self.url!r})"

    def _at(self, *parts: str) -> str:
        return storage.join(self.url, *parts)

    # ---- metadata --------------------------------------------------------------------------

    @property
    def meta_url(self) -> str:
        return self._at(META_FILE)

    def read_meta(self) -> SetMeta | None:
        """``_SET.json``, checked to describe this folder's set; None when there is none."""
        url = self.meta_url
        meta = storage.read_model(url, SetMeta, "a set description")
        if meta is None:
            return None
        if meta.name != self.name:
            raise StorageError(
                f"{url} names set {meta.name[:80]!r}, not {self.name!r}: it was not written "
                "for this folder; remove or restore it"
            )
        return meta

    def meta(self) -> SetMeta:
        """``_SET.json``; a missing set is one line listing the sets that exist."""
        meta = self.read_meta()
        if meta is None:
            known = list_sets(self.out)
            raise StorageError(
                f"no set {self.name!r} under {storage.join(self.out, 'sets')} (sets there: "
                f"{', '.join(known) if known else 'none'})"
            )
        return meta

    def write_meta(self, meta: SetMeta) -> None:
        if meta.name != self.name:
            raise StorageError(f"metadata of set {meta.name!r} cannot go into {self.url}")
        storage.write_json(self.meta_url, meta.model_dump())

    def claim(self, meta: SetMeta) -> SetMeta:
        """The set's stored metadata, after checking it was made the same way; new sets are
        created.

        Writing ``_SET.json`` before any part means a crashed first run cannot be resumed with
        another model or pooler and leave a set of mixed vectors.
        """
        stored = self.read_meta()
        if stored is None:
            if storage.list_files(self.url, ".parquet") or storage.list_files(self._at("_done")):
                raise FingerprintError(
                    f"{self.url} holds parts but no {META_FILE}; remove it or use another OUT"
                )
            meta = meta.model_copy(update={"token": uuid.uuid4().hex})
            self.write_meta(meta)
            return meta
        if stored.fingerprint != meta.fingerprint:
            raise FingerprintError(
                f"set {self.name!r} in {self.out} was made with fingerprint {stored.fingerprint} "
                f"(model {stored.model}, pooler {stored.pooler.get('strategy')}), this job makes "
                f"{meta.fingerprint} (model {meta.model}){stored.differences(meta)}; use another "
                "set name or another OUT" + int8_hint(stored.model_hash, meta.model_hash)
            )
        if stored.id_type != meta.id_type:
            raise FingerprintError(
                f"set {self.name!r} in {self.out} stores {stored.id_type} ids, the corpus has "
                f"{meta.id_type}"
            )
        update = {}
        if meta.job_key and stored.job_key != meta.job_key:  # same vectors, another way there
            update["job_key"] = meta.job_key
        made_in = stored.dtype.split("+")
        if meta.dtype not in made_in:  # bf16 and fp32 vectors share a fingerprint: say both
            update["dtype"] = "+".join(sorted([*made_in, meta.dtype]))
        if update:
            stored = stored.model_copy(update=update)
            self.write_meta(stored)
        return stored

    # ---- parts and hashes ------------------------------------------------------------------

    def url_of(self, name: str) -> str:
        """URL of the file ``name`` directly in the set's folder (a plain name, checked)."""
        return self._at(file_name(name, self.url))

    def part_url(self, shard: str) -> str:
        return self._at(part_name(shard))

    def part_urls(self, markers: dict[str, ShardMarker] | None = None) -> list[str]:
        """URLs of the set's done parts, sorted: those whose shard has a done marker. A part
        written by a run that died before its marker is not the set's (a later run redoes or
        retires it: ``unmarked_shards``), so no reader sees its rows twice. A done shard with
        rows but no part is one line: a reader would silently lack its rows. ``markers``: the
        set's (``read_markers``), where the caller read them; else each is read where needed."""
        marked, written = self.marked_shards(), self.written_shards()
        for shard in sorted(marked - written):  # a shard done without rows has no part
            marker = self.read_marker(shard) if markers is None else markers.get(shard)
            if marker is not None and marker.rows:
                raise StorageError(
                    f"{self.part_url(shard)}: missing or not a file, though shard {shard} is "
                    f"done with {marker.rows:,} rows; run embed again, which redoes it"
                )
        return [self.part_url(shard) for shard in sorted(written) if shard in marked]

    def written_shards(self) -> set[str]:
        """Shard ids of the ``part-*.parquet`` files in the folder (plain names only)."""
        names = (url.rsplit("/", 1)[-1] for url in storage.list_files(self.url, ".parquet"))
        return {shard for shard in map(shard_of, names) if shard is not None}

    def unmarked_shards(self, markers: Iterable[str] | None = None) -> set[str]:
        """Shards with a part or hashes but no done marker: left by a run that died between
        them. ``markers``: the shards ``read_markers`` found, so a marker file that is not one
        counts as none (else its part stays the set's for good)."""
        hashed = (url.rsplit("/", 1)[-1][:-len(".parquet")]
                  for url in storage.list_files(self._at(HASHES), ".parquet"))
        written = self.written_shards() | {file_name(h, self.url) for h in hashed}
        return written - set(self.marked_shards() if markers is None else markers)

    def checked_parts(self, meta: SetMeta) -> list[tuple[str, pq.FileMetaData]]:
        """The done parts (``part_urls``) with their footers, each checked against the set
        (``check_part_schema``) and against its shard's done marker: a part of other rows
        than its shard was done with is not the set's."""
        markers = self.read_markers()  # each read once, for both checks
        found = []
        for url in self.part_urls(markers):
            footer, schema = storage.parquet_footer(url)
            self._check_part(url, footer, schema, markers, meta)
            found.append((url, footer))
        return found

    def _check_part(self, url: str, footer: pq.FileMetaData, schema: pa.Schema,
                    markers: dict[str, ShardMarker], meta: SetMeta) -> None:
        check_part_schema(url, schema, meta.dim, arrow_id_type(meta.id_type))
        marker = markers.get(shard_of(url.rsplit("/", 1)[-1]) or "")
        if marker is not None and footer.num_rows != marker.rows:
            raise StorageError(
                f"{url} holds {footer.num_rows:,} rows, its shard was done with "
                f"{marker.rows:,}: it is not the part that shard wrote; restore it, or remove "
                f"{self._marker_url(marker.shard)} so that embed redoes the shard")

    def scan(self) -> pl.LazyFrame:
        """The set's rows as one polars LazyFrame with columns ``id`` and ``embedding``, read
        in one pass over its parts, each checked as ``checked_parts`` does, with no null id,
        no null, NaN or infinite vector and no id twice (one line naming what is wrong, never
        such rows). A snapshot: a run that writes to the set later does not change it. A set
        that a run is writing to is refused, its parts do not make the set yet (a shard being
        rewritten is absent, a moved row in two parts); one whose last run stopped before its
        end (``unfinished``) is read with an ``EmbedpipeWarning`` saying so."""
        meta = self.meta()
        markers = self.read_markers()
        if self.unfinished(meta, markers):
            self._refuse_while_written()
            warnings.warn(f"set {self.name!r} in {self.out}: the last run that wrote to it did "
                          "not finish, so it holds the shards that run finished; run embed "
                          "again to finish it", EmbedpipeWarning, stacklevel=3)
        try:
            tables = [self._checked_table(url, markers, meta) for url in self.part_urls(markers)]
            repeated_ids((t.column("id") for t in tables), self.name, self.out)
        except StorageError:
            if self.read_markers() != markers:  # not damage: a run began writing meanwhile
                self._refuse_while_written(started=True)
            raise
        if self.read_markers() != markers:
            self._refuse_while_written(started=True)
        empty = pa.table({"id": pa.array([], arrow_id_type(meta.id_type)),
                          "embedding": pa.array([], pa.list_(pa.float32(), meta.dim))})
        return pl.from_arrow(pa.concat_tables(tables) if tables else empty).lazy()

    def _refuse_while_written(self, started: bool = False) -> None:
        """Refuse to read the set while a writer holds OUT (``started``: its markers changed
        while they were read, so one does, or did)."""
        from pipeline.lease import writer_of

        writer = writer_of(self.out) or ("a run that began while it was read" if started
                                         else None)
        if writer is not None:
            raise StorageError(f"set {self.name!r} in {self.out} is being written by {writer}: "
                               "its parts do not make the set until that run ends; read it "
                               "then")

    def _checked_table(self, url: str, markers: dict[str, ShardMarker], meta: SetMeta
                       ) -> pa.Table:
        """A part's ids and vectors, checked (``_check_part``, ``check_ids``, ``vectors_of``)
        a row group at a time, footer and rows read through one open of the file."""
        with storage.explained(url, "read"), storage.parquet_file(url) as pf:
            self._check_part(url, pf.metadata, pf.schema_arrow, markers, meta)
            groups = []
            for group in range(pf.metadata.num_row_groups):
                table = pf.read_row_group(group, columns=["id", "embedding"])
                check_ids(table.column("id"), url)
                vectors_of(table.column("embedding"), url, meta.dim)
                groups.append(table)
            return pa.concat_tables(groups) if groups else pf.schema_arrow.empty_table().select(
                ["id", "embedding"])

    def write_part(self, shard: str, ids: pa.Array, vectors: np.ndarray) -> str:
        """Write one part atomically; returns its file name."""
        storage.write_parquet(self.part_url(shard),
                              pa.table({"id": ids, "embedding": vector_column(vectors)}))
        return part_name(shard)

    def read_part(self, shard: str) -> tuple[pa.Array, np.ndarray]:
        url = self.part_url(shard)
        table = storage.read_parquet(url)
        return table.column("id").combine_chunks(), vectors_of(table.column("embedding"), url)

    def has_part(self, shard: str) -> bool:
        return storage.exists(self.part_url(shard))

    def _hashes_url(self, shard: str) -> str:
        return self._at(HASHES, f"{file_name(shard, 'a shard id')}.parquet")

    def write_hashes(self, shard: str, ids: pa.Array, hashes: np.ndarray, generation: int,
                     born: np.ndarray | None = None) -> None:
        """The part's keys, written by ``generation``; ``born``: each vector's generation
        (default: all made by ``generation``)."""
        born = np.full(len(ids), generation, np.int64) if born is None else born
        table = pa.table({"id": ids, "hash": pa.array(hashes, pa.uint64()),
                          "born": pa.array(born, pa.int64())})
        table = table.replace_schema_metadata({"generation": str(generation)})
        storage.write_parquet(self._hashes_url(shard), table)

    def read_hashes(self, shard: str, id_type: pa.DataType) -> ShardHashes:
        """A shard's part's keys (empty, generation -1, if it has no hashes file); its ids must
        be of the set's ``id_type``."""
        url = self._hashes_url(shard)
        if not storage.exists(url):
            return ShardHashes(pa.array([]), np.zeros(0, np.uint64), -1, np.zeros(0, np.int64))
        table = storage.read_parquet(url)
        if table.column_names[:2] != ["id", "hash"] or table.schema.field(1).type != pa.uint64():
            raise StorageError(f"{url}: not a hashes file (id, hash uint64, born int64)")
        try:
            generation = int((table.schema.metadata or {}).get(b"generation", b"-1"))
        except ValueError:
            raise StorageError(f"{url}: its generation is not a number") from None
        return _shard_hashes(table, generation, id_type, url)

    def remove_part(self, shard: str) -> None:
        storage.remove(self.part_url(shard))
        storage.remove(self._hashes_url(shard))

    # ---- markers ---------------------------------------------------------------------------

    def _marker_url(self, shard: str) -> str:
        return self._at("_done", f"{file_name(shard, 'a shard id')}.json")

    def write_marker(self, marker: ShardMarker) -> None:
        storage.write_json(self._marker_url(marker.shard), marker.model_dump(mode="json"))

    def read_marker(self, shard: str) -> ShardMarker | None:
        """A shard's done marker; None if it has none or it is not one (damaged JSON)."""
        (raw,) = storage.read_files([self._marker_url(shard)])  # on S3: one GET
        marker = None if raw is None else _marker(raw)  # None: none, or removed as it was read
        return marker if marker is not None and marker.shard == shard else None

    def read_markers(self) -> dict[str, ShardMarker]:
        """Done markers by shard id. A marker that is not one (damaged JSON, missing fields)
        is skipped: its shard is redone. A marker that cannot be read (the store failed) is an
        error, not a missing shard, or a run's end would drop a finished shard from the set's
        record. A marker naming a shard id that is not a plain name is refused with one
        line."""
        markers = {}
        urls = storage.list_files(self._at("_done"), ".json")
        for url, raw in zip(urls, storage.read_files(urls), strict=True):
            marker = None if raw is None else _marker(raw)  # None: removed since listed
            if marker is None:
                continue
            file_name(marker.shard, url)
            markers[marker.shard] = marker
        return markers

    def unfinished(self, meta: SetMeta, markers: dict[str, ShardMarker] | None = None) -> bool:
        """Whether a run wrote to the set or took shards from it after the last run that
        finished (killed, or still running): its done markers (``markers``, where the caller
        read them) no longer add up to the shards and rows ``meta`` (``_SET.json``) recorded
        at that run's end."""
        markers = self.read_markers() if markers is None else markers
        return (len(markers) != meta.shards_done
                or sum(m.rows for m in markers.values()) != meta.rows_written)

    def marked_shards(self) -> set[str]:
        """Shard ids that have a done marker file, by name (one listing, no reads)."""
        names = (url.rsplit("/", 1)[-1] for url in storage.list_files(self._at("_done"), ".json"))
        return {file_name(n[:-len(".json")], self.url) for n in names}

    def remove_marker(self, shard: str,
                      only_if: Callable[[ShardMarker | None], bool] | None = None) -> bool:
        """Remove the shard's done marker; with ``only_if``, only while the marker there now
        passes it: returns False, removing nothing, where it does not (another writer wrote
        its own since)."""
        if only_if is not None and not only_if(self.read_marker(shard)):
            return False
        storage.remove(self._marker_url(shard))
        return True

    # ---- removals and changes --------------------------------------------------------------

    def _removed_url(self, generation: int, shard: str, suffix: str = ".json") -> str:
        return self._at("_removed", f"{generation:06d}-{file_name(shard, 'a shard id')}{suffix}")

    def record_removed(self, generation: int, shard: str, ids: pa.Array) -> None:
        """Add ``ids`` to what ``generation`` removed from ``shard`` (merged with earlier
        attempts)."""
        if not len(ids):
            return
        url = self._removed_url(generation, shard)
        earlier = self._removed_record(url, ids.type) if storage.exists(url) else []
        payload = {"generation": generation,
                   "ids": list(dict.fromkeys(earlier + ids.to_pylist()))}
        storage.write_json(url, payload)

    def write_leftovers(self, generation: int, shard: str, rows: ShardHashes,
                        vectors: np.ndarray) -> None:
        """Keep the stored rows that left ``shard`` in ``generation`` (their keys and vectors)
        until the run's end: a shard of the same run that received them reuses them
        (``pipeline.reuse``) though their part was rewritten. Merged with earlier attempts."""
        if not len(rows.ids):
            return
        url = self._removed_url(generation, shard, ".parquet")
        if storage.exists(url):
            earlier, stored = self.read_leftovers(url, generation, rows.ids.type)
            if stored.shape[1] != vectors.shape[1]:
                raise StorageError(f"{url}: vectors of {stored.shape[1]} dimensions, not the "
                                   f"set's {vectors.shape[1]}")
            rows = ShardHashes(pa.concat_arrays([earlier.ids, rows.ids]),
                               np.concatenate([earlier.hashes, rows.hashes]), generation,
                               np.concatenate([earlier.born, rows.born]))
            vectors = np.concatenate([stored, vectors])
        storage.write_parquet(url, pa.table({
            "id": rows.ids, "hash": pa.array(rows.hashes, pa.uint64()),
            "embedding": vector_column(vectors), "born": pa.array(rows.born, pa.int64())}))

    def leftovers_urls(self, generation: int) -> list[str]:
        """The leftovers files of ``generation`` (``write_leftovers``)."""
        return [url for g, url in self._removed_records(".parquet") if g == generation]

    @staticmethod
    def read_leftovers(url: str, generation: int, id_type: pa.DataType, vectors: bool = True
                       ) -> tuple[ShardHashes, np.ndarray | None]:
        """A leftovers file of ``generation``: its keys (ids of the set's ``id_type``), and its
        vectors (None where not ``vectors``: its keys alone are read)."""
        with storage.explained(url, "read"):
            _, schema = storage.parquet_footer(url)
        if not _leftovers_schema(schema):
            raise StorageError(f"{url}: not a leftovers file (id, hash uint64, embedding "
                               "fixed_size_list<float>, born int64)")
        columns = None if vectors else [c for c in schema.names if c != "embedding"]
        table = storage.read_parquet(url, columns=columns)
        keys = _shard_hashes(table, generation, id_type, url)
        return keys, vectors_of(table.column("embedding"), url) if vectors else None

    def _removed_records(self, suffix: str = ".json") -> list[tuple[int, str]]:
        """(generation, url) of every ``_removed`` file (the removal records, or the
        ``.parquet`` leftovers); names are checked, not trusted."""
        found = []
        for url in storage.list_files(self._at("_removed"), suffix):
            name = file_name(url.rsplit("/", 1)[-1], self._at("_removed"))
            generation, dash, _ = name.partition("-")
            if not (dash and generation.isdigit()):
                raise StorageError(
                    f"{url}: not a removal record name (<generation>-<shard>{suffix})")
            found.append((int(generation), self._at("_removed", name)))
        return found

    def _removed_record(self, url: str, id_type: pa.DataType) -> list:
        """A removal record's ids; a damaged one is one line saying how to recover: its ids
        may still be in the index, which only a rebuild then drops."""
        try:
            record = storage.read_model(url, RemovalRecord, "a removal record")
            return stored_ids(record.ids if record else [], id_type, url).to_pylist()
        except StorageError as exc:
            raise StorageError(
                f"{exc}; restore it, or remove it and rebuild the index (embedpipe index "
                f"{self.out} --set {self.name} --rebuild): the rows it names left the set"
            ) from None

    def removed_ids(self, generation: int, id_type: pa.DataType) -> list:
        """The ids ``generation`` removed from the set's shards, as ``id_type``'s values."""
        found: list = []
        for g, url in self._removed_records():
            if g == generation:
                found.extend(self._removed_record(url, id_type))
        return list(dict.fromkeys(found))

    def clear_removed(self, up_to: int) -> None:
        """Forget removal records (and leftovers, and moved-from lists) of generations
        already written to a changes file."""
        for g, url in self._removed_records() + self._removed_records(".parquet"):
            if g <= up_to:
                storage.remove(url)
        for url in storage.list_files(self._at("_moved"), ".json"):
            generation = url.rsplit("/", 1)[-1][:-len(".json")]
            if not generation.isdigit() or int(generation) <= up_to:
                storage.remove(url)

    # ---- the shards rows may have moved from, named once per run ---------------------------

    def _moved_url(self, generation: int) -> str:
        return self._at("_moved", f"{generation:06d}.json")

    def write_moved(self, generation: int, shards: list[str]) -> str:
        """Name the done shards whose rows may have moved in ``generation``'s run
        (``pipeline.reuse``), once for all its shards; returns the list's digest, which a
        shard's request carries ("" where none: any earlier list of the generation goes)."""
        url = self._moved_url(generation)
        if not shards:
            storage.remove(url)
            return ""
        for shard in shards:
            file_name(shard, "a shard id")
        storage.write_json(url, MovedShards(generation=generation, shards=shards).model_dump())
        return stable_hash(shards)

    def read_moved(self, generation: int, digest: str) -> list[str]:
        """The list ``write_moved`` named for ``generation``: its names checked, and its
        digest the one the run planned with."""
        url = self._moved_url(generation)
        listed = storage.read_model(url, MovedShards, "a list of moved-from shards")
        shards = listed.shards if listed else []
        for shard in shards:
            file_name(shard, url)
        if stable_hash(shards) != digest:
            raise StorageError(f"{url} is not the list of moved-from shards this run planned "
                               "with: it changed since; rerun")
        return shards

    def changes_url(self, generation: int) -> str:
        return self._at("_changes", f"{generation:06d}.json")

    def write_changes(self, generation: int, parts: list[str], deleted: list) -> None:
        changes = SetChanges(generation=generation, parts=sorted(parts), deleted_ids=deleted)
        for name in changes.parts:
            file_name(name, "a changes file")
        storage.write_json(self.changes_url(generation), changes.model_dump())

    def changes_since(self, generation: int, meta: SetMeta) -> list[SetChanges] | None:
        """The changes files of every run after ``generation`` up to ``meta``'s, in order;
        None where one of them is missing."""
        found = []
        for g in range(generation + 1, meta.generation + 1):
            change = self.read_changes(g, arrow_id_type(meta.id_type))
            if change is None:
                return None
            found.append(change)
        return found

    def read_changes(self, generation: int, id_type: pa.DataType) -> SetChanges | None:
        """``_changes/<generation>.json`` with its part names and deleted ids (as values of
        the set's ``id_type``) checked, or None when that run left no changes file."""
        url = self.changes_url(generation)
        changes = storage.read_model(url, SetChanges, "a changes file")
        if changes is None:
            return None
        for name in changes.parts:
            file_name(name, url)
        deleted = stored_ids(changes.deleted_ids, id_type, url).to_pylist()
        return changes.model_copy(update={"deleted_ids": deleted})
