"""Set folders: metadata, fingerprint claims, parts, hashes, markers and removal records."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline import sets
from pipeline.errors import FingerprintError


def meta(name: str = "mean", fingerprint: str = "f1", id_type: str = "int64") -> sets.SetMeta:
    return sets.SetMeta(
        name=name, fingerprint=fingerprint, model="m", model_hash="h", encoder={},
        pooler={"strategy": "mean"}, dim=4, dtype="fp32", normalize=True, max_length=8,
        id_type=id_type,
    )


def test_claim_creates_then_accepts_the_same_fingerprint(tmp_path):
    out = str(tmp_path)
    assert sets.claim(out, meta()) == meta()
    assert sets.read_meta(out, "mean") == meta()
    stored = meta().model_copy(update={"generation": 3, "rows_written": 7})
    sets.write_meta(out, stored)
    assert sets.claim(out, meta()) == stored  # progress is kept
    assert sets.list_sets(out) == ["mean"]


def test_claim_refuses_another_fingerprint_or_id_type(tmp_path):
    out = str(tmp_path)
    sets.claim(out, meta())
    with pytest.raises(FingerprintError, match=r"set 'mean' .* fingerprint f1 .* makes f2"):
        sets.claim(out, meta(fingerprint="f2"))
    with pytest.raises(FingerprintError, match="stores int64 ids, the corpus has string"):
        sets.claim(out, meta(id_type="string"))


def test_claim_refuses_parts_without_metadata(tmp_path):
    sets.write_part(str(tmp_path), "mean", "s1", pa.array([1]), np.ones((1, 4), np.float32))
    with pytest.raises(FingerprintError, match="holds parts but no _SET.json"):
        sets.claim(str(tmp_path), meta())


def test_part_round_trip_keeps_id_type_and_fixed_size_vectors(tmp_path):
    vectors = np.arange(12, dtype=np.float32).reshape(3, 4)
    name = sets.write_part(str(tmp_path), "s", "shard-a", pa.array(["x", "y", "z"]), vectors)
    assert name == "part-shard-a.parquet"
    schema = pq.read_schema(tmp_path / "sets" / "s" / name)
    assert schema.field("embedding").type == pa.list_(pa.float32(), 4)
    assert schema.field("id").type == pa.string()
    ids, back = sets.read_part(str(tmp_path), "s", "shard-a")
    assert ids.to_pylist() == ["x", "y", "z"] and np.array_equal(back, vectors)


def test_hashes_carry_their_generation(tmp_path):
    out = str(tmp_path)
    assert sets.read_hashes(out, "s", "a")[2] == -1
    sets.write_hashes(out, "s", "a", pa.array([1, 2]), np.array([5, 6], np.uint64), generation=4)
    ids, hashes, generation = sets.read_hashes(out, "s", "a")
    assert ids.to_pylist() == [1, 2] and hashes.tolist() == [5, 6] and generation == 4


def test_removal_records_merge_across_attempts_and_clear(tmp_path):
    out = str(tmp_path)
    sets.record_removed(out, "s", 2, "a", [1, 2])
    sets.record_removed(out, "s", 2, "a", [2, 3])  # a rerun of the same generation
    sets.record_removed(out, "s", 2, "b", ["x"])
    sets.record_removed(out, "s", 3, "a", [9])
    sets.record_removed(out, "s", 3, "a", [])
    assert sets.removed_ids(out, "s", 2) == [1, 2, 3, "x"]
    sets.clear_removed(out, "s", 2)
    assert sets.removed_ids(out, "s", 2) == [] and sets.removed_ids(out, "s", 3) == [9]


def test_markers_round_trip_and_unreadable_ones_are_ignored(tmp_path):
    out = str(tmp_path)
    marker = sets.ShardMarker(shard="a", file="f", first_group=0, end_group=2, signature="x",
                              rows=5, skipped={"null_text": 1}, generation=1)
    sets.write_marker(out, "s", marker)
    (tmp_path / "sets" / "s" / "_done" / "b.json").write_text("{not json")
    assert sets.read_markers(out, "s") == {"a": marker}
    sets.remove_marker(out, "s", "a")
    assert sets.read_markers(out, "s") == {}


def test_changes_file_layout(tmp_path):
    sets.write_changes(str(tmp_path), "s", 7, ["part-b.parquet", "part-a.parquet"], [3])
    url = sets.changes_url(str(tmp_path), "s", 7)
    assert url.endswith("sets/s/_changes/000007.json")
    from pipeline import storage

    assert storage.read_json(url) == {
        "generation": 7, "parts": ["part-a.parquet", "part-b.parquet"], "deleted_ids": [3]
    }
