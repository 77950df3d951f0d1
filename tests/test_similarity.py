"""Search ranks as the model compares vectors (sentence-transformers' ``similarity_fn_name``):
a model without a Normalize module is searched by cosine unless it says dot or euclidean."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _flowkit import job, read_set, run_library, write_corpus
from _st_models import Variant, real_texts, save_variant
from conftest import build_tiny_bert

from pipeline.errors import ConfigError, FingerprintError, ModelError
from pipeline.evaluate import evaluate_sets
from pipeline.index import IndexRequest, index_set
from pipeline.search import Searcher
from pipeline.sets import SetFolder, SetMeta

QUERIES = ["a library for parsing dates", "fast json in python", "word " * 30]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bert(tmp_path_factory.mktemp("base") / "bert")


def embedded_and_indexed(base: Path, root: Path, similarity: str | None) -> tuple[Path, Path]:
    """A model without Normalize, its corpus embedded and indexed (exact)."""
    # sqrt-length pooling: norms grow with the text, so cosine, dot and L2 rank apart
    model = save_variant(base, root / "model",
                         Variant("raw", "mean_sqrt_len_tokens", similarity=similarity))
    texts = real_texts(120)
    corpus = write_corpus(root / "c.parquet", list(range(len(texts))), texts)
    out = root / "out"
    run_library(job(corpus, out, model, poolers=[{"name": "model", "strategy": "model"}],
                    rows_per_shard=1000))
    index_set(IndexRequest(out=str(out), set_name="model", kind="flat"), say=lambda _: None)
    return model, out


def st_ranking(model: Path, out: Path) -> tuple[np.ndarray, np.ndarray]:
    """sentence-transformers' own top-5 ids and scores for QUERIES over the corpus."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(model), device="cpu")
    texts = pq.read_table(out.parent / "c.parquet").column("text").to_pylist()
    scores = st.similarity(st.encode_query(QUERIES), st.encode(texts)).numpy()
    top = np.argsort(-scores, axis=1, kind="stable")[:, :5]
    return top, np.take_along_axis(scores, top, axis=1)


@pytest.mark.parametrize("similarity", [None, "dot", "euclidean"])
def test_search_ranks_as_the_models_similarity(base: Path, tmp_path: Path,
                                              similarity: str | None) -> None:
    model, out = embedded_and_indexed(base, tmp_path, similarity)
    meta = SetFolder(str(out), "model").meta()
    assert (meta.normalize, meta.similarity) == (False, similarity or "cosine")
    hits = Searcher(str(out), "model", snippets=False).search(QUERIES, k=5, snippets=False)
    want_ids, want_scores = st_ranking(model, out)
    assert [[h.id for h in row] for row in hits] == want_ids.tolist()
    got = np.array([[h.score for h in row] for row in hits])
    if similarity == "euclidean":  # FAISS gives squared L2, sentence-transformers -L2
        got = -np.sqrt(np.maximum(got, 0))
    np.testing.assert_allclose(got, want_scores, rtol=1e-4, atol=1e-4)


def test_cosine_over_raw_vectors_is_not_l2(base: Path, tmp_path: Path) -> None:
    """The test above means something: on this model, L2 and dot rank otherwise than cosine."""
    model, out = embedded_and_indexed(base, tmp_path, None)
    stored = read_set(out, "model")
    vectors = np.stack([stored[i] for i in sorted(stored)])
    queries = Searcher(str(out), "model", snippets=False).queries
    raw = queries.embedder.encode_queries(QUERIES, "model")
    l2 = np.argsort(((raw[:, None, :] - vectors[None]) ** 2).sum(-1), axis=1)[:, :5]
    dot = np.argsort(-(raw @ vectors.T), axis=1)[:, :5]
    cosine, _ = st_ranking(model, out)
    assert l2.tolist() != cosine.tolist() and dot.tolist() != cosine.tolist()


def test_a_manhattan_model_embeds_but_search_refuses_in_one_line(base: Path,
                                                                tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="manhattan distance, which search here does not"):
        embedded_and_indexed(base, tmp_path, "manhattan")
    assert SetFolder(str(tmp_path / "out"), "model").meta().similarity == "manhattan"


def test_an_unknown_similarity_fails_before_the_weights_load(base: Path, tmp_path: Path) -> None:
    from pipeline.models.loader import read_model_files

    model = save_variant(base, tmp_path / "model", Variant("raw", "mean"))
    config = model / "config_sentence_transformers.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"similarity_fn_name": "maxsim"}))
    with pytest.raises(ModelError, match="similarity_fn_name 'maxsim' is not one of cosine"):
        read_model_files(str(model))


def test_a_set_recorded_before_similarity_keeps_its_metric() -> None:
    fields = {"name": "s", "fingerprint": "f", "model": "m", "model_hash": "h", "encoder": {},
              "pooler": {}, "dim": 4, "dtype": "fp32", "max_length": 8}
    assert SetMeta(**fields, normalize=False).metric == "l2"  # as its index was built
    assert SetMeta(**fields, normalize=True).metric == "ip"
    assert SetMeta(**fields, normalize=False, similarity="cosine").metric == "ip"
    assert SetMeta(**fields, normalize=False, similarity="cosine").unit_search
    assert not SetMeta(**fields, normalize=True, similarity="cosine").unit_search


def test_exact_evaluation_ranks_as_the_cosine_index(base: Path, tmp_path: Path) -> None:
    """Evaluation's exact search (queries and vectors scaled as the index scales them) and the
    flat index give every relevant document the same rank."""
    model, out = embedded_and_indexed(base, tmp_path, None)
    top, _ = st_ranking(model, out)
    queries = tmp_path / "queries.parquet"  # relevant: sentence-transformers' top 3
    pq.write_table(pa.table({"query": [q for q in QUERIES for _ in range(3)],
                             "doc_id": [int(d) for row in top for d in row[:3]]}), queries)
    exact, index = (evaluate_sets(str(out), str(queries), ["model"], k=5, exact=e)[0]
                    for e in (True, False))
    assert (exact.search, index.search) == ("exact", "index")
    assert exact.scores == index.scores and exact.scores["recall@5"] == 1.0


@pytest.mark.parametrize(("edit", "says"), [
    ({"similarity": "dot"}, "similarity dot with normalize false, its model and pooler compare "
                            "by cosine with normalize false"),
    ({"normalize": True}, "similarity cosine with normalize true, its model and pooler compare "
                          "by cosine with normalize false"),
])
def test_a_set_json_whose_comparison_was_edited_is_refused_at_search(base: Path, tmp_path: Path,
                                                                     edit: dict, says: str):
    """``similarity`` and ``normalize`` are not in the fingerprint; an index built after the
    edit matches the set, so only the set's own model can tell: search and evaluation ranked
    by the edited measure without a word."""
    _, out = embedded_and_indexed(base, tmp_path, None)
    meta = out / "sets" / "model" / "_SET.json"
    meta.write_text(json.dumps(json.loads(meta.read_text()) | edit))
    index_set(IndexRequest(out=str(out), set_name="model", kind="flat", rebuild=True),
              say=lambda _: None)
    with pytest.raises(FingerprintError) as err:
        Searcher(str(out), "model", snippets=False)
    assert str(err.value) == (f"set 'model': its _SET.json says {says} (_SET.json edited?); "
                              "restore it, or re-embed the set")
    queries = tmp_path / "queries.parquet"
    pq.write_table(pa.table({"query": QUERIES[:1], "doc_id": [0]}), queries)
    with pytest.raises(FingerprintError, match="_SET.json edited"):
        evaluate_sets(str(out), str(queries), ["model"], k=5, exact=True)
