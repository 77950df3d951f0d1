"""Files of a set or an index changed by hand (found by an adversarial review): each is one
line naming the file and what to do, never a hang, a traceback, or an index that answers
wrong. Sets are synthetic (``_index_sets``); the index is a real FAISS one."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _index_sets import bump, clustered, write_part, write_set

from pipeline import storage
from pipeline.errors import FingerprintError, StorageError
from pipeline.index import IndexRequest, index_set, open_index, read_meta
from pipeline.sets import SetFolder

ROWS = 300


def build(out: Path, **kw):
    return index_set(IndexRequest(out=str(out), set_name="s", **kw), say=lambda _: None)


@pytest.fixture
def out(tmp_path) -> Path:
    write_set(tmp_path, "s", list(range(ROWS)), clustered(ROWS, 8, seed=1), parts=3)
    build(tmp_path, kind="hnsw")
    return tmp_path


def index_folder(out: Path) -> Path:
    return out / "index" / "s"


def reseal(out: Path, **changes) -> None:
    """``_INDEX.json`` with ``changes`` and the SHA-256 of the files as they are now: what a
    writer who rewrote both leaves (the checksums alone cannot tell)."""
    marker = index_folder(out) / "_INDEX.json"
    meta = json.loads(marker.read_text()) | changes
    for key, name in (("index_sha256", "index_file"), ("idmap_sha256", "idmap_file")):
        meta[key] = storage.sha256(str(index_folder(out) / meta[name]))
    marker.write_text(json.dumps(meta))


def open_it(out: Path):
    return open_index(str(out), read_meta(str(out), "s"))


@pytest.mark.parametrize("where", ["index/s/_INDEX.json", "sets/s/_SET.json", "index-file"])
def test_a_fifo_in_place_of_a_file_is_one_line_not_a_hang(out, where):
    """Every reader of the set or its index hung for good (a server's reloads too)."""
    if where == "index-file":
        where = f"index/s/{read_meta(str(out), 's').index_file}"
    path = out / where
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(StorageError, match=f"cannot read {path}: not a regular file"):
        open_it(out) if where.startswith("index/") else build(out)


def test_a_json_file_too_large_to_read_is_one_line(out):
    """It was read whole: a sparse 20 GB ``_INDEX.json`` filled memory, then a traceback."""
    marker = index_folder(out) / "_INDEX.json"
    with open(marker, "r+b") as fh:
        fh.truncate(20 << 30)
    with pytest.raises(StorageError, match=f"cannot read {marker}: larger than 536,870,912"):
        read_meta(str(out), "s")


@pytest.mark.parametrize("damage", ["gone", "fifo"])
def test_a_done_part_that_is_gone_fails_the_build_naming_it(out, damage):
    """It was skipped: the index (and read_set) silently lacked its rows, recall 1.0."""
    part = out / "sets" / "s" / "part-00001.parquet"
    part.unlink()
    if damage == "fifo":
        os.mkfifo(part)
    with pytest.raises(StorageError, match=f"{part}: missing or not a file, though shard "
                                           "00001 is done with 100 rows; run embed again"):
        build(out, rebuild=True)
    with pytest.raises(StorageError, match="missing or not a file"):
        SetFolder(str(out), "s").scan()


def test_a_part_holding_nan_vectors_is_refused_naming_it(out):
    """Its rows were indexed and found by no query, while the recall check said 1.0."""
    part = out / "sets" / "s" / "part-00000.parquet"
    table = pq.read_table(part)
    flat = np.ones((table.num_rows, 8), np.float32)
    flat[3, 2] = np.nan
    vectors = pa.FixedSizeListArray.from_arrays(pa.array(flat.ravel()), 8)
    pq.write_table(table.set_column(1, "embedding", vectors), part)
    with pytest.raises(StorageError, match=f"{part} has 1 embeddings that are not finite"):
        build(out, rebuild=True)


def _tamper(part: Path, case: str) -> str:
    """``part`` (100 rows) rewritten as ``case``; the line each reader must give."""
    table = pq.read_table(part)
    if case == "nan":
        flat = np.ones((table.num_rows, 8), np.float32)
        flat[3, 2] = np.nan
        table = table.set_column(1, "embedding",
                                 pa.FixedSizeListArray.from_arrays(pa.array(flat.ravel()), 8))
        problem = f"{part} has 1 embeddings that are not finite"
    elif case == "null id":
        ids = table.column("id").to_pylist()
        table = table.set_column(0, "id", pa.array([None, *ids[1:]], pa.int64()))
        problem = f"{part}: 1 of its ids are null"
    elif case == "short":  # another part's rows: its marker says 100
        table = table.slice(0, 60)
        problem = f"{part} holds 60 rows, its shard was done with 100"
    else:  # every row the same id
        table = table.set_column(0, "id", pa.array([0] * table.num_rows, pa.int64()))
        problem = "set 's' in .* holds ids more than once \\(e.g. \\[0\\]\\)"
    pq.write_table(table, part)
    return problem


@pytest.mark.parametrize("case", ["nan", "null id", "short", "repeated"])
def test_a_damaged_part_is_refused_by_every_reader_naming_it(out, case):
    """read_set returned the rows of each as they were (a NaN vector, a null id, 60 rows of a
    shard done with 100, one id 100 times); the index built over the null id and the short
    part."""
    problem = _tamper(out / "sets" / "s" / "part-00001.parquet", case)
    with pytest.raises(StorageError, match=problem):
        SetFolder(str(out), "s").scan()
    with pytest.raises(StorageError, match=problem):
        build(out, rebuild=True)


def test_an_index_json_counting_fewer_vectors_than_its_files_is_refused(out):
    """A catch-up took ``next_label`` from it and handed out labels masked rows still held,
    then published an index every reader refused."""
    reseal(out, ntotal=250, next_label=250)
    with pytest.raises(StorageError, match="_INDEX.json: ntotal 250, but its files hold 300; "
                                           "rebuild the index"):
        open_it(out)
    write_part(out, "s", "part-00009.parquet", range(900, 910), clustered(10, 8, seed=2))
    bump(out, "s", ["part-00009.parquet"], [])
    before = read_meta(str(out), "s").token
    with pytest.raises(StorageError, match="ntotal 250, but its files hold 300"):
        build(out)
    assert read_meta(str(out), "s").token == before  # nothing published


@pytest.mark.parametrize(("table", "says"), [
    ({"label": pa.array(["0"]), "id": pa.array([1])}, "is not an id map"),
    ({"label": pa.array([-1, 0], pa.int64()), "id": pa.array([1, 2])}, "a label is negative"),
    ({"label": pa.array([0, 1], pa.int64()), "id": pa.array([7, 7])}, "not distinct"),
    ({"label": pa.array([0, 1], pa.int64()), "id": pa.array([7, None])}, "or some are null"),
    ({"label": pa.array([0], pa.int64()), "id": pa.array([[1]])}, "not integers or strings"),
], ids=["label-str", "label-negative", "ids-repeated", "id-null", "id-list"])
def test_an_id_map_that_is_no_id_map_is_one_line(out, table, says):
    """Tracebacks (a str label, a list id), or a search that answered one id three times."""
    meta = read_meta(str(out), "s")
    pq.write_table(pa.table(table), index_folder(out) / meta.idmap_file)
    reseal(out, rows=len(table["id"]))
    with pytest.raises(StorageError, match=says):
        open_it(out)


def test_a_faiss_file_of_another_width_or_metric_is_refused(out):
    meta = read_meta(str(out), "s")
    import faiss

    faiss.write_index(faiss.IndexFlatL2(8), str(index_folder(out) / meta.index_file))
    reseal(out, ntotal=0)  # counts agree: the metric is what differs
    with pytest.raises(StorageError, match="rows 300, but its files hold 0|metric ip, but"):
        open_it(out)


def test_a_folder_named_like_an_index_file_is_left_and_does_not_fail_the_build(out):
    """Pruning old versions removed it without ``recursive``: a traceback after publishing,
    and every later build the same."""
    junk = index_folder(out) / "index-junk"
    junk.mkdir()
    (junk / "keep.txt").write_text("theirs")
    assert build(out, rebuild=True).action == "built"
    assert (junk / "keep.txt").read_text() == "theirs"


def test_an_index_folder_that_is_a_file_is_one_line(tmp_path):
    """The build ran, then staging failed with a NotADirectoryError traceback."""
    write_set(tmp_path, "s", list(range(50)), clustered(50, 8, seed=3), parts=1)
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / "s").write_text("x")
    with pytest.raises(StorageError, match="cannot write .*index/s"):
        build(tmp_path)


def test_a_set_whose_similarity_changed_since_the_index_is_not_caught_up(tmp_path):
    """Its vectors were put in the index as stored, beside unit-length ones: the new rows
    topped every query. ``_SET.json`` now says ``dot`` where the index was built ``cosine``."""
    x = clustered(200, 8, seed=4, normalize=False) * 5
    write_set(tmp_path, "s", list(range(200)), x, normalize=False, similarity="cosine")
    assert build(tmp_path).meta.unit is True
    write_part(tmp_path, "s", "part-00009.parquet", range(900, 910),
               clustered(10, 8, seed=5, normalize=False) * 50)
    bump(tmp_path, "s", ["part-00009.parquet"], [], similarity="dot")
    before = read_meta(str(tmp_path), "s").token
    with pytest.raises(FingerprintError, match="metric ip, scaled to unit length\\) but set "
                                               "'s' now has .*metric ip, as stored.*--rebuild"):
        build(tmp_path)
    assert read_meta(str(tmp_path), "s").token == before
    rebuilt = build(tmp_path, rebuild=True).meta  # what the message says to do
    assert (rebuilt.unit, rebuilt.rows) == (False, 210)
