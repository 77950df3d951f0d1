"""Retrieval metrics with known answers, and `embedpipe eval` over real indexed sets."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _search_sets import TEXTS, embedded_set
from hypothesis import given
from hypothesis import strategies as st

from flows.cli import main
from pipeline.errors import CorpusError
from pipeline.evaluate import load_queries, mrr_at, ndcg_at, recall_at, score_rankings
from pipeline.index import IndexRequest, index_set


def test_metrics_on_hand_computed_rankings():
    rankings = [["a", "b", "c"], ["x", "y", "a"], ["p", "q", "r"]]
    relevant = [{"a"}, {"a", "y"}, {"z"}]
    scores = score_rankings(rankings, relevant, k=10)
    assert scores["recall@1"] == pytest.approx((1 + 0 + 0) / 3)
    assert scores["recall@10"] == pytest.approx((1 + 1 + 0) / 3)
    assert scores["mrr@10"] == pytest.approx((1 + 1 / 2 + 0) / 3)
    ideal2 = 1 + 1 / math.log2(3)
    second = (1 / math.log2(3) + 1 / math.log2(4)) / ideal2
    assert scores["ndcg@10"] == pytest.approx((1 + second + 0) / 3)


@given(ranked=st.lists(st.integers(0, 30), max_size=15, unique=True),
       relevant=st.sets(st.integers(0, 30), min_size=1, max_size=5))
def test_metrics_stay_in_range_and_perfect_rankings_score_one(ranked, relevant):
    for value in (recall_at(ranked, relevant, 10), mrr_at(ranked, relevant, 10),
                  ndcg_at(ranked, relevant, 10)):
        assert 0.0 <= value <= 1.0 + 1e-9
    perfect = sorted(relevant) + [d for d in ranked if d not in relevant]
    assert ndcg_at(perfect, relevant, 10) == pytest.approx(1.0)
    assert mrr_at(perfect, relevant, 10) == 1.0
    assert recall_at(ranked, relevant, 10) <= recall_at(ranked, relevant, 15) + 1e-12


def test_queries_file_needs_query_and_doc_id(tmp_path):
    path = tmp_path / "q.parquet"
    pq.write_table(pa.table({"question": ["a"], "doc_id": [1]}), path)
    with pytest.raises(CorpusError, match=r"no column query \(its columns: question, doc_id\)"):
        load_queries(str(path))


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
    assert main(["eval", str(out), str(queries), "--set", "mean", "--set", "cls", "--json",
                 "--plot", str(png)]) == 0
    results = {r["set"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(results) == {"mean", "cls"}
    for r in results.values():
        assert r["queries"] == 10
        assert r["scores"] == {"recall@1": 1.0, "recall@10": 1.0, "mrr@10": 1.0, "ndcg@10": 1.0}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Wrong answers score lower: every query points at the next document.
    pq.write_table(pa.table({"query": TEXTS[:10], "doc_id": list(range(101, 111))}), queries)
    assert main(["eval", str(out), str(queries), "--set", "mean"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["set", "queries", "recall@1", "recall@10", "mrr@10", "ndcg@10"]
    row = table[1].split()
    assert row[:3] == ["mean", "10", "0.0000"] and float(row[5]) < 1.0
