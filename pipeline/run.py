"""A whole embedding run, minus the orchestration: check and plan before, record after.

``prepare`` does every check that can fail before any vector is computed (columns, corrupt
files, empty corpus, duplicate ids, sets of another fingerprint), claims the sets and lists
the shard requests still to run. ``finalize`` runs once every shard succeeded: it retires
shards no longer in the plan, writes the run's ``_changes`` file and updates ``_SET.json``.

Generations: a run works on generation ``g = stored + 1`` of each set and stamps every marker
it writes with ``g``. A crashed run leaves ``_SET.json`` at ``g - 1``, so its rerun works on
the same ``g`` and finds the markers written before the crash: the changes file it writes
covers both attempts. A run that changes nothing leaves the generation as it was.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from pipeline import faults, storage
from pipeline.config import EmbedJob, stable_hash
from pipeline.corpus import (
    CorpusInfo,
    Duplicates,
    arrow_id_type,
    describe,
    find_duplicates,
    id_type_holds,
)
from pipeline.errors import CorpusError, FingerprintError
from pipeline.job import SetWork, ShardRequest, ShardResult
from pipeline.lease import check_held
from pipeline.sets import (
    SetFolder,
    SetMeta,
    ShardMarker,
    part_name,
    quarantine_url,
    quarantined_shards,
)
from pipeline.shards import Shard, plan_shards
from pipeline.stats import ShardStats

if TYPE_CHECKING:
    import pyarrow as pa

    from pipeline.embedder import Embedder


class RunPlan(BaseModel):
    job: EmbedJob
    corpus: CorpusInfo
    shards: list[Shard]
    generation: dict[str, int]
    requests: list[ShardRequest]
    duplicates: Duplicates

    @property
    def done_shards(self) -> int:
        return len(self.shards) - len(self.requests)

    @property
    def rows_todo(self) -> int:
        return sum(r.shard.rows for r in self.requests)


class RunSummary(BaseModel):
    sets: list[str]
    shards: int
    shards_run: int
    rows: int  # valid rows in the corpus (each is in every set exactly once)
    embedded: int  # rows that went through the encoder in this run
    reused: int
    removed: int
    skipped: dict[str, int]
    generation: dict[str, int]
    seconds: float = 0.0  # running the shards
    setup_seconds: float = 0.0  # before them: checks, planning, the model load if any
    stats: ShardStats = ShardStats()  # this run's shards added up

    @property
    def docs_per_s(self) -> float:
        return self.embedded / self.seconds if self.seconds > 0 else 0.0

    def line(self, verb: str = "embedded") -> str:
        skipped = sum(self.skipped.values())
        why = ", ".join(f"{k} {v}" for k, v in sorted(self.skipped.items()))
        return (
            f"{verb} {self.embedded:,} rows ({self.reused:,} reused, {self.removed:,} removed); "
            f"{self.rows:,} rows in {len(self.sets)} set(s) [{', '.join(self.sets)}]; "
            f"{self.shards_run}/{self.shards} shards run in {self.seconds:.1f}s, "
            f"{self.docs_per_s:,.0f} docs/s, after {self.setup_seconds:.1f}s of checks, planning "
            f"and model load; skipped {skipped:,} rows"
            + (f" ({why})" if why else "")
            + (f"; {self.stats.duplicates:,} duplicate texts encoded once"
               if self.stats.duplicates else "")
            + (f"; {self.stats.encoder_line()}" if self.stats.tokens else "")
            + (f"; busy {self.stats.stage_line()}" if self.stats.seconds else "")
        )

    def table_row(self) -> dict[str, str | int | float]:
        """The run's numbers as one row of a table (the flow's Prefect artifact)."""
        stats = self.stats
        return {
            "sets": ", ".join(self.sets), "rows": self.rows, "embedded": self.embedded,
            "reused": self.reused, "removed": self.removed,
            "skipped": sum(self.skipped.values()),
            **{f"skipped {k}": v for k, v in sorted(self.skipped.items())},
            "shards run": f"{self.shards_run}/{self.shards}",
            "seconds": round(self.seconds, 2), "docs/s": round(self.docs_per_s, 1),
            "setup seconds": round(self.setup_seconds, 2),
            "duplicates": stats.duplicates, "tokens": stats.tokens,
            "truncated": stats.truncated, "padding %": round(100 * stats.padding_share, 2),
            **{f"{stage} seconds": round(s, 2) for stage, s in stats.seconds.items()},
        }


def job_keys(job: EmbedJob) -> dict[str, str]:
    """Per set: everything that decides its vectors and is known without loading the model
    (the encoder options, the pooler spec, the model files' hash, a pooling head's files).

    Equal keys mean equal fingerprints, so a run whose sets all carry its keys plans without
    loading the model, and a rerun with nothing to do never loads it.
    """
    from pipeline.models.hashing import folder_hash

    files = folder_hash(job.encoder.model)
    # compile: the same vectors either way; int8_kernel: only ever set with dtype int8 (left
    # out otherwise so that the keys of sets made before it existed still hold)
    unkeyed = {"compile"} | ({"int8_kernel"} if job.encoder.dtype != "int8" else set())
    encoder = job.encoder.model_dump(mode="json", exclude=unkeyed)
    return {
        spec.name: stable_hash({
            "encoder": encoder,
            "pooler": spec.model_dump(mode="json"),
            "model_files": files,
            "head": _head_files(spec.head) if spec.head else None,
        })
        for spec in job.poolers
    }


def _head_files(folder: str) -> list[str]:
    """A learned head's two files' digests, read checked (``head_files.head_file_digests``,
    without torch: a rerun of a learned set with nothing to do imports none)."""
    from pipeline.head_files import head_file_digests

    return head_file_digests(folder)


def set_meta(embedder: Embedder, job: EmbedJob, name: str, id_type: str, key: str | None = None
             ) -> SetMeta:
    """The metadata a set made by this job and embedder must carry."""
    spec = embedder.specs[name]
    info = embedder.info
    window = job.encoder.window
    return SetMeta(
        name=name,
        fingerprint=embedder.fingerprint(name),
        model=info.model,
        model_hash=info.model_hash,
        encoder=job.encoder.model_dump(mode="json"),
        pooler=spec.model_dump(mode="json"),
        pooler_identity=embedder.poolers[name].identity(),
        dim=embedder.dims()[name],
        dtype=info.dtype,
        normalize=spec.normalize,
        similarity=info.similarity,
        max_length=info.max_length,
        window=window.model_dump(mode="json") if window else None,
        id_type=id_type,
        corpus=job.corpus,
        id_column=job.id_column,
        text_column=job.text_column,
        job_key=key,
    )


def prepare(job: EmbedJob, load_embedder: Callable[[], Any], verify: bool = False,
            lease: str | None = None) -> RunPlan:
    """Check everything, claim the sets, list the shards to run.

    The corpus is checked before ``load_embedder`` is called: a bad corpus fails in seconds.

    ``verify`` (nightly runs) re-reads every shard and compares content hashes; otherwise a
    shard whose marker matches its row-group signature and content digest (what the footer
    says of its id and text columns: sizes, statistics) is taken as done without reading it.
    """
    corpus = describe(job.corpus, job.id_column, job.text_column, job.out)
    shards = plan_shards(corpus.files, job.rows_per_shard)
    duplicates = find_duplicates(corpus, job.id_column, job.text_column)
    if duplicates.rows and not job.dedupe:
        raise CorpusError(
            f"duplicate ids in {job.corpus}: {duplicates.describe()}; "
            "pass --dedupe to keep the first row with a valid text of each id"
        )
    keys = job_keys(job)
    stored = _stored(job, keys)
    id_type = _written_id_type(stored, corpus.id_type, job.out)
    metas = _claim(job, keys, stored, id_type, load_embedder)
    generation = {name: meta.generation + 1 for name, meta in metas.items()}
    markers = {name: _standing(SetFolder(job.out, name)) for name in metas}
    quarantined = quarantined_shards(job.out) if job.quarantine else None
    drops = {s.id: _drops(duplicates, s) for s in shards}
    signatures = {s.id: _signature(s, drops[s.id]) for s in shards}
    moved = {name: SetFolder(job.out, name).write_moved(generation[name],
                                                        _moved_from(shards, signatures, found))
             for name, found in markers.items()}
    ranges = {name: MarkerRanges(found) for name, found in markers.items()}
    requests = []
    for shard in shards:
        signature = signatures[shard.id]
        work = [
            _set_work(shard, ranges[name], markers[name], metas[name], moved[name])
            for name in metas
            if verify or not _done(markers[name].get(shard.id), signature, shard.content,
                                   quarantined)
        ]
        if work:
            requests.append(
                ShardRequest(
                    job=job,
                    shard=shard,
                    signature=signature,
                    id_type=id_type,
                    generation=generation,
                    sets=work,
                    drop_rows=drops[shard.id],
                    lease=lease,
                )
            )
    return RunPlan(
        job=job,
        corpus=corpus,
        shards=shards,
        generation=generation,
        requests=requests,
        duplicates=duplicates,
    )


def _claim(job: EmbedJob, keys: dict[str, str], stored: dict[str, SetMeta | None],
           id_type: str, load_embedder: Callable[[], Any]) -> dict[str, SetMeta]:
    """Each set's metadata, claimed for this job: from ``_SET.json`` alone when every set
    was made by this very job before (same keys), else checked against the loaded model."""
    if _made_by(stored, keys):
        return {name: meta for name, meta in stored.items() if meta is not None}
    embedder = load_embedder()
    return {
        name: SetFolder(job.out, name).claim(set_meta(embedder, job, name, id_type, key))
        for name, key in keys.items()
    }


def needs_model(job: EmbedJob) -> bool:
    """Whether planning ``job`` will load the model: some set is new, or was made by another
    job (``_claim`` then checks fingerprints against the loaded model)."""
    keys = job_keys(job)
    return not _made_by(_stored(job, keys), keys)


def _stored(job: EmbedJob, keys: dict[str, str]) -> dict[str, SetMeta | None]:
    """Each set's stored metadata (None for a new set). A set made from other corpus columns
    is refused (``SetMeta.check_columns``) before any model loads: the keys do not hold the
    columns."""
    stored = {name: SetFolder(job.out, name).read_meta() for name in keys}
    for meta in stored.values():
        if meta is not None:
            meta.check_columns(job.id_column, job.text_column, job.out)
    return stored


def _made_by(stored: dict[str, SetMeta | None], keys: dict[str, str]) -> bool:
    """Whether every set exists and was made by a job of these ``keys``."""
    return all(m is not None and m.job_key == keys[n] for n, m in stored.items())


def _written_id_type(stored: dict[str, SetMeta | None], corpus_type: str, out: str) -> str:
    """The id type this run writes: the corpus's, or the existing sets' where theirs holds
    every corpus id (a corpus rewritten by another tool: ``large_string`` for ``string``,
    ``int64`` for ``int32``), so that a set's parts keep one id type."""
    kept = {name: m.id_type for name, m in stored.items() if m is not None}
    types = set(kept.values())
    if not types:
        return corpus_type
    if len(types) > 1:
        listed = ", ".join(f"{n}: {t}" for n, t in kept.items())
        raise FingerprintError(
            f"the sets in {out} store ids of different types ({listed}); embed them in "
            "separate runs"
        )
    [written] = types
    if not id_type_holds(written, corpus_type):
        name = next(iter(kept))
        raise FingerprintError(
            f"set {name!r} in {out} stores {written} ids, the corpus has {corpus_type} ids, "
            f"which {written} cannot hold; cast the corpus's id column to {written}, or use "
            "another set name or OUT"
        )
    return written


def _drops(duplicates: Duplicates, shard: Shard) -> list[int]:
    rows = duplicates.drop.get(shard.file, [])
    return [r for r in rows if shard.offset <= r < shard.offset + shard.rows]


def _standing(folder: SetFolder) -> dict[str, ShardMarker]:
    """The set's done markers whose part stands: a shard with rows whose part is gone (removed
    by hand, lost by the store) is redone, not counted as done and missing from the set."""
    written = folder.written_shards()
    return {sid: m for sid, m in folder.read_markers().items() if not m.rows or sid in written}


def _done(marker: ShardMarker | None, signature: str, content: str,
          quarantined: set[str] | None = None) -> bool:
    """Whether ``marker`` says the shard of this row-group ``signature`` and ``content``
    digest is done (a marker written before markers kept the digest: by its signature). With
    ``--quarantine`` (``quarantined``: the shards that have a quarantine file), a shard that
    skipped rows but has no file is not: the run writes it (its vectors are reused)."""
    if marker is None or marker.signature != signature or marker.content not in (None, content):
        return False
    return quarantined is None or not marker.skipped or marker.shard in quarantined


def _set_work(shard: Shard, ranges: MarkerRanges, markers: dict[str, ShardMarker],
              meta: SetMeta, moved: str) -> SetWork:
    return SetWork(name=meta.name, previous=ranges.overlapping(shard), moved=moved,
                   dim=meta.dim, prior=markers.get(shard.id), fingerprint=meta.fingerprint)


class MarkerRanges:
    """A set's done markers by file and row-group range: the ones a shard overlaps found by
    bisection (a scan of every marker for every shard took 15 s to plan 8,000 shards)."""

    def __init__(self, markers: dict[str, ShardMarker]) -> None:
        by_file: dict[str, list[ShardMarker]] = {}
        for marker in sorted(markers.values(), key=lambda m: m.first_group):
            by_file.setdefault(marker.file, []).append(marker)
        # per file: the markers' first groups (sorted), the markers, the widest one's groups
        self._files = {
            file: ([m.first_group for m in found], found,
                   max(m.end_group - m.first_group for m in found))
            for file, found in by_file.items()
        }

    def overlapping(self, shard: Shard) -> list[str]:
        """Shard ids (sorted) of the markers whose range overlaps ``shard``'s: each starts
        within the widest marker's width before the shard's first group."""
        if shard.file not in self._files:
            return []
        starts, found, widest = self._files[shard.file]
        lo = bisect_left(starts, shard.first_group - widest + 1)
        hi = bisect_left(starts, shard.end_group)
        return sorted(m.shard for m in found[lo:hi]
                      if shard.overlaps(m.file, m.first_group, m.end_group))


def _signature(shard: Shard, drop: list[int]) -> str:
    """The shard's signature, with the duplicate rows it drops."""
    return stable_hash([shard.signature, drop]) if drop else shard.signature


def _moved_from(shards: list[Shard], signatures: dict[str, str],
                markers: dict[str, ShardMarker]) -> list[str]:
    """The done shards whose rows may have moved to other shards: gone from the plan, or their
    rows changed (a file renamed, rewritten in another order, merged into others). A shard
    that is done as planned still holds its rows."""
    planned = {s.id: s for s in shards}
    return sorted(
        sid for sid, marker in markers.items()
        if sid not in planned or not _done(marker, signatures[sid], planned[sid].content)
    )


def finalize(plan: RunPlan, results: list[ShardResult], seconds: float,
             setup_seconds: float = 0.0) -> RunSummary:
    """Retire shards gone from the plan, write the changes file and ``_SET.json`` per set.
    ``seconds``: the shards' wall time; ``setup_seconds``: the run's time before them."""
    job = plan.job
    total = ShardStats.total(r.stats for r in results)
    planned = {s.id for s in plan.shards}
    metas, deleted = {}, []
    for spec in job.poolers:
        metas[spec.name], gone = _finalize_set(SetFolder(job.out, spec.name), planned,
                                               plan.generation[spec.name], job)
        deleted.append(gone)
    last = metas[job.poolers[-1].name] if metas else None  # every set holds the same rows
    return RunSummary(
        sets=[p.name for p in job.poolers],
        shards=len(plan.shards),
        shards_run=len(results),
        rows=last.rows_written if last else 0,
        embedded=total.embedded,
        reused=total.reused,
        removed=max(deleted, default=0),
        skipped=last.rows_skipped if last else {},
        generation={name: meta.generation for name, meta in metas.items()},
        seconds=seconds,
        setup_seconds=setup_seconds,
        stats=total,
    )


def _finalize_set(folder: SetFolder, planned: set[str], g: int, job: EmbedJob
                  ) -> tuple[SetMeta, int]:
    """One set at a run's end: retire its unplanned shards, write its changes file (when
    generation ``g`` changed it) and ``_SET.json`` (the corpus where this run read it: search
    joins snippets from there); returns the new metadata and how many ids left the set."""
    check_held(folder.out)  # a writer paused past its TTL records nothing into OUT
    markers, meta = folder.read_markers(), folder.meta()
    id_type = arrow_id_type(meta.id_type)
    _retire(folder, markers, planned, g, id_type)
    live = [m for sid, m in markers.items() if sid in planned]
    parts = [part_name(m.shard) for m in live if m.generation == g and m.rows]
    removed = folder.removed_ids(g, id_type)
    deleted = _left_the_set(folder, removed, [m.shard for m in live], id_type)
    changed = bool(parts or removed)
    held = ShardStats.total(ShardStats(rows=m.rows, skipped=m.skipped) for m in live)
    meta = meta.model_copy(
        update={
            "shards_done": len(live),
            "rows_written": held.rows,
            "rows_skipped": held.skipped,
            "generation": g if changed else g - 1,
            "corpus": job.corpus,
            "rows_per_shard": job.rows_per_shard,
        }
    )
    check_held(folder.out)
    if changed:
        folder.write_changes(g, parts, deleted)
    folder.write_meta(meta)
    folder.clear_removed(g)
    return meta, len(deleted)


def _retire(folder: SetFolder, markers: dict, planned: set[str], g: int,
            id_type: pa.DataType) -> None:
    """Shards no longer planned: record their ids as removed, then delete marker and part
    (the marker first: one left on a removed part would say its rows are there, to a rerun
    after the file came back). A shard's part left without its marker by a run that died
    (``unmarked_shards``) goes too once its shard id left the plan (the file grew, or went):
    else it stayed for good."""
    gone = set(markers) | folder.unmarked_shards(markers)
    for sid in sorted(sid for sid in gone if sid not in planned):
        check_held(folder.out)  # never retire what a writer that took OUT over wrote
        ids = folder.read_hashes(sid, id_type).ids
        folder.record_removed(g, sid, ids)
        folder.remove_marker(sid)
        faults.hit("retire_part", f"{sid}/{folder.name}")
        folder.remove_part(sid)
        storage.remove(quarantine_url(folder.out, sid))


def _left_the_set(folder: SetFolder, removed: list, live_shards: list[str],
                  id_type: pa.DataType) -> list:
    """Removed ids that are not in any live part (ids that moved to another shard stay)."""
    if not removed:
        return []
    gone = dict.fromkeys(removed)
    for sid in live_shards:
        ids = folder.read_hashes(sid, id_type).ids
        for i in ids.to_pylist():
            gone.pop(i, None)
        if not gone:
            break
    return list(gone)
