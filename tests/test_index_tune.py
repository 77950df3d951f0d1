"""Tuning an index's search parameters: each setting tried as a search runs it."""

from __future__ import annotations

import faiss
import numpy as np
import pyarrow as pa
import pytest

from pipeline.index.handle import IndexHandle
from pipeline.index.idmap import IdMap
from pipeline.index.tune import tune
from pipeline.ranking import recall_of_labels


def ivf_with_tiny_lists() -> tuple[IndexHandle, np.ndarray]:
    """An IVF of 32 lists over 2,000 unit rows, four of them holding 2-3 rows each (rows off
    on their own, as real embeddings have): a search for 10 rows probes at least 4 lists."""
    rng = np.random.default_rng(0)
    bulk = rng.normal(size=(1990, 32)).astype(np.float32)
    bulk[:, :4] = 0
    bulk /= np.linalg.norm(bulk, axis=1, keepdims=True)
    alone = np.zeros((10, 32), np.float32)
    alone[np.arange(10), np.arange(10) % 4] = 1.0
    kmeans = faiss.Kmeans(32, 28, seed=1)
    kmeans.train(bulk)
    quantizer = faiss.IndexFlatIP(32)
    quantizer.add(np.concatenate([kmeans.centroids, np.eye(32, dtype=np.float32)[:4]]))
    index = faiss.IndexIVFFlat(quantizer, 32, 32, faiss.METRIC_INNER_PRODUCT)
    data = np.concatenate([bulk, alone])
    index.add_with_ids(data, np.arange(len(data)))
    ids = np.arange(len(data))
    return IndexHandle(index, IdMap(ids, pa.array(ids)), {}), data


def test_settings_that_run_alike_count_once_and_the_one_kept_is_what_runs() -> None:
    """nprobe 1, 2 and 4 all run as 4 here: tuning stopped there as a plateau at recall
    0.629 and recorded nprobe 1; now it goes on to the nprobe that reaches the target."""
    handle, data = ivf_with_tiny_lists()
    assert handle.effective(10)[0] == 4
    queries = data[:200]
    exact = faiss.IndexFlatIP(32)
    exact.add(data)
    truth = exact.search(queries, 10)[1]
    params, recall, tried = tune(handle, queries, truth, target=0.95)
    assert recall >= 0.95
    probes = [t["nprobe"] for t in tried]
    assert probes[0] == 4 and probes == sorted(set(probes))
    assert handle.params == params == handle.settings_for(10)
    assert recall_of_labels(handle.search_labels(queries, 10)[1], truth, 10) == recall


def test_hnsw_is_tuned_on_queries_it_does_not_hold(tmp_path):
    """The tuning sample was in the index while recall was measured: each query found itself
    and HNSW found the rest through it, so efSearch was tuned to 0.99 where queries of the same
    data outside the set got 0.85. Held back, the recall recorded is what such queries get;
    then the held rows join the index, each found as itself."""
    from _index_sets import clustered, write_set

    from pipeline.index import IndexRequest, index_set, open_index, read_meta

    rows, dim = 20_000, 32
    every = clustered(rows + 500, dim, seed=3, clusters=64, spread=1.5)
    vectors, fresh = every[:rows], every[rows:]
    write_set(tmp_path, "s", list(range(rows)), vectors, parts=2)
    index_set(IndexRequest(out=str(tmp_path), set_name="s", kind="hnsw", queries=500),
              say=lambda _: None)
    meta = read_meta(str(tmp_path), "s")
    handle = open_index(str(tmp_path), meta)
    truth = np.argsort(-(fresh @ vectors.T), axis=1)[:, :10]
    found = handle.search(fresh, 10)
    unseen = np.mean([len(set(truth[i]) & {hit for hit, _ in found[i]}) / 10
                      for i in range(len(fresh))])
    assert meta.rows == rows and meta.recall_at_10 >= 0.95
    assert unseen >= meta.recall_at_10 - 0.03, (unseen, meta.recall_at_10, meta.params)
    itself = handle.search(vectors[::97], 1)  # the held rows too: every row is indexed
    assert [hits[0][0] for hits in itself] == list(range(0, rows, 97))


def test_a_lossy_index_without_search_parameters_is_not_called_exact(tmp_path):
    """A PQ4 factory index at recall 0.38 was summarised "(exact, BELOW the target ...)"
    (PQ4x6 here: 3,000 rows train codebooks of 64 centroids, not of 256)."""
    from _index_sets import clustered, write_set

    from pipeline.index import IndexRequest, index_set

    write_set(tmp_path, "s", list(range(3000)), clustered(3000, 32, seed=1), parts=1)
    lossy = index_set(IndexRequest(out=str(tmp_path), set_name="s", kind="PQ4x6"),
                      say=lambda _: None)
    assert "(no search parameters" in lossy.summary() and "exact" not in lossy.summary()
    flat = index_set(IndexRequest(out=str(tmp_path), set_name="s", kind="flat", rebuild=True),
                     say=lambda _: None)
    assert "recall@10 1.000 (exact)" in flat.summary()


def test_a_catch_up_never_tunes_below_what_the_build_chose(tmp_path):
    """A catch-up measures recall with rows of the set, which the index holds: it took the
    efSearch back down to 16, under what queries outside the set need."""
    from _index_sets import bump, clustered, write_part, write_set

    from pipeline.index import IndexRequest, index_set, read_meta

    rows, dim = 20_000, 32
    every = clustered(rows + 1_000, dim, seed=3, clusters=64, spread=1.5)
    write_set(tmp_path, "s", list(range(rows)), every[:rows], parts=2)
    request = IndexRequest(out=str(tmp_path), set_name="s", kind="hnsw", queries=500)
    index_set(request, say=lambda _: None)
    built = read_meta(str(tmp_path), "s").params["efSearch"]
    write_part(tmp_path, "s", "part-00009.parquet", range(rows, rows + 1_000), every[rows:])
    bump(tmp_path, "s", ["part-00009.parquet"], [])
    caught = index_set(request, say=lambda _: None)
    assert caught.action == "caught up" and caught.meta.rows == rows + 1_000
    assert built > 16 and caught.meta.params["efSearch"] >= built


def test_rows_tied_with_the_tenth_count_as_found() -> None:
    """An exact (flat) index recorded recall@10 0.991 on real summaries: its 10th hit and the
    exact truth's were different rows of the same score, down to float rounding."""
    from pipeline.index.exact import ExactTopK

    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((200, 8)).astype(np.float32)
    vectors[100:] = vectors[:100]  # every row twice: each ties with its twin
    queries = rng.standard_normal((20, 8)).astype(np.float32)
    exact = ExactTopK(queries, 3, "ip", ties=3)
    exact.add(np.arange(200), vectors)
    truth = exact.truth()  # a, a', b, then b' (tied with b), then -1 (c, c' score less)
    assert truth.shape == (20, 6) and (truth[:, 3] >= 0).all() and (truth[:, 4:] < 0).all()
    twin = (truth[:, 2] + 100) % 200
    found = np.column_stack([truth[:, :2], twin])  # b' found for b
    assert recall_of_labels(found, truth, 3) == 1.0
    assert recall_of_labels(found, truth[:, :3], 3) == pytest.approx(2 / 3)  # ties unknown
    assert recall_of_labels(np.full((20, 3), -1), truth, 3) == 0.0
