"""Index builds on real Parquet sets and real FAISS indexes: known answers, recall, kinds."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from _index_sets import bump, clustered, exact_top, meta, write_meta, write_part, write_set
from _s3 import upload_dir

from pipeline import storage
from pipeline.errors import ConfigError, FingerprintError, StorageError
from pipeline.index import IndexRequest, index_set, open_index, read_meta, store
from pipeline.index import plan as plan_module
from pipeline.index.handle import hnsw_of, ivf_of
from pipeline.index.tune import EF_SEARCH


def build(out: Path, name: str = "s", **kw):
    return index_set(IndexRequest(out=str(out), set_name=name, **kw), say=lambda _: None)


def test_flat_returns_the_known_nearest_neighbours(tmp_path):
    x = clustered(600, 16, seed=1)
    ids = [f"doc-{i}" for i in range(len(x))]
    write_set(tmp_path, "s", ids, x, parts=3, row_group=128)
    result = build(tmp_path)
    m = result.meta
    assert (result.action, m.kind, m.metric, m.dim, m.rows) == ("built", "flat", "ip", 16, 600)
    assert m.recall_at_10 == 1.0 and m.fingerprint == "fp-test" and m.generation == 1
    on_disk = json.loads((tmp_path / "index" / "s" / "_INDEX.json").read_text())
    assert on_disk["kind"] == "flat" and on_disk["recall_at_10"] == 1.0
    handle = open_index(str(tmp_path), m)
    queries = clustered(40, 16, seed=2)
    want = exact_top(x, queries, 5)
    got = handle.search(queries, 5)
    assert [[i for i, _ in row] for row in got] == [[ids[j] for j in row] for row in want]
    top = handle.search(x[:10], 1)
    assert [row[0][0] for row in top] == ids[:10]
    assert all(abs(row[0][1] - 1.0) < 1e-5 for row in top)  # cosine with itself


def test_l2_sets_with_integer_ids(tmp_path):
    x = clustered(300, 8, seed=3, normalize=False) * 10
    ids = list(range(1000, 1300))
    write_set(tmp_path, "raw", ids, x, normalize=False)
    m = build(tmp_path, "raw").meta
    assert m.metric == "l2"
    queries = clustered(20, 8, seed=4, normalize=False) * 10
    got = open_index(str(tmp_path), m).search(queries, 3)
    want = exact_top(x, queries, 3, metric="l2")
    assert [[i for i, _ in row] for row in got] == [[ids[j] for j in row] for row in want]


@pytest.mark.parametrize("kind", ["hnsw", "ivf", "ivfsq"])
def test_approximate_kinds_reach_the_recall_target(tmp_path, kind):
    x = clustered(6000, 16, seed=5, clusters=32)
    ids = [f"d{i}" for i in range(len(x))]
    write_set(tmp_path, "s", ids, x, parts=2)
    m = build(tmp_path, kind=kind, queries=300).meta
    assert m.kind == kind and m.recall_at_10 >= 0.95 and m.recall_queries == 300
    assert m.params and set(m.params) <= {"nprobe", "efSearch"}
    assert m.tuning[-1]["recall_at_10"] >= 0.95
    # An independent check: fresh queries near the data, exact answers from numpy.
    queries = x[:200] + 0.05 * np.random.default_rng(6).standard_normal((200, 16)).astype("f4")
    got = open_index(str(tmp_path), m).search(queries, 10)
    want = exact_top(x, queries, 10)
    recall = np.mean([len({i for i, _ in g} & {ids[j] for j in w}) / 10
                      for g, w in zip(got, want, strict=True)])
    assert recall >= 0.9


def test_any_faiss_factory_string(tmp_path):
    x = clustered(3000, 16, seed=7)
    write_set(tmp_path, "s", [f"d{i}" for i in range(len(x))], x)
    m = build(tmp_path, kind="IVF32,SQ8").meta
    assert (m.kind, m.factory) == ("factory", "IVF32,SQ8")
    assert "nprobe" in m.params and m.recall_at_10 >= 0.95
    with pytest.raises(ConfigError, match="FAISS cannot build index 'NotAnIndex'"):
        build(tmp_path, kind="NotAnIndex", rebuild=True)
    # and before any orchestration (the flow's task read the set and failed in Prefect's log)
    from pipeline.index import index_targets

    assert index_targets(str(tmp_path), None, "IVF32,SQ8", "4GB", 0) == ["s"]
    for name in ("s", None):
        with pytest.raises(ConfigError, match="FAISS cannot build index 'zzz' for dim 16"):
            index_targets(str(tmp_path), name, "zzz", "4GB", 0)


@pytest.mark.parametrize(("factory", "says"), [
    ("IVF4096,Flat", "index 'IVF4096,Flat' has 4,096 lists: training needs at least as many "
                     "rows (39 per list for good ones), it has 3,000 of the set's 3,000; use "
                     "fewer lists or --kind auto"),
    ("PQ4x12", "index 'PQ4x12' has codebooks of 4,096 centroids: training them needs 159,744 "
               "rows (39 per centroid), it has 3,000 of the set's 3,000; use fewer bits per code "
               "(PQ4x6), another kind, or --kind auto"),
    # FAISS trained it after a warning per codebook, to a recall under the target
    ("IVF1,PQ8x8", "index 'IVF1,PQ8x8' has codebooks of 256 centroids: training them needs "
                   "9,984 rows (39 per centroid), it has 3,000 of the set's 3,000; use fewer "
                   "bits per code (PQ8x6), another kind, or --kind auto"),
])
def test_a_factory_its_rows_cannot_train_is_one_line(tmp_path, factory, says):
    """It was FAISS's traceback (after its warnings)."""
    x = clustered(3000, 16, seed=7)
    write_set(tmp_path, "s", [f"d{i}" for i in range(len(x))], x)
    with pytest.raises(ConfigError) as raised:
        build(tmp_path, kind=factory)
    assert str(raised.value) == says


@pytest.mark.parametrize(("factory", "says"), [
    ("IDMap,Flat", "add does not make sense with IndexIDMap, use add_with_ids"),
    ("NSG16,Flat", "NNDescent.build cannot build a graph smaller than 100"),
])
def test_a_factory_that_cannot_take_our_rows_is_one_line(tmp_path, factory, says):
    """A factory with its own id map, or one that cannot add these rows: FAISS's multi-line
    error with its C++ location was raised as it was."""
    x = clustered(300, 16, seed=7)
    write_set(tmp_path, "s", [f"d{i}" for i in range(len(x))], x)
    with pytest.raises(ConfigError) as raised:
        build(tmp_path, kind=factory)
    assert str(raised.value) == (f"FAISS cannot add rows to index {factory!r}: {says}; use "
                                 "another --kind")


def test_auto_picks_the_kind_by_size_and_budget(tmp_path, monkeypatch):
    monkeypatch.setattr(plan_module, "FLAT_MAX_ROWS", 1_000)
    monkeypatch.setattr(plan_module, "HNSW_MAX_ROWS", 3_000)
    x = clustered(8_000, 16, seed=8)
    chosen = {}
    for rows, budget in [(800, "1GB"), (2_500, "1GB"), (8_000, "1GB"), (8_000, "2.7MB")]:
        out = tmp_path / f"{rows}-{budget}"
        write_set(out, "s", [f"d{i}" for i in range(rows)], x[:rows])
        m = build(out, memory_budget=budget).meta
        chosen[(rows, budget)] = m.kind
        assert m.recall_at_10 >= 0.95 and m.memory_estimate <= m.memory_budget
    assert chosen == {(800, "1GB"): "flat", (2_500, "1GB"): "hnsw", (8_000, "1GB"): "ivf",
                      (8_000, "2.7MB"): "ivfsq"}


@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
def test_catch_up_adds_rewrites_and_deletes_without_rebuild(tmp_path, kind):
    x = clustered(4_000, 16, seed=9)
    ids = [f"d{i}" for i in range(3_000)]
    parts = write_set(tmp_path, "s", ids, x[:3_000], parts=4)  # 750 rows each
    first = build(tmp_path, kind=kind).meta
    # Run 2: part 1 (d750..d1499) is rewritten: d750..d849 deleted, d850..d949 get new
    # vectors; part 4 is new (d3000..d3999).
    p1_ids = [f"d{i}" for i in range(850, 1_500)]
    p1_vec = x[850:1_500].copy()
    p1_vec[:100] = clustered(100, 16, seed=10)
    write_part(tmp_path, "s", parts[1], p1_ids, p1_vec)
    new_ids = [f"d{i}" for i in range(3_000, 4_000)]
    write_part(tmp_path, "s", "part-00004.parquet", new_ids, x[3_000:])
    deleted = [f"d{i}" for i in range(750, 850)]

    bump(tmp_path, "s", [parts[1], "part-00004.parquet"], deleted)
    result = build(tmp_path, kind="auto")
    m = result.meta
    assert result.action == "caught up" and m.mode == "catch-up" and m.generation == 2
    assert m.kind == first.kind and m.rows == 3_900
    handle = open_index(str(tmp_path), m)
    assert set(handle.idmap.ids.to_pylist()) == set(ids[:750] + p1_ids + ids[1_500:] + new_ids)
    if kind == "hnsw":  # HNSW cannot delete: the 750 old rows of part 1 are masked
        assert m.masked == 750 and m.ntotal == 4_650
    else:
        assert m.masked == 0 and m.ntotal == 3_900
    found = handle.search(np.vstack([x[3_000:3_020], p1_vec[:20]]), 1)
    assert [r[0][0] for r in found] == new_ids[:20] + p1_ids[:20]
    gone = {i for row in handle.search(x[750:950], 10) for i, _ in row}
    assert not gone & set(deleted)
    assert build(tmp_path).action == "up to date"


def test_missing_changes_file_or_rebuild_flag_means_a_full_build(tmp_path):
    x = clustered(1_000, 8, seed=11)
    parts = write_set(tmp_path, "s", [f"d{i}" for i in range(1_000)], x)
    build(tmp_path)
    write_part(tmp_path, "s", parts[0], [f"n{i}" for i in range(10)], x[:10])

    generation = bump(tmp_path, "s", [parts[0]], [])
    (tmp_path / "sets" / "s" / "_changes" / f"{generation:06d}.json").unlink()
    result = build(tmp_path)
    assert (result.action, result.reason, result.meta.mode) == (
        "built", "a changes file is missing", "full")
    assert build(tmp_path, rebuild=True).reason == "asked to rebuild"


@pytest.mark.parametrize("asked", ["hnsw", "IVF4,Flat"])
def test_a_full_build_in_place_of_a_catch_up_keeps_the_kind_the_index_was_built_for(
        tmp_path, asked):
    """A catch-up that falls back to a full build (a changes file lost, too many masked
    rows) asks again for the kind the index was built for, not for auto's: a small set built
    --kind hnsw became flat (found by a review). An index built auto chooses again."""
    x = clustered(1_000, 8, seed=12)
    parts = write_set(tmp_path, "s", [f"d{i}" for i in range(1_000)], x, parts=2)
    first = build(tmp_path, kind=asked).meta
    assert first.asked_kind == asked and first.kind in ("hnsw", "factory")
    write_part(tmp_path, "s", parts[0], [f"n{i}" for i in range(10)], x[:10])
    generation = bump(tmp_path, "s", [parts[0]], [])
    (tmp_path / "sets" / "s" / "_changes" / f"{generation:06d}.json").unlink()
    result = build(tmp_path)  # --kind auto, as a nightly run's catch-up asks
    assert (result.action, result.reason) == ("built", "a changes file is missing")
    assert (result.meta.kind, result.meta.factory) == (first.kind, first.factory)
    rebuilt = build(tmp_path, rebuild=True).meta  # --rebuild chooses again
    assert (rebuilt.kind, rebuilt.asked_kind) == ("flat", "auto")


def test_an_asked_kind_that_is_no_kind_is_refused_from_index_json(tmp_path):
    write_set(tmp_path, "s", list(range(200)), clustered(200, 8, seed=13))
    build(tmp_path, kind="hnsw")
    marker = tmp_path / "index" / "s" / "_INDEX.json"
    marker.write_text(json.dumps(json.loads(marker.read_text()) | {"asked_kind": "IVF999999,PQ1"}))
    with pytest.raises(StorageError, match=r"asked_kind 'IVF999999,PQ1' is neither auto"):
        read_meta(str(tmp_path), "s")


def test_index_refuses_a_set_of_another_fingerprint_or_dimension(tmp_path):
    x = clustered(500, 8, seed=12)
    parts = write_set(tmp_path, "s", [f"d{i}" for i in range(500)], x)
    token = build(tmp_path).meta.set_token
    write_meta(tmp_path, "s", meta("s", 8, fingerprint="fp-other", generation=2, token=token,
                                   id_type="string"))
    with pytest.raises(FingerprintError, match=r"fp-test .* now has fp-other.*--rebuild"):
        build(tmp_path)
    write_part(tmp_path, "s", parts[0], ["x"], np.ones((1, 4), "f4"))
    with pytest.raises(FingerprintError, match=r"part-00000.parquet holds 4-dim vectors .* dim 8"):
        build(tmp_path, rebuild=True)


def test_duplicate_ids_across_parts_are_refused(tmp_path):
    x = clustered(100, 8, seed=13)
    write_set(tmp_path, "s", [f"d{i % 60}" for i in range(100)], x, parts=2)
    with pytest.raises(StorageError, match=r"holds ids more than once \(e.g. \['d"):
        build(tmp_path)


def test_missing_set_and_empty_set_are_explained(tmp_path):
    with pytest.raises(StorageError, match=r"no set 'nope' under .*sets \(sets there: none\)"):
        build(tmp_path, "nope")
    write_set(tmp_path, "empty", [], np.zeros((0, 8), "f4"), parts=1)
    with pytest.raises(StorageError, match="has no rows to index"):
        build(tmp_path, "empty")


def test_publish_is_versioned_and_a_reader_of_the_previous_version_still_loads(tmp_path):
    x = clustered(400, 8, seed=14)
    write_set(tmp_path, "s", [f"d{i}" for i in range(400)], x)
    first = build(tmp_path).meta
    second = build(tmp_path, rebuild=True).meta
    # A reader that read _INDEX.json before the second publish can still load its files.
    assert open_index(str(tmp_path), first).search(x[:1], 1)[0][0][0] == "d0"
    third = build(tmp_path, rebuild=True).meta
    assert third.previous_token == second.token
    files = sorted(p.name for p in (tmp_path / "index" / "s").iterdir())
    assert files == sorted(["_INDEX.json", second.index_file, second.idmap_file,
                            third.index_file, third.idmap_file])
    assert read_meta(str(tmp_path), "s") == third


def test_index_on_s3_builds_locally_uploads_and_loads_through_a_cache(
        tmp_path, s3_bucket, monkeypatch):
    monkeypatch.setenv("EMBEDPIPE_CACHE", str(tmp_path / "cache"))
    x = clustered(1_500, 8, seed=15)
    local = tmp_path / "local"
    parts = write_set(local, "s", [f"d{i}" for i in range(1_500)], x)
    out = f"s3://{s3_bucket}/run"
    upload_dir(local / "sets", f"{out}/sets")
    m = index_set(IndexRequest(out=out, set_name="s", kind="ivf"), say=lambda _: None).meta
    listed = {u.rsplit("/", 1)[-1] for u in storage.list_files(f"{out}/index/s")}
    assert listed == {"_INDEX.json", m.index_file, m.idmap_file}
    handle = open_index(out, read_meta(out, "s"))
    assert handle.search(x[:3], 1)[0][0][0] == "d0"
    assert (tmp_path / "cache" / "index" / s3_bucket / "run/index/s" / m.token).is_dir()
    # Catch-up on S3: a deletion recorded by a run reaches the published index.

    write_part(local, "s", parts[0], [f"d{i}" for i in range(1, 500)], x[1:500])
    bump(local, "s", [parts[0]], ["d0"])
    upload_dir(local / "sets", f"{out}/sets")
    caught = index_set(IndexRequest(out=out, set_name="s"), say=lambda _: None)
    assert (caught.action, caught.meta.rows) == ("caught up", 1_499), caught.reason
    top = open_index(out, store.read_meta(out, "s")).search(x[:1], 3)[0]
    assert "d0" not in [i for i, _ in top]
    # the cache keeps the version the current one replaced: a reader mid-swap may open it
    cached = tmp_path / "cache" / "index" / s3_bucket / "run/index/s"
    assert {p.name for p in cached.iterdir()} == {m.token, caught.meta.token}

    # another process finishes the same download between the check and the rename; a
    # download killed an hour ago is swept, one still writing into an old folder is not
    shutil.rmtree(cached / caught.meta.token)
    hour_ago = time.time() - store.ABANDONED_DOWNLOAD_S - 60
    for name in ("killed", "writing"):
        (cached / f"{storage.STAGING_PREFIX}{name}").mkdir()
        (cached / f"{storage.STAGING_PREFIX}{name}" / m.index_file).write_bytes(b"half")
    os.utime(cached / f"{storage.STAGING_PREFIX}killed" / m.index_file, (hour_ago, hour_ago))
    for name in ("killed", "writing"):
        os.utime(cached / f"{storage.STAGING_PREFIX}{name}", (hour_ago, hour_ago))
    rename = os.replace

    def raced(src, dst):
        if Path(src).name.startswith(storage.STAGING_PREFIX):
            shutil.copytree(src, dst)  # the other process's copy, there first
        rename(src, dst)

    with monkeypatch.context() as patch:
        patch.setattr(store.os, "replace", raced)
        top = open_index(out, store.read_meta(out, "s")).search(x[:1], 3)[0]
    assert "d0" not in [i for i, _ in top]
    assert {p.name for p in cached.iterdir()} == {
        m.token, caught.meta.token, f"{storage.STAGING_PREFIX}writing"}


def test_hnsw_catch_up_never_reuses_the_labels_of_masked_rows(tmp_path):
    x = clustered(1_000, 16, seed=16)
    parts = write_set(tmp_path, "s", list(range(1_000)), x, parts=10)
    first = build(tmp_path, kind="hnsw").meta
    fresh = clustered(100, 16, seed=17)  # the rows with the highest labels are rewritten
    write_part(tmp_path, "s", parts[9], range(900, 1_000), fresh)
    bump(tmp_path, "s", [parts[9]], [])
    m = build(tmp_path).meta
    handle = open_index(str(tmp_path), m)
    # The old vectors are masked: a query equal to one finds no row with its score.
    for row in handle.search(x[900:], 5):
        assert all(score < 0.999 for _, score in row)
    assert [r[0][0] for r in handle.search(fresh, 1)] == list(range(900, 1_000))
    assert handle.idmap.labels[900:].tolist() == list(range(1_000, 1_100))
    assert (first.next_label, m.mode, m.rows, m.masked, m.next_label) == (
        1_000, "catch-up", 1_000, 100, 1_100)
    # the efSearch tuning chose is recorded, not raised by the masked rows (k + 100 here; past
    # 65,526 masked rows, an index no load would take)
    assert m.params["efSearch"] in EF_SEARCH
    # Deleting the top rows lowers the id map's highest label, never the high-water mark.
    (tmp_path / "sets" / "s" / parts[9]).unlink()  # as a run retires a shard: marker too
    (tmp_path / "sets" / "s" / "_done" / "00009.json").unlink()
    bump(tmp_path, "s", [], list(range(900, 1_000)))
    added = clustered(50, 16, seed=18)
    write_part(tmp_path, "s", "part-00010.parquet", range(2_000, 2_050), added)
    bump(tmp_path, "s", ["part-00010.parquet"], [])
    m = build(tmp_path).meta
    assert (m.mode, m.rows, m.masked, m.next_label) == ("catch-up", 950, 200, 1_150)
    handle = open_index(str(tmp_path), m)
    assert handle.idmap.labels[900:].tolist() == list(range(1_100, 1_150))
    assert [r[0][0] for r in handle.search(added, 1)] == list(range(2_000, 2_050))
    for row in handle.search(np.vstack([x[900:], fresh]), 5):
        assert all(score < 0.999 for _, score in row)


def test_an_old_index_with_masked_rows_and_no_high_water_mark_is_rebuilt(tmp_path):
    x = clustered(600, 16, seed=19)
    parts = write_set(tmp_path, "s", list(range(600)), x, parts=6)
    build(tmp_path, kind="hnsw")
    marker = tmp_path / "index" / "s" / "_INDEX.json"

    def forget_high_water_mark() -> None:  # as an embedpipe before the field wrote it
        marker.write_text(json.dumps(json.loads(marker.read_text()) | {"next_label": None}))

    forget_high_water_mark()  # no masked rows: catching up is safe
    write_part(tmp_path, "s", parts[5], range(500, 600), clustered(100, 16, seed=20))
    bump(tmp_path, "s", [parts[5]], [])
    caught = build(tmp_path)
    assert (caught.action, caught.meta.masked, caught.meta.next_label) == ("caught up", 100, 700)
    forget_high_water_mark()  # 100 masked rows whose labels nothing records
    bump(tmp_path, "s", [parts[5]], [])
    result = build(tmp_path)
    assert (result.action, result.meta.mode, result.meta.masked) == ("built", "full", 0)
    assert "100 masked rows but no label high-water mark" in result.reason
    assert result.meta.next_label == 600
    marker.write_text(json.dumps(json.loads(marker.read_text()) | {"next_label": 599}))
    with pytest.raises(StorageError, match=r"_INDEX.json: next_label 599 is not between ntotal "
                                           r"600 and \d+; rebuild"):
        build(tmp_path)


def test_a_set_removed_and_made_again_is_rebuilt_not_reported_up_to_date(tmp_path):
    write_set(tmp_path, "s", [f"old{i}" for i in range(500)], clustered(500, 8, seed=21))
    first = build(tmp_path).meta
    shutil.rmtree(tmp_path / "sets" / "s")  # same name, fingerprint and generation
    y = clustered(300, 8, seed=22)
    write_set(tmp_path, "s", [f"new{i}" for i in range(300)], y)
    result = build(tmp_path)
    assert (result.action, result.reason, result.meta.rows) == (
        "built", "the set was replaced", 300)
    made = json.loads((tmp_path / "sets/s/_SET.json").read_text())["token"]
    assert result.meta.set_token == made != first.set_token
    assert open_index(str(tmp_path), result.meta).search(y[:1], 1)[0][0][0] == "new0"
    assert build(tmp_path).action == "up to date"
    # A set from before sets had tokens, made again behind its index's generation: rebuilt.
    write_set(tmp_path, "s", [f"d{i}" for i in range(300)], y, generation=3, token=None)
    assert build(tmp_path).action == "built"
    write_set(tmp_path, "s", [f"d{i}" for i in range(300)], y, generation=1, token=None)
    result = build(tmp_path)
    assert (result.action, result.reason) == ("built", "the set was replaced (the index is at "
                                              "generation 3, the set at 1)")


@pytest.mark.parametrize("kind", ["hnsw", "ivf"])
def test_a_large_k_returns_k_hits_whatever_the_tuning(tmp_path, kind):
    x = clustered(4_000, 16, seed=23)
    write_set(tmp_path, "s", list(range(4_000)), x, parts=2)
    m = build(tmp_path, kind=kind).meta
    assert m.params and max(m.params.values()) < 100  # tuned for recall@10 only
    handle = open_index(str(tmp_path), m)
    for k in (100, 1_000, 4_000):
        for row in handle.search(x[:5], k):
            assert len(row) == k and len({i for i, _ in row}) == k
    tuned = hnsw_of(handle.index).hnsw.efSearch if kind == "hnsw" else ivf_of(handle.index).nprobe
    assert {**m.params} == {("efSearch" if kind == "hnsw" else "nprobe"): tuned}  # untouched


@pytest.mark.parametrize(("params", "says"), [
    ({"bogus": 1}, "unknown search parameter 'bogus' (this index takes: efSearch)"),
    ({"efSearch": 2**40}, "efSearch=1099511627776 is not an integer in 1..65536"),
    ({"nprobe": 4}, "unknown search parameter 'nprobe'"),
    ({"efSearch": 0}, "efSearch=0 is not an integer in 1..65536"),
])
def test_bad_params_in_index_json_are_one_line_storage_errors(tmp_path, params, says):
    write_set(tmp_path, "s", list(range(200)), clustered(200, 8, seed=24), parts=2)
    build(tmp_path, kind="hnsw")
    marker = tmp_path / "index" / "s" / "_INDEX.json"
    marker.write_text(json.dumps(json.loads(marker.read_text()) | {"params": params}))
    with pytest.raises(StorageError) as caught:
        open_index(str(tmp_path), read_meta(str(tmp_path), "s"))
    assert str(caught.value).startswith(f"{marker}: params: ")
    assert says in str(caught.value) and len(str(caught.value).splitlines()) == 1


def test_ivf_params_are_bounded_by_the_number_of_lists(tmp_path):
    write_set(tmp_path, "s", list(range(2_000)), clustered(2_000, 8, seed=25), parts=2)
    m = build(tmp_path, kind="ivf").meta
    marker = tmp_path / "index" / "s" / "_INDEX.json"
    nlist = store.load(str(tmp_path), m)[0].nlist
    marker.write_text(json.dumps(json.loads(marker.read_text()) | {"params": {"nprobe": nlist}}))
    assert open_index(str(tmp_path), read_meta(str(tmp_path), "s")).params == {"nprobe": nlist}
    marker.write_text(json.dumps(json.loads(marker.read_text())
                                 | {"params": {"nprobe": nlist + 1}}))
    with pytest.raises(StorageError, match=rf"nprobe={nlist + 1} is not an integer in 1..{nlist}"):
        open_index(str(tmp_path), read_meta(str(tmp_path), "s"))


_OUT_OF_MEMORY = """
import resource, sys
from pipeline.errors import EmbedpipeError
from pipeline.index import IndexRequest, index_set, setdata
from pipeline.sets import SetFolder
out = sys.argv[1]
folder = SetFolder(out, "s")
info = folder.meta()
for _ in setdata.SetVectors.of(folder, info).iter_batches(10_000):
    pass  # IO threads and buffers exist before the limit
vm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize"))
limit = vm * 1024 + (100 << 20)  # 100 MB more: far below the flat index of 400k x 64
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
try:
    index_set(IndexRequest(out=out, set_name="s", kind="flat", batch_rows=10_000))
except EmbedpipeError as exc:
    print(f"{type(exc).__name__}: {exc}")
    sys.exit(1)
"""


@pytest.mark.slow
def test_running_out_of_memory_while_building_is_one_line_naming_the_budget(tmp_path):
    """A real allocation failure: the build runs in a process whose address space is capped."""
    import os
    import subprocess
    import sys

    import pyarrow as pa
    import pyarrow.parquet as pq
    from _index_sets import write_changes, write_marker

    rng = np.random.default_rng(0)
    folder = tmp_path / "sets" / "s"
    folder.mkdir(parents=True)
    names = [f"part-{p:05d}.parquet" for p in range(4)]
    for p, name in enumerate(names):  # 4 x 100k rows of 64 floats, written column-wise
        flat = pa.array(rng.standard_normal(100_000 * 64, dtype=np.float32))
        table = pa.table({"id": np.arange(p * 100_000, (p + 1) * 100_000),
                          "embedding": pa.FixedSizeListArray.from_arrays(flat, 64)})
        pq.write_table(table, folder / name, row_group_size=10_000)
        write_marker(tmp_path, "s", name, 100_000)
    write_meta(tmp_path, "s", meta("s", 64))
    write_changes(tmp_path, "s", 1, names, [])
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1",
           "ARROW_DEFAULT_MEMORY_POOL": "system"}
    done = subprocess.run([sys.executable, "-c", _OUT_OF_MEMORY, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]
    line = done.stdout.strip()
    assert line.startswith("ConfigError: out of memory building the index of set 's'"), line
    assert "--memory-budget 4GB" in line and len(line.splitlines()) == 1
    assert not (tmp_path / "index" / "s" / "_INDEX.json").exists()


@pytest.mark.parametrize("kind", ["hnsw", "flat"])
def test_a_set_whose_rows_all_left_it_serves_no_hits(tmp_path, kind):
    """Every row deleted: HNSW cannot remove rows, so its catch-up falls back to a full build of
    nothing, which left the old index published, answering with deleted ids. Now an empty
    index replaces it; rows that come back later are indexed again."""
    x = clustered(300, 8, seed=21)
    parts = write_set(tmp_path, "s", [f"d{i}" for i in range(300)], x, parts=3, id_type="string")
    first = build(tmp_path, kind=kind).meta
    for part in parts:
        (tmp_path / "sets" / "s" / part).unlink()
        (tmp_path / "sets" / "s" / "_done" / part.replace("part-", "").replace(
            ".parquet", ".json")).unlink()
    bump(tmp_path, "s", [], [f"d{i}" for i in range(300)])
    empty = build(tmp_path).meta
    assert (empty.rows, empty.generation) == (0, first.generation + 1)
    assert open_index(str(tmp_path), read_meta(str(tmp_path), "s")).search(x[:3], 5) == [
        [], [], []]
    write_part(tmp_path, "s", "part-00009.parquet", ["back"], x[:1])
    bump(tmp_path, "s", ["part-00009.parquet"], [])
    again = build(tmp_path).meta
    assert again.rows == 1 and again.next_label >= first.next_label
    hits = open_index(str(tmp_path), again).search(x[:1], 3)
    assert [i for i, _ in hits[0]] == ["back"]
