"""Search with a set's own model: the tiny BERT encodes queries, snippets come from the corpus."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _flowkit import job, run_library
from _search_sets import TEXTS, embedded_set

from flows.cli import main
from pipeline.errors import ConfigError, FingerprintError, StorageError
from pipeline.index import IndexRequest, index_set
from pipeline.live import LiveSets
from pipeline.search import Searcher


@pytest.fixture(scope="module")
def indexed(tmp_path_factory, tiny_model_dir) -> Path:
    out = embedded_set(tmp_path_factory.mktemp("search"), tiny_model_dir)
    index_set(IndexRequest(out=str(out), set_name="mean"), say=lambda _: None)
    return out


def test_a_document_text_finds_itself_first_with_its_snippet(indexed):
    searcher = Searcher(str(indexed))
    assert searcher.name == "mean" and not searcher.stale
    results = searcher.search([TEXTS[3], TEXTS[17]], k=5)
    assert [r[0].id for r in results] == [103, 117]
    assert all(abs(r[0].score - 1.0) < 1e-4 for r in results)
    assert results[0][0].snippet == TEXTS[3] and results[1][0].snippet == TEXTS[17]
    assert [h.rank for h in results[0]] == [1, 2, 3, 4, 5]
    scores = [h.score for h in results[0]]
    assert scores == sorted(scores, reverse=True)
    assert all(h.snippet == TEXTS[h.id - 100] for r in results for h in r)


@pytest.mark.parametrize("k", [0, -3, 10**9, 2.5, True])
def test_a_cut_off_search_does_not_take_is_one_line_wherever_it_comes_from(indexed, k, capsys):
    import embedpipe

    with pytest.raises(ConfigError, match=r"^-k must be an integer between 1 and 1000, got "):
        embedpipe.search(str(indexed), TEXTS[0], k=k)
    if isinstance(k, int) and not isinstance(k, bool):
        assert main(["query", str(indexed), TEXTS[0], "-k", str(k)]) == 1
        assert "-k must be an integer between 1 and 1000" in capsys.readouterr().err


def test_query_cli_prints_rank_score_id_snippet_and_json(indexed, capsys):
    assert main(["query", str(indexed), TEXTS[5], "-k", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3
    rank, score, doc_id, *snippet = lines[0].split()
    assert (rank, doc_id, " ".join(snippet)) == ("1", "105", TEXTS[5])
    assert float(score) == pytest.approx(1.0, abs=1e-3)
    assert main(["query", str(indexed), TEXTS[5], "-k", "2", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["set"] == "mean" and payload["query"] == TEXTS[5]
    assert [r["rank"] for r in payload["results"]] == [1, 2]
    assert payload["results"][0]["id"] == 105 and payload["results"][0]["snippet"] == TEXTS[5]


def test_query_takes_options_between_out_and_its_words(indexed, capsys):
    words = TEXTS[5].split()
    assert main(["query", str(indexed), "--set", "mean", *words[:2], "-k", "1",
                 *words[2:]]) == 0
    rank, _, doc_id, *snippet = capsys.readouterr().out.split()
    assert (rank, doc_id, " ".join(snippet)) == ("1", "105", TEXTS[5])
    with pytest.raises(SystemExit) as refused:  # an unknown option is still refused
        main(["query", str(indexed), "--set", "mean", "--bogus", "word"])
    assert refused.value.code == 2
    assert capsys.readouterr().err == ("embedpipe query: error: unrecognized arguments: "
                                       "--bogus word (see embedpipe query --help)\n")


@pytest.mark.parametrize("queries, reason", [
    (["caf\udce9"], r"query 0 is not valid text at character 3"),  # a Latin-1 argv byte
    (["ok", "\ud800"], r"query 1 is not valid text"),
    ([None], r"query 0 is NoneType, not text"),
    ([["nested"]], r"query 0 is list, not text"),
    (["  "], r"query 0 is empty or whitespace"),
    (["ok", "\u200b\ufeff"], r"query 1 is empty or whitespace \(no visible character\)"),
])
def test_queries_that_are_not_text_are_one_line_before_the_model_loads(tmp_path, queries,
                                                                       reason, capsys):
    import embedpipe

    missing = str(tmp_path / "no-such-out")  # refused before OUT is even read
    with pytest.raises(ConfigError, match=reason):
        embedpipe.search(missing, queries)
    if isinstance(queries[-1], str) and queries[-1].strip():  # as typed on a command line
        assert main(["query", missing, queries[-1]]) == 1
        err = capsys.readouterr().err
        assert err.startswith("embedpipe query: error: query 0 is ")
        assert reason.removeprefix("query 1 is").removeprefix("query 0 is")[:12] in err
        assert len(err.splitlines()) == 1


def test_query_on_a_set_without_an_index_says_how_to_build_one(tmp_path, tiny_model_dir,
                                                               capsys):
    out = embedded_set(tmp_path, tiny_model_dir, name="cls_set", strategy="cls")
    with pytest.raises(StorageError, match=r"no index .* `embedpipe index .* --set cls_set`"):
        Searcher(str(out), "cls_set")
    assert main(["query", str(out), "hello", "--set", "cls_set"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("embedpipe query: error: set 'cls_set' has no index")
    assert f"`embedpipe index {out} --set cls_set`" in err and len(err.splitlines()) == 1


def test_an_index_of_other_vectors_is_refused(tmp_path, tiny_model_dir):
    out = embedded_set(tmp_path, tiny_model_dir)
    index_set(IndexRequest(out=str(out), set_name="mean"), say=lambda _: None)
    path = out / "sets" / "mean" / "_SET.json"
    meta = json.loads(path.read_text())
    path.write_text(json.dumps(meta | {"fingerprint": "0123456789abcdef"}))
    with pytest.raises(FingerprintError, match=r"index .* fingerprint .* --rebuild"):
        Searcher(str(out))
    # Index rebuilt for the new fingerprint: now the embedder itself does not match it.
    index_set(IndexRequest(out=str(out), set_name="mean", rebuild=True), say=lambda _: None)
    with pytest.raises(FingerprintError, match="load as .* re-embed the set"):
        Searcher(str(out))


def test_a_replaced_set_is_stale_and_followed_live_until_its_index_is_rebuilt(tmp_path,
                                                                              tiny_model_dir):
    out = embedded_set(tmp_path, tiny_model_dir)
    index_set(IndexRequest(out=str(out), set_name="mean"), say=lambda _: None)
    first = Searcher(str(out))
    live = LiveSets({"mean": first}, interval_s=0)
    assert not first.stale
    shutil.rmtree(out / "sets" / "mean")  # made again: same name, model and generation
    embedded_set(tmp_path, tiny_model_dir, texts=TEXTS[:10])
    assert first.stale
    live.poll()  # the new set is served (with the old index) and known to be stale
    second = live.get("mean")
    assert second is not first and second.meta.token == first.meta.token
    assert second.set.token != first.set.token and second.stale
    result = index_set(IndexRequest(out=str(out), set_name="mean"), say=lambda _: None)
    assert (result.action, result.reason, result.meta.rows) == (
        "built", "the set was replaced", 10)
    live.poll()
    third = live.get("mean")
    assert third.meta.token == result.meta.token and not third.stale
    hits = third.search([TEXTS[3]], k=20)[0]
    assert hits[0].id == 103 and sorted(h.id for h in hits) == list(range(100, 110))


@pytest.mark.slow
def test_index_command_runs_the_prefect_flow(tmp_path, tiny_model_dir, capsys, prefect_api):
    out = embedded_set(tmp_path, tiny_model_dir)
    assert main(["index", str(out), "--set", "mean", "--memory-budget", "1GB"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("index mean: built (no index yet); flat [Flat] 20 rows")
    assert main(["index", str(out)]) == 0
    assert "index mean: up to date" in capsys.readouterr().out
    assert main(["index", str(out), "--memory-budget", "lots"]) == 1
    assert "memory budget 'lots' is not a size" in capsys.readouterr().err


def test_snippets_come_from_a_binary_text_column_as_the_run_read_it(tmp_path, tiny_model_dir):
    """embed reads binary text as UTF-8; search called the same column "not text" and gave no
    snippets. A row whose bytes are not UTF-8 was skipped by the run, so no snippet is its."""
    corpus, out = tmp_path / "c.parquet", tmp_path / "out"
    texts = [t.encode() for t in TEXTS[:6]]
    pq.write_table(pa.table({"id": [1, 2, 3, 3, 4, 5], "text": pa.array(
        [texts[0], texts[1], b"\xff\xfe not utf-8", texts[3], texts[4], texts[5]], pa.binary())}),
        corpus)
    summary = run_library(job(corpus, out, tiny_model_dir, dedupe=True))
    assert (summary.rows, summary.skipped) == (5, {"not_string": 1})
    index_set(IndexRequest(out=str(out), set_name="mean"), say=lambda _: None)
    searcher = Searcher(str(out))
    assert searcher.snippet_note is None
    embedded = {1: TEXTS[0], 2: TEXTS[1], 3: TEXTS[3], 4: TEXTS[4], 5: TEXTS[5]}
    hits = searcher.search([TEXTS[3], TEXTS[0]], k=5)
    assert [row[0].id for row in hits] == [3, 1]
    assert [(h.id, h.snippet) for h in hits[0]] == [(h.id, embedded[h.id]) for h in hits[0]]


def test_a_stale_index_checks_the_corpus_by_the_ids_still_in_the_set(tmp_path, tiny_model_dir):
    """Rows deleted since the index was built are in neither the corpus nor the set: a sample
    of the index's ids taking them failed the corpus check, and every hit lost its snippet
    with a note that the set's own corpus was not the set's."""
    from _flowkit import text_for, write_corpus

    corpus, out = tmp_path / "c.parquet", tmp_path / "out"
    write_corpus(corpus, list(range(200)), [text_for(i) for i in range(200)])
    given = job(corpus, out, tiny_model_dir)
    run_library(given)
    index_set(IndexRequest(out=str(out), set_name="mean"), say=lambda _: None)
    write_corpus(corpus, list(range(100, 200)), [text_for(i) for i in range(100, 200)])
    run_library(given, verify=True)  # the nightly run, before its index catches up
    searcher = Searcher(str(out))
    assert searcher.stale and searcher.snippet_note is None
    (hit,) = searcher.search([text_for(150)], k=1)[0]
    assert (hit.id, hit.snippet) == (150, text_for(150))


def test_the_python_api_warns_what_the_cli_notes(tmp_path, tiny_model_dir, capsys):
    """A deleted row was the API's top hit (snippet None) with nothing to say the index was
    older than the set, where `query` printed a note."""
    import warnings

    from _flowkit import text_for, write_corpus

    import embedpipe

    corpus, out = tmp_path / "c.parquet", tmp_path / "out"
    write_corpus(corpus, list(range(20)), [text_for(i) for i in range(20)])
    given = job(corpus, out, tiny_model_dir)
    run_library(given)
    index_set(IndexRequest(out=str(out), set_name="mean"), say=lambda _: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an up-to-date index: nothing to warn
        embedpipe.search(str(out), text_for(3), k=1)
    write_corpus(corpus, list(range(10, 20)), [text_for(i) for i in range(10, 20)])
    run_library(given, verify=True)  # rows 0-9 deleted, the index not caught up
    with pytest.warns(embedpipe.EmbedpipeWarning) as warned:
        (hits,) = embedpipe.search(str(out), text_for(3), k=1)
    notes = [str(w.message) for w in warned if w.category is embedpipe.EmbedpipeWarning]
    assert notes[-1] == (f"set 'mean' changed since it was indexed; run `embedpipe index "
                         f"{out} --set mean`")
    assert main(["query", str(out), text_for(3), "-k", "1"]) == 0
    assert capsys.readouterr().err.splitlines() == [f"note: {n}" for n in notes]
