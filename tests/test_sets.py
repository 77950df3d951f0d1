"""Set folders: metadata, fingerprint claims, parts, hashes, markers, removal records, changes,
names read from disk, and the polars reader (local and on a real S3 API server)."""

from __future__ import annotations

import json
import string

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import storage
from pipeline.errors import EmbedpipeWarning, FingerprintError, StorageError
from pipeline.sets import SetFolder, SetMeta, ShardMarker, list_sets, scan_set


def meta(name: str = "mean", fingerprint: str = "f1", id_type: str = "int64",
         dim: int = 4) -> SetMeta:
    return SetMeta(
        name=name, fingerprint=fingerprint, model="m", model_hash="h", encoder={},
        pooler={"strategy": "mean"}, dim=dim, dtype="fp32", normalize=True, max_length=8,
        id_type=id_type,
    )


def test_claim_creates_then_accepts_the_same_fingerprint(tmp_path):
    folder = SetFolder(str(tmp_path), "mean")
    created = folder.claim(meta())
    assert created == meta().model_copy(update={"token": created.token}) and created.token
    assert folder.read_meta() == created == folder.meta()
    stored = created.model_copy(update={"generation": 3, "rows_written": 7})
    folder.write_meta(stored)
    assert folder.claim(meta()) == stored  # progress is kept, and the set's token
    assert list_sets(str(tmp_path)) == ["mean"]
    assert folder.meta().metric == "ip"


def test_claim_refuses_another_fingerprint_or_id_type(tmp_path):
    folder = SetFolder(str(tmp_path), "mean")
    folder.claim(meta())
    with pytest.raises(FingerprintError, match=r"set 'mean' .* fingerprint f1 .* makes f2"):
        folder.claim(meta(fingerprint="f2"))
    with pytest.raises(FingerprintError, match="stores int64 ids, the corpus has string"):
        folder.claim(meta(id_type="string"))


def test_a_set_made_again_under_its_name_gets_another_token(tmp_path):
    first = SetFolder(str(tmp_path), "mean").claim(meta())
    storage.remove(str(tmp_path / "sets" / "mean"), recursive=True)
    again = SetFolder(str(tmp_path), "mean").claim(meta())
    assert first.token and again.token and first.token != again.token
    assert first.generation == again.generation  # the token alone tells them apart


@pytest.mark.parametrize("id_type", ["float64", "no-such-type"])
def test_a_set_json_whose_id_type_is_not_one_is_one_line(tmp_path, id_type):
    """``id_type`` is read from disk: one that names no integer or text type is refused where
    ``_SET.json`` is read (an empty set's reader took it for strings)."""
    folder = SetFolder(str(tmp_path), "mean")
    folder.claim(meta())
    raw = json.loads((tmp_path / "sets" / "mean" / "_SET.json").read_text())
    (tmp_path / "sets" / "mean" / "_SET.json").write_text(json.dumps(raw | {"id_type": id_type}))
    with pytest.raises(StorageError) as raised:
        folder.read_meta()
    assert "\n" not in str(raised.value) and "id_type" in str(raised.value)


def test_claim_refuses_parts_without_metadata(tmp_path):
    folder = SetFolder(str(tmp_path), "mean")
    folder.write_part("s1", pa.array([1]), np.ones((1, 4), np.float32))
    with pytest.raises(FingerprintError, match="holds parts but no _SET.json"):
        folder.claim(meta())


def test_a_missing_set_names_the_sets_there(tmp_path):
    SetFolder(str(tmp_path), "mean").claim(meta())
    with pytest.raises(StorageError, match=r"no set 'cls' under .*sets there: mean\)"):
        SetFolder(str(tmp_path), "cls").meta()


def test_part_round_trip_keeps_id_type_and_fixed_size_vectors(tmp_path):
    folder = SetFolder(str(tmp_path), "s")
    vectors = np.arange(12, dtype=np.float32).reshape(3, 4)
    name = folder.write_part("shard-a", pa.array(["x", "y", "z"]), vectors)
    assert name == "part-shard-a.parquet" and folder.has_part("shard-a")
    schema = pq.read_schema(tmp_path / "sets" / "s" / name)
    assert schema.field("embedding").type == pa.list_(pa.float32(), 4)
    assert schema.field("id").type == pa.string()
    ids, back = folder.read_part("shard-a")
    assert ids.to_pylist() == ["x", "y", "z"] and np.array_equal(back, vectors)
    assert folder.part_urls() == [] and folder.unmarked_shards() == {"shard-a"}  # not done
    folder.write_marker(ShardMarker(shard="shard-a", file="a.parquet", first_group=0,
                                    end_group=1, signature="s", rows=3, generation=1))
    assert folder.part_urls() == [folder.part_url("shard-a")] and not folder.unmarked_shards()
    folder.remove_part("shard-a")  # its marker left: readers would silently lack its rows
    with pytest.raises(StorageError, match="part-shard-a.parquet: missing or not a file, "
                                           "though shard shard-a is done with 3 rows"):
        folder.part_urls()
    folder.remove_marker("shard-a")
    assert not folder.has_part("shard-a") and folder.part_urls() == []


def test_hashes_carry_their_generation_and_their_vectors(tmp_path):
    folder = SetFolder(str(tmp_path), "s")
    assert folder.read_hashes("a", pa.int64()).generation == -1
    folder.write_hashes("a", pa.array([1, 2]), np.array([5, 6], np.uint64), generation=4)
    ids, hashes, generation, born = folder.read_hashes("a", pa.int64())
    assert ids.to_pylist() == [1, 2] and hashes.tolist() == [5, 6] and generation == 4
    assert born.tolist() == [4, 4]  # every vector made by the writing generation
    folder.write_hashes("a", pa.array([1, 2]), np.array([5, 6], np.uint64), 4, np.array([2, 4]))
    assert folder.read_hashes("a", pa.int64()).born.tolist() == [2, 4]  # one from generation 2


def test_a_vectors_generation_the_hashes_cannot_hold_is_the_writers(tmp_path):
    """A hashes file from before ``born`` was kept, or one whose ``born`` names a generation
    after its writer's: every row counts as made by the writer (the index re-adds them)."""
    folder = SetFolder(str(tmp_path), "s")
    url = tmp_path / "sets" / "s" / "_hashes" / "a.parquet"
    url.parent.mkdir(parents=True)
    keys = {"id": [1, 2], "hash": pa.array([5, 6], pa.uint64())}
    for extra in ({}, {"born": pa.array([1, 9], pa.int64())}, {"born": [-1, 1]},
                  {"born": pa.array(["1", "2"])}):
        pq.write_table(pa.table(keys | extra).replace_schema_metadata({"generation": "3"}), url)
        assert folder.read_hashes("a", pa.int64()).born.tolist() == [3, 3], extra
    pq.write_table(pa.table(keys).replace_schema_metadata({"generation": "x"}), url)
    with pytest.raises(StorageError, match="a.parquet: its generation is not a number"):
        folder.read_hashes("a", pa.int64())
    for table in (pa.table({"id": [1]}), pa.table({"id": [1], "hash": [-5]})):
        pq.write_table(table, url)
        with pytest.raises(StorageError, match="a.parquet: not a hashes file"):
            folder.read_hashes("a", pa.int64())
    for ids in (["1", "2"], pa.array([1, 2], pa.int32())):  # joined to the run's int64 ids
        pq.write_table(pa.table({"id": ids, "hash": keys["hash"]}), url)
        with pytest.raises(StorageError, match="a.parquet: its ids are (string|int32), not "
                                               "the set's int64"):
            folder.read_hashes("a", pa.int64())


def test_removal_records_merge_across_attempts_and_clear(tmp_path):
    folder, int64 = SetFolder(str(tmp_path), "s"), pa.int64()
    folder.record_removed(2, "a", pa.array([1, 2]))
    folder.record_removed(2, "a", pa.array([2, 3]))  # a rerun of the same generation
    folder.record_removed(2, "b", pa.array([7]))
    folder.record_removed(3, "a", pa.array([9]))
    folder.record_removed(3, "a", pa.array([], int64))
    assert folder.removed_ids(2, int64) == [1, 2, 3, 7]
    folder.clear_removed(2)
    assert folder.removed_ids(2, int64) == [] and folder.removed_ids(3, int64) == [9]


@pytest.mark.parametrize("ids, id_type", [
    (["7"], "int64"), ([1.5], "int64"), ([True], "int64"), ([[1]], "int64"), ([None], "int64"),
    ([2**63], "int64"), ([2**64], "uint64"), ([-1], "uint64"), ([3], "string"),
    ([1, "a"], "string"),
])
def test_tampered_ids_in_removal_records_and_changes_files_are_one_line(tmp_path, ids,
                                                                         id_type):
    """They were trusted: a string id in an int64 set's removal record went on into its
    changes file, where every index catch-up failed on it (a pyarrow traceback) until a
    rebuild; a float was truncated to another row's id; a list was a TypeError."""
    folder, kind = SetFolder(str(tmp_path), "s"), pa.type_for_alias(id_type)
    removal = tmp_path / "sets" / "s" / "_removed" / "000002-a.json"
    removal.parent.mkdir(parents=True)
    removal.write_text(json.dumps({"generation": 2, "ids": ids}))
    folder.write_changes(2, [], [])
    changes = tmp_path / "sets" / "s" / "_changes" / "000002.json"
    changes.write_text(json.dumps({"generation": 2, "parts": [], "deleted_ids": ids}))
    for read, url in ((lambda: folder.removed_ids(2, kind), removal),
                      (lambda: folder.read_changes(2, kind), changes)):
        with pytest.raises(StorageError) as caught:
            read()
        message = str(caught.value)
        assert message.startswith(f"{url}: its ids are not") and "\n" not in message


@pytest.mark.parametrize("body, reason", [
    ("[7]", "not a removal record"),
    ('{"ids": [' + "9" * 5000 + "]}", "is not valid JSON: Exceeds the limit"),
    ("[" * 100_000 + "]" * 100_000, "is not valid JSON"),
    ('{"ids": ["\\ud800"]}', "its ids are not the set's string"),
], ids=["a-list", "a-huge-int", "deep", "a-surrogate"])
def test_removal_records_json_cannot_parse_to_ids_are_one_line(tmp_path, body, reason):
    """Each was a traceback (found by an adversarial review): a record that is a JSON list
    (AttributeError), an int of 5,000 digits (ValueError), nesting past the recursion limit,
    a lone surrogate in a string id (UnicodeEncodeError)."""
    removal = tmp_path / "sets" / "s" / "_removed" / "000002-a.json"
    removal.parent.mkdir(parents=True)
    removal.write_text(body)
    with pytest.raises(StorageError) as caught:
        SetFolder(str(tmp_path), "s").removed_ids(2, pa.string())
    assert reason in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("ids", [{"a": 1}, "12", None])
def test_a_removal_record_whose_ids_are_no_list_is_one_line(tmp_path, ids):
    removal = tmp_path / "sets" / "s" / "_removed" / "000002-a.json"
    removal.parent.mkdir(parents=True)
    removal.write_text(json.dumps({"generation": 2, "ids": ids}))
    with pytest.raises(StorageError, match=f"^{removal}: its ids are not a list; restore "
                                           "it, or remove it and rebuild the index"):
        SetFolder(str(tmp_path), "s").removed_ids(2, pa.int64())


def test_ids_of_the_sets_type_are_read_back_as_written(tmp_path):
    folder = SetFolder(str(tmp_path), "s")
    for kind, ids in ((pa.uint64(), [2**64 - 1, 0]), (pa.string(), ["a", "7"]),
                      (pa.int32(), [-5, 2**31 - 1])):
        folder.write_changes(2, [], ids)
        assert folder.read_changes(2, kind).deleted_ids == ids


def test_markers_round_trip_and_unreadable_ones_are_ignored(tmp_path):
    folder = SetFolder(str(tmp_path), "s")
    marker = ShardMarker(shard="a", file="f", first_group=0, end_group=2, signature="x",
                         rows=5, skipped={"null_text": 1}, generation=1)
    folder.write_marker(marker)
    (tmp_path / "sets" / "s" / "_done" / "b.json").write_text("{not json")
    assert folder.read_markers() == {"a": marker}
    folder.remove_marker("a")
    assert folder.read_markers() == {}


@pytest.mark.parametrize("change", [{"rows": -1}, {"rows": 2**60}, {"skipped": {"x": -3}},
                                    {"generation": -2}, {"first_group": -1}])
def test_a_marker_counting_impossible_rows_is_not_one(tmp_path, change):
    """A tampered marker's count went into _SET.json's rows_written and every summary (a
    negative or 2**60 rows); now it is no marker, so its shard is redone."""
    folder = SetFolder(str(tmp_path), "s")
    marker = ShardMarker(shard="a", file="f", first_group=0, end_group=2, signature="x",
                         rows=5, generation=1)
    folder.write_marker(marker)
    url = tmp_path / "sets" / "s" / "_done" / "a.json"
    url.write_text(json.dumps(json.loads(url.read_text()) | change))
    assert folder.read_markers() == {}


def test_a_marker_the_store_fails_to_read_is_an_error_not_a_missing_shard(tmp_path,
                                                                           monkeypatch):
    folder = SetFolder(str(tmp_path), "s")
    folder.write_marker(ShardMarker(shard="a", file="f", first_group=0, end_group=2,
                                    signature="x", rows=5, generation=1))
    real = storage.open_file

    def failing(url: str):
        if url.endswith("/_done/a.json"):
            raise ConnectionResetError("connection reset by peer")
        return real(url)

    monkeypatch.setattr(storage, "open_file", failing)
    with pytest.raises(StorageError, match=r"_done/a.json.*connection reset"):
        folder.read_markers()


def test_a_sets_markers_on_s3_are_read_at_once_one_get_each(s3_server, s3_bucket):
    """A rerun with nothing to do reads every done marker of every set, twice: on S3 each was
    a HEAD and a GET, one after another (40 shards x 2 sets at 20 ms a request: 11.8 s for the
    rerun, 4.3 s now); now one GET each, at once."""
    folder = SetFolder(f"s3://{s3_bucket}/out", "s")
    markers = {sid: ShardMarker(shard=sid, file="f", first_group=0, end_group=1,
                                signature="x", rows=5, generation=1)
               for sid in (f"g0-{i}" for i in range(12))}
    for marker in markers.values():
        folder.write_marker(marker)
    faults = s3_server.faults
    faults.reads.clear()
    with faults.slow_reads(0.05):
        assert folder.read_markers() == markers
    done = f"{s3_bucket}/out/sets/s/_done/"
    assert sorted(read for read in faults.reads if read[1].startswith(done)) == \
        sorted(("GET", f"{done}{sid}.json") for sid in markers)
    assert faults.reads_at_once > 1


@pytest.mark.parametrize("where", ["local", "s3"])
def test_files_read_at_once_are_none_where_removed_since_listed(where, tmp_path, request):
    base = f"s3://{request.getfixturevalue('s3_bucket')}" if where == "s3" else str(tmp_path)
    there, gone = f"{base}/a.json", f"{base}/b.json"
    storage.write_bytes(there, b"{}")
    assert storage.read_files([there, gone, there]) == [b"{}", None, b"{}"]
    assert storage.read_files([]) == []


def test_changes_file_layout(tmp_path):
    folder = SetFolder(str(tmp_path), "s")
    folder.write_changes(7, ["part-b.parquet", "part-a.parquet"], [3])
    url = folder.changes_url(7)
    assert url.endswith("sets/s/_changes/000007.json")
    assert storage.read_json(url) == {
        "generation": 7, "parts": ["part-a.parquet", "part-b.parquet"], "deleted_ids": [3]
    }
    changes = folder.read_changes(7, pa.int64())
    assert changes.parts == ["part-a.parquet", "part-b.parquet"] and changes.deleted_ids == [3]
    assert folder.read_changes(8, pa.int64()) is None


# ---- names read from disk are validated before they become paths --------------------------


@pytest.mark.parametrize("name", ["../x", "..", "a/b", ".hidden", "s3://b/x", "", "a\nb"])
def test_a_set_name_that_could_leave_sets_is_refused(tmp_path, name):
    with pytest.raises(StorageError, match="invalid set name"):
        SetFolder(str(tmp_path), name)


def test_set_json_naming_another_set_is_refused_everywhere(tmp_path):
    folder = SetFolder(str(tmp_path), "mean")
    folder.claim(meta())
    payload = json.loads((tmp_path / "sets" / "mean" / "_SET.json").read_text())
    (tmp_path / "sets" / "mean" / "_SET.json").write_text(json.dumps(payload | {"name": "../../x"}))
    for read in (folder.read_meta, folder.meta, lambda: list_sets(str(tmp_path))):
        with pytest.raises(StorageError, match=r"names set '\.\./\.\./x', not 'mean'"):
            read()
    with pytest.raises(StorageError, match="cannot go into"):
        folder.write_meta(meta(name="cls"))


def test_a_folder_under_sets_with_a_bad_name_is_refused(tmp_path):
    SetFolder(str(tmp_path), "mean").claim(meta())
    (tmp_path / "sets" / "bad name").mkdir()
    with pytest.raises(StorageError, match="invalid set name 'bad name'"):
        list_sets(str(tmp_path))


def test_list_sets_skips_files_and_folders_without_metadata(tmp_path):
    SetFolder(str(tmp_path), "mean").claim(meta())
    (tmp_path / "sets" / "empty").mkdir()
    (tmp_path / "sets" / "stray.json").write_text("{}")
    assert list_sets(str(tmp_path)) == ["mean"]


def test_a_marker_naming_a_traversal_shard_is_refused(tmp_path):
    folder = SetFolder(str(tmp_path), "s")
    good = ShardMarker(shard="a", file="f", first_group=0, end_group=1, signature="x", rows=1,
                       generation=1)
    folder.write_marker(good)
    evil = good.model_copy(update={"shard": "../../evil"}).model_dump()
    (tmp_path / "sets" / "s" / "_done" / "b.json").write_text(json.dumps(evil))
    with pytest.raises(StorageError, match=r"invalid file name '\.\./\.\./evil'"):
        folder.read_markers()
    with pytest.raises(StorageError, match="invalid file name"):
        folder.write_marker(good.model_copy(update={"shard": "../x"}))


def test_a_changes_file_naming_a_path_outside_the_set_is_refused(tmp_path):
    folder = SetFolder(str(tmp_path), "s")
    folder.write_changes(1, ["part-a.parquet"], [])
    body = {"generation": 2, "parts": ["../x.parquet"], "deleted_ids": []}
    (tmp_path / "sets" / "s" / "_changes" / "000002.json").write_text(json.dumps(body))
    assert folder.read_changes(1, pa.int64()).parts == ["part-a.parquet"]
    with pytest.raises(StorageError, match=r"invalid file name '\.\./x\.parquet'"):
        folder.read_changes(2, pa.int64())
    with pytest.raises(StorageError, match="invalid file name"):
        folder.write_changes(3, ["../y.parquet"], [])
    (tmp_path / "sets" / "s" / "_changes" / "000004.json").write_text('{"parts": 3}')
    with pytest.raises(StorageError, match="is not a changes file"):
        folder.read_changes(4, pa.int64())


def test_a_removal_record_with_a_foreign_name_is_refused(tmp_path):
    folder = SetFolder(str(tmp_path), "s")
    folder.record_removed(1, "a", pa.array([1]))
    (tmp_path / "sets" / "s" / "_removed" / "nodash.json").write_text('{"ids": [2]}')
    with pytest.raises(StorageError, match="not a removal record name"):
        folder.removed_ids(1, pa.int64())


# ---- invariants ------------------------------------------------------------------------------

SHARD = st.text(string.ascii_letters + string.digits + "_.=-", min_size=1, max_size=40).filter(
    lambda s: s[0] not in ".=-"
)
ANY_TEXT = st.text(min_size=0, max_size=30)


@settings(max_examples=300, deadline=None)
@given(name=ANY_TEXT, shard=ANY_TEXT)
def test_every_accepted_name_stays_inside_its_folder(name, shard):
    """Whatever a file says, a path built from it is directly inside the set's folder."""
    out = "/data/out"
    try:
        folder = SetFolder(out, name)
    except StorageError:
        return
    assert folder.url == f"{out}/sets/{name}" and "/" not in name and not name.startswith(".")
    for build in (folder.part_url, folder.changes_url):
        try:
            url = build(shard) if build is folder.part_url else build(len(shard))
        except StorageError:
            continue
        assert url.startswith(folder.url + "/") and ".." not in url[len(folder.url):].split("/")


@settings(max_examples=25, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(1, 3), SHARD, st.lists(st.integers(0, 20), max_size=5)),
                    max_size=8),
       up_to=st.integers(0, 3))
def test_removal_records_equal_a_model_of_them(tmp_path_factory, ops, up_to):
    """record_removed / removed_ids / clear_removed behave like a dict of ordered id sets."""
    folder = SetFolder(str(tmp_path_factory.mktemp("out")), "s")
    model: dict[int, dict[str, list]] = {}
    for generation, shard, ids in ops:
        folder.record_removed(generation, shard, pa.array(ids, pa.int64()))
        if ids:
            kept = model.setdefault(generation, {}).setdefault(shard, [])
            kept[:] = list(dict.fromkeys(kept + ids))
    for g in (1, 2, 3):
        expected = [i for shard in sorted(model.get(g, {})) for i in model[g][shard]]
        assert folder.removed_ids(g, pa.int64()) == list(dict.fromkeys(expected))
    folder.clear_removed(up_to)
    for g in (1, 2, 3):
        assert (folder.removed_ids(g, pa.int64()) == []) == (g <= up_to or g not in model)


# ---- polars reader ---------------------------------------------------------------------------


def _write_two_parts(out: str) -> tuple[list, np.ndarray]:
    folder = SetFolder(out, "mean")
    folder.claim(meta(id_type="int64", dim=3))
    vectors = np.arange(15, dtype=np.float32).reshape(5, 3)
    for shard, rows in (("a", slice(0, 3)), ("b", slice(3, 5))):
        ids = pa.array([1, 2, 3, 4, 5][rows])
        folder.write_part(shard, ids, vectors[rows])
        folder.write_marker(ShardMarker(shard=shard, file="a.parquet", first_group=0,
                                        end_group=1, signature="s", rows=len(ids),
                                        generation=1))
    folder.write_hashes("a", pa.array([1, 2, 3]), np.arange(3, dtype=np.uint64), 1)
    folder.write_changes(1, ["part-a.parquet", "part-b.parquet"], [])
    # as the run's end records it (pipeline.run.finalize): read_set refuses an unfinished set
    folder.write_meta(folder.meta().model_copy(
        update={"shards_done": 2, "rows_written": 5, "generation": 1}))
    return [1, 2, 3, 4, 5], vectors


def _check_scan(out: str, ids: list, vectors: np.ndarray) -> None:
    frame = scan_set(out, "mean")
    assert isinstance(frame, pl.LazyFrame)
    got = frame.sort("id").collect()
    assert got.columns == ["id", "embedding"]  # only parts: not hashes, markers or changes
    assert got["id"].to_list() == ids
    assert got.schema["embedding"] == pl.Array(pl.Float32, 3)
    assert np.array_equal(got["embedding"].to_numpy(), vectors)
    assert scan_set(out, "mean").filter(pl.col("id") > 3).collect().height == 2


@pytest.mark.parametrize("folder", ["out", "run [1]", "run[ab]", "x?y*"])
def test_scan_set_round_trips_a_local_set(tmp_path, folder):
    out = str(tmp_path / folder)  # the parts' paths are names, not glob patterns
    ids, vectors = _write_two_parts(out)
    _check_scan(out, ids, vectors)


def test_scan_set_of_a_set_without_parts_is_empty_with_the_set_schema(tmp_path):
    SetFolder(str(tmp_path), "mean").claim(meta(id_type="int64", dim=3))
    got = scan_set(str(tmp_path), "mean").collect()
    assert got.height == 0 and got.schema == {"id": pl.Int64, "embedding": pl.Array(pl.Float32, 3)}


def test_scan_set_on_s3_takes_credentials_from_a_profile_as_s3fs_does(s3_bucket, tmp_path,
                                                                       monkeypatch):
    from _s3 import TEST_KEY, TEST_SECRET

    out = f"s3://{s3_bucket}/out"
    ids, vectors = _write_two_parts(out)
    credentials = tmp_path / "credentials"
    credentials.write_text(f"[dev]\naws_access_key_id = {TEST_KEY}\n"
                           f"aws_secret_access_key = {TEST_SECRET}\n")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_PROFILE", "dev")
    _check_scan(out, ids, vectors)


def test_scan_set_round_trips_a_set_on_s3(s3_bucket):
    out = f"s3://{s3_bucket}/out"
    ids, vectors = _write_two_parts(out)
    _check_scan(out, ids, vectors)
    with pytest.raises(StorageError, match="no set 'cls'"):
        scan_set(out, "cls")


def test_read_set_is_a_snapshot_of_the_checked_rows(tmp_path):
    """The frame was checked at the call and read at collect: a part removed or rewritten
    in between failed polars' own way, or gave rows no check had seen."""
    out = str(tmp_path / "out")
    ids, vectors = _write_two_parts(out)
    frame = scan_set(out, "mean")
    storage.remove(SetFolder(out, "mean").part_url("b"))
    got = frame.sort("id").collect()
    assert got["id"].to_list() == ids
    assert np.array_equal(got["embedding"].to_numpy(), vectors)


def test_read_set_refuses_a_set_a_writer_is_rewriting(tmp_path):
    """A run removes a shard's marker before it rewrites the part: the set read without
    the shard's rows, and no word of it."""
    from pipeline.lease import writer_lease

    out = str(tmp_path / "out")
    _write_two_parts(out)
    folder = SetFolder(out, "mean")
    with writer_lease(out, "embed"):
        folder.remove_marker("b")  # as pipeline.job's _write_set does first
        with pytest.raises(StorageError, match=r"set 'mean' in .* is being written by 'embed' "
                                               r".*: its parts do not make the set until that "
                                               r"run ends; read it then"):
            scan_set(out, "mean")
    # the run stopped there and let OUT go: what it left, said to be unfinished
    with pytest.warns(EmbedpipeWarning, match=r"the last run that wrote to it did not finish"):
        assert scan_set(out, "mean").collect()["id"].to_list() == [1, 2, 3]


def test_read_set_of_a_part_replaced_while_it_is_read_says_a_run_began(tmp_path, monkeypatch):
    """Each part's footer was read, then the part opened again with it: a part replaced in
    between was read with the old file's offsets (Arrow's 'Unexpected end of stream')."""
    out = str(tmp_path / "out")
    _write_two_parts(out)
    folder = SetFolder(out, "mean")
    listed = SetFolder.part_urls

    def then_a_run_rewrites_b(self, markers=None):
        urls = listed(self, markers)
        marker = folder.read_marker("b")
        folder.remove_marker("b")
        folder.write_part("b", pa.array([4, 5, 6]), np.ones((3, 3), np.float32))
        folder.write_marker(marker.model_copy(update={"rows": 3, "generation": 2}))
        return urls

    monkeypatch.setattr(SetFolder, "part_urls", then_a_run_rewrites_b)
    with pytest.raises(StorageError, match=r"is being written by a run that began while it was "
                                           r"read"):
        scan_set(out, "mean")
