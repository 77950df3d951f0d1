"""Retrieval metrics with known answers (pipeline.ranking), and `embedpipe eval` over real sets."""

from __future__ import annotations

import json
import math

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _search_sets import TEXTS, embedded_set
from hypothesis import given, settings
from hypothesis import strategies as st

from flows.cli import main
from pipeline import ranking
from pipeline.errors import CorpusError
from pipeline.evaluate import SetScores, load_queries, table
from pipeline.index import IndexRequest, index_set
from pipeline.index.tune import recall_of_labels
from pipeline.training.metrics import retrieval_metrics


def _score(rankings: list[list], relevant: list[set], k: int) -> dict[str, float]:
    rows = [(q, d) for q, docs in enumerate(relevant) for d in sorted(docs)]
    wanted = pl.DataFrame(rows, schema=["query", "doc"], orient="row")
    return ranking.score(ranking.ranks_of(ranking.found_frame(rankings), wanted), k)


def test_metrics_on_hand_computed_rankings():
    rankings = [["a", "b", "c"], ["x", "y", "a"], ["p", "q", "r"]]
    relevant = [{"a"}, {"a", "y"}, {"z"}]
    scores = _score(rankings, relevant, k=10)
    assert list(scores) == ["recall@1", "recall@10", "mrr@10", "ndcg@10"]
    assert scores["recall@1"] == pytest.approx((1 + 0 + 0) / 3)
    assert scores["recall@10"] == pytest.approx((1 + 1 + 0) / 3)
    assert scores["mrr@10"] == pytest.approx((1 + 1 / 2 + 0) / 3)
    ideal2 = 1 + 1 / math.log2(3)
    second = (1 / math.log2(3) + 1 / math.log2(4)) / ideal2
    assert scores["ndcg@10"] == pytest.approx((1 + second + 0) / 3)


def test_cut_off_two_counts_only_the_first_two_ranks_and_labels_say_so():
    rankings = [["a", "b", "c"], ["x", "y", "a"], ["p", "q", "r"]]
    relevant = [{"a"}, {"a", "y"}, {"z"}]
    scores = _score(rankings, relevant, k=2)
    assert list(scores) == ["recall@1", "recall@2", "mrr@2", "ndcg@2"]
    # query 1: y at rank 2 counts, a at rank 3 does not; its ideal has both relevant in 2 slots
    assert scores["recall@2"] == pytest.approx((1 + 1 / 2 + 0) / 3)
    assert scores["mrr@2"] == pytest.approx((1 + 1 / 2 + 0) / 3)
    second = (1 / math.log2(3)) / (1 + 1 / math.log2(3))
    assert scores["ndcg@2"] == pytest.approx((1 + second + 0) / 3)


@settings(deadline=None, max_examples=60)  # a shared 2-core machine: no per-example deadline
@given(ranked=st.lists(st.integers(0, 30), max_size=15, unique=True),
       relevant=st.sets(st.integers(0, 30), min_size=1, max_size=5))
def test_metrics_stay_in_range_and_perfect_rankings_score_one(ranked, relevant):
    scores = _score([ranked], [relevant], 10)
    assert all(0.0 <= v <= 1.0 + 1e-9 for v in scores.values())
    perfect = sorted(relevant) + [d for d in ranked if d not in relevant]
    best = _score([perfect], [relevant], 10)
    assert best["ndcg@10"] == pytest.approx(1.0) and best["mrr@10"] == 1.0
    assert scores["recall@10"] <= _score([ranked], [relevant], 15)["recall@15"] + 1e-12


def test_index_tuning_and_training_use_the_same_metrics():
    found = np.array([[1, 2, 3], [4, 5, -1]])
    truth = np.array([[3, 2, 9], [5, -1, -1]])
    assert recall_of_labels(found, truth, 3) == pytest.approx((2 / 3 + 1) / 2)
    # training: each query's own text; query 0 finds it first, query 1 second.
    corpus = np.array([[1.0, 0.0], [0.0, 1.0], [0.7, 0.7]], np.float32)
    queries = np.array([[1.0, 0.0], [0.6, 0.8]], np.float32)
    got = retrieval_metrics(queries, corpus, np.array([0, 1]), k=1)
    assert got == {"recall@1": 0.5, "mrr@1": 0.5, "ndcg@1": 0.5}


def test_queries_file_needs_query_and_doc_id(tmp_path):
    path = tmp_path / "q.parquet"
    pq.write_table(pa.table({"question": ["a"], "doc_id": [1]}), path)
    with pytest.raises(CorpusError, match=r"no column query \(its columns: question, doc_id\)"):
        load_queries(str(path))
    pq.write_table(pa.table({"query": ["a", "a", " ", None, "b"], "doc_id": [1, 1, 2, 3, None]}),
                   path)
    frame, unlabelled = load_queries(str(path))
    assert (frame.rows(), unlabelled) == ([("a", 1)], 3)


def test_each_file_of_a_queries_folder_needs_both_columns(tmp_path):
    """pyarrow reads a folder with the first file's schema, filling the others' missing
    columns with nulls: their rows were dropped as unlabelled, silently, in whichever order
    the files sorted."""
    folder = tmp_path / "q"
    folder.mkdir()
    pq.write_table(pa.table({"query": ["a", "b"], "doc_id": [1, 2]}), folder / "a.parquet")
    pq.write_table(pa.table({"question": ["c"], "doc": [3]}), folder / "b.parquet")
    with pytest.raises(CorpusError, match=r"b\.parquet has no column query, doc_id"):
        load_queries(str(folder))
    pq.write_table(pa.table({"query": ["c"], "doc_id": pa.array([3], pa.int32())}),
                   folder / "b.parquet")
    frame, unlabelled = load_queries(str(folder))
    assert (frame.rows(), unlabelled) == ([("a", 1), ("b", 2), ("c", 3)], 0)


def test_the_table_keeps_wide_metric_names_apart_and_counts_unlabelled_rows():
    scores = {"recall@1": 0.5, "recall@1000": 1.0, "mrr@1000": 0.75, "ndcg@1000": 0.8}
    result = SetScores(set="mean", queries=3, k=1000, search="exact", scores=scores,
                       unlabelled=2)
    lines = table([result]).splitlines()
    assert lines[0].split() == ["set", "queries", "search", *scores]
    assert lines[1].split() == ["mean", "3", "exact", "0.5000", "1.0000", "0.7500", "0.8000"]
    assert lines[2] == "(2 rows of the queries file without a query or a doc_id: not scored)"


def test_eval_command_scores_sets_as_table_json_and_png(tmp_path, tiny_model_dir, capsys):
    out = embedded_set(tmp_path / "a", tiny_model_dir)
    cls_out = embedded_set(tmp_path / "b", tiny_model_dir, name="cls", strategy="cls")
    # The cls set joins the mean set's OUT: two sets to compare.
    (out / "sets" / "cls").symlink_to(cls_out / "sets" / "cls", target_is_directory=True)
    for name in ("mean", "cls"):
        index_set(IndexRequest(out=str(out), set_name=name), say=lambda _: None)
    # Queries are document texts: the exact document must come first (recall@1 = 1).
    queries = tmp_path / "queries.parquet"
    pq.write_table(pa.table({"query": TEXTS[:10], "doc_id": list(range(100, 110))}), queries)
    png = tmp_path / "chart.png"
    assert main(["eval", str(out), str(queries), "--set", "mean", "--set", "cls", "--set",
                 "mean", "--json", "--plot", str(png)]) == 0
    printed = json.loads(capsys.readouterr().out)
    results = {r["set"]: r for r in printed}
    assert [r["set"] for r in printed] == ["mean", "cls"]  # a set named twice is scored once
    for r in results.values():
        assert (r["queries"], r["k"], r["search"]) == (10, 10, "exact")
        assert r["scores"] == {"recall@1": 1.0, "recall@10": 1.0, "mrr@10": 1.0, "ndcg@10": 1.0}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Wrong answers score lower: every query points at the next document.
    pq.write_table(pa.table({"query": TEXTS[:10], "doc_id": list(range(101, 111))}), queries)
    assert main(["eval", str(out), str(queries), "--set", "mean", "--no-exact"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["set", "queries", "search", "recall@1", "recall@10", "mrr@10",
                                "ndcg@10"]
    row = table[1].split()
    assert row[:4] == ["mean", "10", "index", "0.0000"] and float(row[6]) < 1.0


def test_dictionary_encoded_query_and_doc_id_columns_are_read_as_text(tmp_path):
    path = tmp_path / "q.parquet"
    pq.write_table(pa.table({"query": pa.array(["a", " ", "b", "a"]).dictionary_encode(),
                             "doc_id": pa.array(["1", "2", "3", "1"]).dictionary_encode()}), path)
    frame, _ = load_queries(str(path))
    assert frame.schema == {"query": pl.String, "doc_id": pl.String}
    assert frame.rows() == [("a", "1"), ("b", "3")]


@pytest.mark.parametrize("search", ["--exact", "--no-exact"])
def test_eval_scores_a_dictionary_encoded_queries_file(tmp_path, tiny_model_dir, capsys, search):
    out = embedded_set(tmp_path, tiny_model_dir)
    index_set(IndexRequest(out=str(out), set_name="mean"), say=lambda _: None)
    queries = tmp_path / "queries.parquet"  # as pandas writes a category column
    pq.write_table(pa.table({"query": pa.array(TEXTS[:6]).dictionary_encode(),
                             "doc_id": pa.array(list(range(100, 106))).dictionary_encode()}),
                   queries)
    assert pq.read_schema(queries).field("query").type == pa.dictionary(pa.int32(), pa.string())
    assert main(["eval", str(out), str(queries), "--set", "mean", "-k", "3", "--json",
                 search]) == 0
    (result,) = json.loads(capsys.readouterr().out)
    assert result["queries"] == 6 and result["scores"]["recall@1"] == 1.0


@pytest.mark.parametrize(("doc_ids", "says"), [
    # the message named the first value ('100'), which is a fine int64
    (["100", "x", "y"], "doc_id value 'x' is not of the set's id type int64"),
    ([True, False, True], "doc_id holds booleans, not ids of the set's id type int64"),
    # "0101" read as the id 101: scored as a hit on a doc it does not name
    (["100", "0101", "102"], "doc_id value '0101' is not an id of the set's id type int64 "
                              "(it reads as 101)"),
])
def test_doc_ids_that_are_no_ids_of_the_set_are_named(tmp_path, tiny_model_dir, capsys, doc_ids,
                                                      says):
    """Booleans were scored as ids 1 and 0 without a word."""
    out = embedded_set(tmp_path, tiny_model_dir)
    queries = tmp_path / "queries.parquet"
    pq.write_table(pa.table({"query": TEXTS[:3], "doc_id": doc_ids}), queries)
    assert main(["eval", str(out), str(queries), "--exact"]) != 0
    assert capsys.readouterr().err.strip() == f"embedpipe eval: error: set 'mean': {says}"


@pytest.mark.parametrize("search", ["--exact", "--no-exact"])
def test_doc_ids_the_set_lacks_are_counted_as_misses_and_named(tmp_path, tiny_model_dir, capsys,
                                                                search):
    """A queries file made for another corpus (or another id scheme) scored 0 with nothing to
    say why: the labelled pairs whose doc_id is not in the set are counted."""
    out = embedded_set(tmp_path, tiny_model_dir)
    index_set(IndexRequest(out=str(out), set_name="mean"), say=lambda _: None)
    queries = tmp_path / "queries.parquet"
    pq.write_table(pa.table({"query": TEXTS[:4] + ["x", "y"],
                             "doc_id": [100, 101, 102, 103, 10**9, 10**9 + 1]}), queries)
    assert main(["eval", str(out), str(queries), "--set", "mean", "--json", search]) == 0
    (result,) = json.loads(capsys.readouterr().out)
    assert (result["queries"], result["absent"]) == (6, 2)
    assert result["scores"]["recall@1"] == pytest.approx(4 / 6)
    assert main(["eval", str(out), str(queries), "--set", "mean", search]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == ("(2 labelled doc_id(s) not in set mean: scored as misses; was the "
                         "queries file made for this corpus?)")


def test_a_set_holding_every_labelled_doc_counts_none_absent(tmp_path, tiny_model_dir):
    from pipeline.evaluate import evaluate_sets

    out = embedded_set(tmp_path, tiny_model_dir)
    queries = tmp_path / "queries.parquet"
    pq.write_table(pa.table({"query": TEXTS[:3], "doc_id": [100, 101, 102]}), queries)
    (scores,) = evaluate_sets(str(out), str(queries), ["mean"])
    assert scores.absent == 0 and "not in set" not in table([scores])


@pytest.mark.parametrize("option", ["--out", "--plot"])
@pytest.mark.parametrize(("spelling", "says"), [
    ("{}", "lies inside OUT {}"),
    # fsspec writes each of these into the local file; they passed for paths outside OUT
    ("file:{}", "lies inside OUT {}"),
    ("local://{}", "lies inside OUT {}"),
    ("simplecache::file://{}", "chained URLs are not supported"),
])
def test_a_report_inside_out_is_refused_before_scoring_and_out_is_unchanged(
        tmp_path, tiny_model_dir, capsys, option, spelling, says):
    """`eval --out out/sets/mean/_SET.json` wrote its Parquet over the set's description
    (exit 0), and every later command failed on OUT with a traceback."""
    out = embedded_set(tmp_path / "a", tiny_model_dir)
    queries = tmp_path / "queries.parquet"
    pq.write_table(pa.table({"query": TEXTS[:3], "doc_id": [100, 101, 102]}), queries)
    target = out / "sets" / "mean" / "_SET.json"
    before = target.read_bytes()
    assert main(["eval", str(out), str(queries), option, spelling.format(target)]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says.format(out) in err, err
    assert target.read_bytes() == before
    assert main(["eval", str(out), str(queries), option, str(tmp_path / "report")]) == 0


@pytest.mark.parametrize("case", ["repeated", "null id"])
def test_exact_eval_refuses_a_part_with_a_repeated_or_null_id(tmp_path, tiny_model_dir, capsys,
                                                               case):
    """A part holding one id on every row was scored (recall 0.0), its rows found as one doc."""
    out = embedded_set(tmp_path / "a", tiny_model_dir)
    part = sorted((out / "sets" / "mean").glob("part-*.parquet"))[0]
    table_ = pq.read_table(part)
    ids = [table_.column("id")[0].as_py()] * table_.num_rows
    if case == "null id":
        ids = [None, *table_.column("id").to_pylist()[1:]]
    pq.write_table(table_.set_column(0, "id", pa.array(ids, table_.schema.field("id").type)),
                   part)
    queries = tmp_path / "queries.parquet"
    pq.write_table(pa.table({"query": TEXTS[:2], "doc_id": [100, 101]}), queries)
    assert main(["eval", str(out), str(queries), "--set", "mean", "--exact"]) == 1
    err = capsys.readouterr().err.strip()
    problem = ("holds ids more than once" if case == "repeated" else
               f"{part}: 1 of its ids are null")
    assert "\n" not in err and problem in err, err


@pytest.mark.parametrize("search", ["--exact", "--no-exact"])
def test_a_query_with_no_visible_character_is_unlabelled_either_way(tmp_path, tiny_model_dir,
                                                                    capsys, search):
    """Exact eval scored a zero-width space as the empty text; the index's refused the file
    as "query 44 is empty" (44: its place in a search batch)."""
    out = embedded_set(tmp_path, tiny_model_dir)
    index_set(IndexRequest(out=str(out), set_name="mean"), say=lambda _: None)
    queries = tmp_path / "queries.parquet"
    pq.write_table(pa.table({"query": [*TEXTS[:3], "\u200b", "\ufffd"],
                             "doc_id": [100, 101, 102, 103, 104]}), queries)
    assert main(["eval", str(out), str(queries), "--set", "mean", search, "--json"]) == 0
    [result] = json.loads(capsys.readouterr().out)
    assert (result["queries"], result["unlabelled"]) == (3, 2)


def test_a_set_whose_run_did_not_finish_is_noted_until_it_is_finished(tmp_path, tiny_model_dir,
                                                                      monkeypatch):
    """A backfill that stopped after one of three shards: eval scored its third of the
    corpus beside the complete set, as the winner, and blamed the queries file for the
    docs it lacked."""
    from _flowkit import job, run_library, text_for, write_corpus

    from pipeline.evaluate import evaluate_sets
    from pipeline.faults import InjectedFault

    ids = list(range(60))
    write_corpus(tmp_path / "c.parquet", ids, [text_for(i) for i in ids])
    make = job(tmp_path / "c.parquet", tmp_path / "out", tiny_model_dir)
    run_library(make)
    monkeypatch.setenv("EMBEDPIPE_FAILPOINT", f"write_marker:1:1:{tmp_path / 'fp'}")
    backfill = make | {"poolers": [{"name": "cls", "strategy": "cls"}]}
    with pytest.raises(InjectedFault):
        run_library(backfill)  # one shard of three written, then the run stopped
    monkeypatch.delenv("EMBEDPIPE_FAILPOINT")
    queries = tmp_path / "q.parquet"
    pq.write_table(pa.table({"query": [text_for(i) for i in (0, 30, 59)],
                             "doc_id": [0, 30, 59]}), queries)
    cls, mean = evaluate_sets(str(tmp_path / "out"), str(queries), ["cls", "mean"], k=3)
    assert (cls.unfinished, mean.unfinished) == (True, False)
    notes = table([cls, mean]).splitlines()[3:]
    assert notes[0].startswith("(set cls: a run wrote to it since the last one that finished")
    assert cls.absent == 2 and notes[1] == "(2 labelled doc_id(s) not in set cls: scored as misses)"
    run_library(backfill)
    cls, mean = evaluate_sets(str(tmp_path / "out"), str(queries), ["cls", "mean"], k=3)
    assert not (cls.unfinished or mean.unfinished) and cls.absent == 0
    assert table([cls, mean]).count("\n") == 2


def test_an_index_older_than_its_set_is_noted_and_its_missing_docs_not_blamed_on_the_queries(
        tmp_path, tiny_model_dir, capsys):
    from _flowkit import job, run_library, text_for, write_corpus

    ids = list(range(20))
    write_corpus(tmp_path / "c" / "a.parquet", ids, [text_for(i) for i in ids])
    make = job(tmp_path / "c", tmp_path / "out", tiny_model_dir)
    run_library(make)
    out = str(tmp_path / "out")
    index_set(IndexRequest(out=out, set_name="mean"), say=lambda _: None)
    write_corpus(tmp_path / "c" / "b.parquet", [20, 21], [text_for(20), text_for(21)])
    run_library(make, verify=True)  # the nightly run: two rows the index has not caught up
    queries = tmp_path / "q.parquet"
    pq.write_table(pa.table({"query": [text_for(i) for i in (3, 20, 21)],
                             "doc_id": [3, 20, 21]}), queries)
    assert main(["eval", out, str(queries), "--no-exact", "--json"]) == 0
    (result,) = json.loads(capsys.readouterr().out)
    assert (result["stale"], result["absent"], result["unfinished"]) == (True, 2, False)
    assert main(["eval", out, str(queries), "--no-exact"]) == 0
    assert capsys.readouterr().out.splitlines()[-2:] == [
        "(set mean: changed since its index was built, which was searched; run `embedpipe "
        "index`, or score it exactly)",
        "(2 labelled doc_id(s) not in the index of set mean: scored as misses)"]
    assert main(["eval", out, str(queries), "--exact", "--json"]) == 0
    (result,) = json.loads(capsys.readouterr().out)
    assert (result["stale"], result["absent"]) == (False, 0)


@pytest.mark.parametrize(("doc_id", "stored"), [([[1, 2]], "list<element: int64>"),
                                                ([{"x": 1}], "struct<x: int64>")])
def test_a_doc_id_column_of_lists_or_structs_is_one_line_before_any_model_loads(
        tmp_path, doc_id, stored):
    """It failed with Arrow's traceback, after every query was encoded and searched."""
    path = tmp_path / "q.parquet"
    pq.write_table(pa.table({"query": ["a"], "doc_id": doc_id}), path)
    with pytest.raises(CorpusError, match=rf"column doc_id is {stored}, not ids \(integers "
                                          r"or text\)"):
        load_queries(str(path))


def test_one_sets_missing_head_names_the_set_and_a_report_path_that_is_a_folder_fails_first(
        tmp_path, tiny_model_dir, capsys):
    """A set whose learned head was removed failed the eval of every set with a line naming
    only the head's file; ``--plot`` naming a folder failed after all the scoring."""
    import shutil

    from _flowkit import job, run_library, text_for, write_corpus

    from pipeline.head_files import HeadConfig
    from pipeline.models.loader import read_model_files
    from pipeline.poolers.heads import PoolingHead, save_head

    head = tmp_path / "head"
    save_head(PoolingHead(HeadConfig(
        kind="attention", hidden_size=32, num_layers=2,
        model_hash=read_model_files(str(tiny_model_dir)).model_hash())), str(head))
    write_corpus(tmp_path / "c.parquet", list(range(10)), [text_for(i) for i in range(10)])
    run_library(job(tmp_path / "c.parquet", tmp_path / "out", tiny_model_dir, poolers=[
        {"name": "mean"}, {"name": "tuned", "strategy": "learned", "head": str(head)}]))
    queries = tmp_path / "q.parquet"
    pq.write_table(pa.table({"query": [text_for(1)], "doc_id": [1]}), queries)
    out = str(tmp_path / "out")
    (tmp_path / "charts").mkdir()
    assert main(["eval", out, str(queries), "--plot", str(tmp_path / "charts")]) == 1
    assert capsys.readouterr().err.strip() == (
        f"embedpipe eval: error: --plot {tmp_path / 'charts'} is a folder: give the file to write")
    shutil.rmtree(head)
    assert main(["eval", out, str(queries)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"embedpipe eval: error: set 'tuned': cannot read {head}"), err
    assert main(["eval", out, str(queries), "--set", "mean"]) == 0
