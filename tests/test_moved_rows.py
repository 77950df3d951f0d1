"""Rows that move between shards keep their stored vectors (``pipeline.reuse``): a file
renamed, rewritten in another row order, rows moved to another file. Before, an incremental
run found stored vectors only in the shard's own range of the same file, and re-embedded
every such row."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _flowkit import job, read_set, run_library, text_for, write_corpus

from pipeline import reuse
from pipeline.errors import StorageError
from pipeline.index import IndexRequest, IndexResult, index_set, open_index
from pipeline.reuse import StoredVectors
from pipeline.sets import SetFolder, ShardHashes

ROWS = [(i, text_for(i)) for i in range(100)]


def _write(path: Path, rows: list[tuple[int, str]]) -> None:
    write_corpus(path, [i for i, _ in rows], [t for _, t in rows])


def _first_run(tmp_path: Path, model: Path) -> tuple[dict, dict]:
    _write(tmp_path / "c" / "a.parquet", ROWS)
    spec = job(tmp_path / "c", tmp_path / "out", model)  # 20 rows a shard: 5 shards
    assert run_library(spec).embedded == 100
    return spec, read_set(tmp_path / "out", "mean")


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("absorb", [reuse.ABSORB_PER_ROW, 0], ids=["whole", "rows"])
def test_rows_reordered_across_the_shards_of_a_file_are_not_embedded_again(
        tmp_path, tiny_model_dir, monkeypatch, absorb):
    """``rows``: no part or leftovers file is taken in whole (a shard's budget spent), only
    the rows each slice asks for."""
    monkeypatch.setattr(reuse, "ABSORB_PER_ROW", absorb)
    spec, before = _first_run(tmp_path, tiny_model_dir)
    shuffled = ROWS[:]
    random.Random(0).shuffle(shuffled)
    _write(tmp_path / "c" / "a.parquet", shuffled)
    summary = run_library(spec, verify=True)
    assert (summary.embedded, summary.reused, summary.removed) == (0, 100, 0)
    assert _same(read_set(tmp_path / "out", "mean"), before)
    assert not list((tmp_path / "out" / "sets" / "mean" / "_removed").glob("*"))
    assert not list((tmp_path / "out" / "sets" / "mean" / "_moved").glob("*"))


def test_the_moved_from_shards_are_named_once_not_in_every_request(tmp_path, tiny_model_dir):
    """Every shard's request carried the run's whole list: after a compaction of a corpus of
    N shards, N requests of N names each (8,000 shards: 288 KB a request, 2.3 GB in all for
    a process or Dask runner). Now the list is one file, and a request holds its digest."""
    from pipeline.config import EmbedJob
    from pipeline.embedder import get_embedder
    from pipeline.run import prepare

    spec, _ = _first_run(tmp_path, tiny_model_dir)
    shuffled = ROWS[:]
    random.Random(1).shuffle(shuffled)
    _write(tmp_path / "c" / "a.parquet", shuffled)
    parsed = EmbedJob.model_validate(spec)
    plan = prepare(parsed, lambda: get_embedder(parsed.encoder, parsed.poolers), verify=True)
    folder = SetFolder(str(tmp_path / "out"), "mean")
    shards = sorted(folder.read_markers())
    [digest] = {work.moved for request in plan.requests for work in request.sets}
    assert len(plan.requests) == len(shards) == 5 and len(digest) == 16
    assert folder.read_moved(2, digest) == shards
    listed = tmp_path / "out" / "sets" / "mean" / "_moved" / "000002.json"
    listed.write_text(listed.read_text().replace(shards[0], "../../../x"))
    with pytest.raises(StorageError, match=r"file name '(\.\./){3}x' in .*_moved/000002.json"):
        folder.read_moved(2, digest)
    listed.write_text(listed.read_text().replace("../../../x", shards[1]))
    with pytest.raises(StorageError, match="is not the list of moved-from shards this run"):
        folder.read_moved(2, digest)


def test_a_renamed_file_and_rows_moved_between_files_keep_their_vectors(tmp_path,
                                                                        tiny_model_dir):
    spec, before = _first_run(tmp_path, tiny_model_dir)
    (tmp_path / "c" / "a.parquet").rename(tmp_path / "c" / "b.parquet")
    summary = run_library(spec, verify=True)
    assert (summary.embedded, summary.reused) == (0, 100)
    assert _same(read_set(tmp_path / "out", "mean"), before)

    # a compaction: the rows split over two new files; one text changed, one row deleted
    moved = [(i, "a changed text" if i == 50 else t) for i, t in ROWS if i != 7]
    (tmp_path / "c" / "b.parquet").unlink()
    _write(tmp_path / "c" / "x.parquet", moved[::2])
    _write(tmp_path / "c" / "y.parquet", moved[1::2])
    summary = run_library(spec, verify=True)
    assert (summary.embedded, summary.reused, summary.removed) == (1, 98, 1)
    after = read_set(tmp_path / "out", "mean")
    fresh = tmp_path / "fresh"
    run_library(job(tmp_path / "c", fresh, tiny_model_dir))
    expected = read_set(fresh, "mean")
    assert after.keys() == expected.keys()
    assert all(np.array_equal(after[k], before[k]) for k in after if k != 50)
    assert np.allclose(after[50], expected[50], atol=1e-6)


def test_a_moved_from_part_is_not_read_once_its_marker_changed(tmp_path, tiny_model_dir):
    """A part another worker is rewriting (its marker gone or new) is not mixed with the
    hashes of its last version: its rows are not taken."""
    _first_run(tmp_path, tiny_model_dir)
    folder = SetFolder(str(tmp_path / "out"), "mean")
    markers = folder.read_markers()
    [shard] = [s for s in markers if s.endswith("g00002-00004")]
    ids, hashes, _, _ = folder.read_hashes(shard, pa.int64())
    moved = folder.write_moved(2, [shard])
    stored = StoredVectors(folder.out, "mean", 32, pa.int64(), [], moved, generation=2,
                           shard_rows=20)
    assert (stored.lookup(ids, hashes) >= 0).all()
    folder.remove_marker(shard)
    moved = folder.write_moved(3, [shard])
    fresh = StoredVectors(folder.out, "mean", 32, pa.int64(), [], moved, generation=3,
                          shard_rows=20)
    assert (fresh.lookup(ids, hashes) == -1).all()


def _keys(ids: pa.Array) -> ShardHashes:
    """Keys of leftovers of generation 2: a row of hash 7, its vector made in generation 1."""
    return ShardHashes(ids, np.array([7], np.uint64), 2, np.array([1]))


@pytest.mark.parametrize("first", [True, False], ids=["first-block", "after-a-part"])
def test_leftovers_of_another_width_are_refused(tmp_path, tiny_model_dir, first):
    """Also where they are the first vectors a shard takes in: a shard then wrote a done
    part of their width (found by an adversarial review)."""
    _first_run(tmp_path, tiny_model_dir)
    folder = SetFolder(str(tmp_path / "out"), "mean")
    shard = sorted(folder.read_markers())[0]
    stored = StoredVectors(folder.out, "mean", 32, pa.int64(), [] if first else [shard],
                           folder.write_moved(2, ["gone"]), generation=2, shard_rows=20)
    folder.write_leftovers(2, "other", _keys(pa.array([500])), np.zeros((1, 5), np.float32))
    with pytest.raises(StorageError, match="vectors of 5 dimensions in a set of 32"):
        stored.lookup(pa.array([500]), np.array([7], np.uint64))


def test_leftovers_of_another_shape_are_one_line(tmp_path, tiny_model_dir):
    _first_run(tmp_path, tiny_model_dir)
    folder = SetFolder(str(tmp_path / "out"), "mean")
    stored = StoredVectors(folder.out, "mean", 32, pa.int64(), [],
                           folder.write_moved(2, ["gone"]), generation=2, shard_rows=20)
    url = tmp_path / "out" / "sets" / "mean" / "_removed" / "000002-other.parquet"
    url.parent.mkdir()
    pq.write_table(pa.table({"id": [500], "hash": ["x"]}), url)
    with pytest.raises(StorageError, match="not a leftovers file"):
        stored.lookup(pa.array([500]), np.array([7], np.uint64))
    url.unlink()
    folder.write_leftovers(2, "other", _keys(pa.array(["500"])), np.zeros((1, 32), np.float32))
    with pytest.raises(StorageError, match="other.parquet: its ids are string, not the set's"):
        stored.lookup(pa.array([500]), np.array([7], np.uint64))


def test_past_its_budget_a_shard_reads_the_vectors_of_leftovers_holding_its_rows(
        tmp_path, tiny_model_dir, monkeypatch):
    """Each leftovers file's keys are read once; its vectors only when it holds a row asked
    for (every file was read whole again for every slice with rows not found)."""
    _first_run(tmp_path, tiny_model_dir)
    folder = SetFolder(str(tmp_path / "out"), "mean")
    for shard, row in (("a", 500), ("b", 600)):
        folder.write_leftovers(2, shard, _keys(pa.array([row])), np.ones((1, 32), np.float32))
    reads, read = [], SetFolder.read_leftovers

    def counted(url: str, generation: int, id_type: pa.DataType, vectors: bool = True):
        reads.append((url.rsplit("-", 1)[-1], vectors))
        return read(url, generation, id_type, vectors)

    monkeypatch.setattr(SetFolder, "read_leftovers", staticmethod(counted))
    stored = StoredVectors(folder.out, "mean", 32, pa.int64(), [],
                           folder.write_moved(2, ["gone"]), generation=2, shard_rows=0)
    for row in (500, 700, 600):
        stored.lookup(pa.array([row]), np.array([7], np.uint64))
    assert reads == [("a.parquet", False), ("a.parquet", True), ("b.parquet", False),
                     ("b.parquet", True)]
    assert (stored.lookup(pa.array([500, 600]), np.array([7, 7], np.uint64)) >= 0).all()
    assert stored.born(np.arange(2)).tolist() == [1, 1]  # the generation that made them


def _reordered(tmp_path: Path, rows: list[tuple[int, str]]) -> None:
    random.Random(0).shuffle(rows)
    _write(tmp_path / "c" / "a.parquet", rows)


def _compacted(tmp_path: Path, rows: list[tuple[int, str]]) -> None:
    (tmp_path / "c" / "a.parquet").unlink()
    _write(tmp_path / "c" / "x.parquet", rows[::2])
    _write(tmp_path / "c" / "y.parquet", rows[1::2])


@pytest.mark.parametrize("edit", [_reordered, _compacted], ids=["reordered", "compacted"])
@pytest.mark.parametrize("kind", ["hnsw", "flat"])
def test_an_index_catch_up_keeps_the_rows_whose_vectors_moved(tmp_path, tiny_model_dir,
                                                               kind, edit):
    """The catch-up re-adds only vectors made after its index: rows reordered (the shards'
    own leftovers) or moved to new files keep their labels. It re-added every row of a
    rewritten part, and an HNSW index, masking them all, was rebuilt in whole."""
    spec, _ = _first_run(tmp_path, tiny_model_dir)
    out = tmp_path / "out"
    before = _index(out, kind).meta
    edit(tmp_path, [(i, "a changed text" if i == 50 else t) for i, t in ROWS])
    assert (run_library(spec).embedded, SetFolder(str(out), "mean").meta().generation) == (1, 2)
    result = _index(out, "auto")
    assert (result.action, result.meta.kind, result.meta.rows) == ("caught up", kind, 100)
    assert result.meta.masked == (kind == "hnsw")  # row 50's old vector: HNSW cannot delete
    labels = {}
    for meta in (before, result.meta):
        idmap = open_index(str(out), meta).idmap
        ids, kept_at = idmap.ids.to_pylist(), idmap.labels.tolist()
        labels[meta.generation] = dict(zip(ids, kept_at, strict=True))
    assert {i for i in labels[1] if labels[1][i] != labels[2][i]} == {50}
    vectors = read_set(out, "mean")
    hits = open_index(str(out), result.meta).search(np.stack([vectors[50], vectors[3]]), 1)
    assert [row[0][0] for row in hits] == [50, 3]


def _index(out: Path, kind: str) -> IndexResult:
    return index_set(IndexRequest(out=str(out), set_name="mean", kind=kind), say=lambda _: None)
