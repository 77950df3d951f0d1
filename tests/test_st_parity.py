"""Sentence-transformers models come out exactly as ``SentenceTransformer.encode`` gives them.

Each variant (one per pooling mode; with and without Dense, Normalize, prompts, a short
max_seq_length, prompt tokens left out of pooling) is saved by sentence-transformers, then
embedded by embedpipe's default ``model`` set on a few hundred real texts, long ones
included: same width, cosine >= 0.9999 and the same norm for documents (the document
prompt) and queries (the query prompt), and the same query-document scores.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from _st_models import VARIANTS, Variant, assert_same, ours_for, real_texts, save_variant
from conftest import build_tiny_bert

from pipeline.config import EncoderConfig, PoolerSpec
from pipeline.data import TextBatch
from pipeline.embedder import Embedder
from pipeline.vectors import row_cosines


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return real_texts(300)


@pytest.fixture(scope="module")
def st_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("st-models")
    base = build_tiny_bert(root / "base")
    return {v.name: save_variant(base, root / v.name, v) for v in VARIANTS}




@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_documents_and_queries_match_sentence_transformers(
    variant: Variant, st_models: dict[str, Path], texts: list[str]
) -> None:
    from sentence_transformers import SentenceTransformer

    folder = st_models[variant.name]
    st = SentenceTransformer(str(folder), device="cpu")
    ours = ours_for(folder)
    docs, queries = ours.encode(texts, "model"), ours.encode_queries(texts[:60], "model")
    st_docs = st.encode(texts, batch_size=32)
    st_queries = st.encode_query(texts[:60], batch_size=32)
    doc_cos = assert_same(docs, st_docs, f"{variant.name} documents")
    query_cos = assert_same(queries, st_queries, f"{variant.name} queries")
    np.testing.assert_allclose(queries @ docs.T, st_queries @ st_docs.T, rtol=1e-3, atol=1e-4)
    print(f"\n{variant.name}: min cosine documents {doc_cos:.7f}, queries {query_cos:.7f}")


def test_the_modules_shape_the_set(st_models: dict[str, Path]) -> None:
    """Width from Dense, norm from Normalize, length from max_seq_length, prompts from the
    config: what the issue saw go wrong (48 wide instead of 24; no warning)."""
    ours = ours_for(st_models["cls_dense_norm_prompts"])
    assert ours.dims() == {"model": 24}
    assert ours.encoder.max_length == 64
    assert ours.encoder.document_prompt.text == "passage: "
    assert ours.encoder.query_prompt.text == "query: "
    assert ours.specs["model"].normalize is True
    unnormalised = ours_for(st_models["max_len64"])
    assert unnormalised.specs["model"].normalize is False  # the set records the truth
    norms = np.linalg.norm(unnormalised.encode(["a b c", "hello world"]), axis=1)
    assert np.abs(norms - 1).min() > 1e-3


def test_a_normalize_before_a_dense_runs_where_it_sits(
    st_models: dict[str, Path], texts: list[str]
) -> None:
    """Pooling, Normalize, Dense: the Dense reads unit vectors and writes vectors that are not
    unit length, as ``encode`` gives them; the set records normalize = false (search follows).
    ``normalize = false`` leaves out a final Normalize only: this one is part of the Dense's
    input, for the model set and for a seed pooler with ``model_head``."""
    from sentence_transformers import SentenceTransformer

    folder = st_models["mean_norm_then_dense"]
    specs = [PoolerSpec(name="model"), PoolerSpec(name="kept", strategy="model", normalize=False),
             PoolerSpec(name="head", strategy="mean", model_head=True, normalize=False)]
    ours = Embedder(EncoderConfig(model=str(folder), dtype="fp32", device="cpu"), specs)
    assert {name: spec.normalize for name, spec in ours.specs.items()} == {
        "model": False, "kept": False, "head": False}
    vectors = ours.embed(TextBatch(list(range(len(texts))), texts)).vectors
    expected = SentenceTransformer(str(folder), device="cpu").encode(texts, batch_size=32)
    assert np.abs(np.linalg.norm(expected, axis=1) - 1).min() > 1e-2  # not unit length
    for spec in specs:
        worst = assert_same(vectors[spec.name], expected, f"Normalize, Dense: {spec.name}")
    print(f"\nPooling, Normalize, Dense: min cosine {worst:.7f}")


def test_prompt_names_override_the_model_defaults(
    st_models: dict[str, Path], texts: list[str]
) -> None:
    from sentence_transformers import SentenceTransformer

    folder = st_models["mean_norm_prompts"]
    st = SentenceTransformer(str(folder), device="cpu")
    sample = texts[:40] + texts[-5:]
    search = ours_for(folder, prompt_name="search", query_prompt_name="document")
    assert_same(search.encode(sample), st.encode(sample, prompt_name="search"), "search docs")
    assert_same(search.encode_queries(sample), st.encode(sample, prompt_name="document"),
                "document-prompted queries")
    bare = ours_for(folder, prompt_name="")
    assert_same(bare.encode(sample), st.encode(sample, prompt=""), "no prompt")
    assert bare.fingerprint("model") != search.fingerprint("model")


def test_seed_poolers_read_token_states_and_model_head_applies_the_modules(
    st_models: dict[str, Path], tmp_path: Path, texts: list[str]
) -> None:
    """A seed ``cls`` with ``model_head = true`` is the model's own pipeline when the model
    pools the first token with its prompt; without it, ``cls`` is the bare token state."""
    from sentence_transformers import SentenceTransformer

    base = build_tiny_bert(tmp_path / "base")
    v = Variant("cls_head", "cls", dense=(12, "Tanh"), normalize=True,
                prompts={"query": "query: ", "document": "passage: "}, default_prompt="document")
    folder = save_variant(base, tmp_path / "st", v)
    specs = [PoolerSpec(name="model"), PoolerSpec(name="cls_head", strategy="cls",
                                                  model_head=True),
             PoolerSpec(name="cls")]
    ours = Embedder(EncoderConfig(model=str(folder), dtype="fp32", device="cpu"), specs)
    assert ours.dims() == {"model": 12, "cls_head": 12, "cls": 32}
    sample = texts[:50] + texts[-5:]
    vectors = ours.embed(TextBatch(list(range(len(sample))), sample)).vectors
    expected = SentenceTransformer(str(folder), device="cpu").encode(sample)
    assert_same(vectors["model"], expected, "model")
    worst = assert_same(vectors["cls_head"], expected, "cls + model_head")
    print(f"\ncls + model_head (Dense 32->12 Tanh, Normalize): min cosine {worst:.7f}")
    assert row_cosines(vectors["cls"][:, :12], expected).min() < 0.99  # not the model's head


@pytest.mark.parametrize("kind", ["mpnet", "distilbert", "electra", "modernbert"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "transformers"])
def test_other_architectures_match_sentence_transformers(
        tmp_path: Path, texts: list[str], monkeypatch: pytest.MonkeyPatch, kind: str,
        fused: bool) -> None:
    """MPNet, all-mpnet-base-v2's architecture (positions after its padding id, no token
    types, a relative position bias in every layer's attention), DistilBERT (msmarco- and
    multi-qa-distilbert's: its own config and weight names, no token types), ELECTRA (its
    embeddings narrower than its layers, widened by a Linear) and ModernBERT (rotary positions,
    sliding attention, a gated feed-forward: ``pipeline.fused_modernbert``), through the fused
    forward and, where that does not run (a pooler reading attention weights), through
    transformers' own model, which for MPNet has no SDPA (eager attention)."""
    from sentence_transformers import SentenceTransformer

    from pipeline import fused_bert, fused_modernbert

    base = build_tiny_bert(tmp_path / "base", kind=kind)
    folder = save_variant(base, tmp_path / "st", Variant(f"{kind}_mean_norm", "mean",
                                                         normalize=True))
    if not fused:
        for module in (fused_bert, fused_modernbert):
            monkeypatch.setattr(module, "fusable", lambda config, device: False)
    ours = ours_for(folder)
    assert ours.encoder.fused is fused
    assert ours.encoder.model.config.model_type == kind
    if not fused and kind == "mpnet":
        assert ours.encoder.model.config._attn_implementation == "eager"
    theirs = SentenceTransformer(str(folder), device="cpu").encode(texts, batch_size=32)
    assert_same(ours.encode(texts, "model"), theirs, f"{kind} documents")


def test_a_modernbert_with_cls_pooling_matches_sentence_transformers(
        tmp_path: Path, texts: list[str]) -> None:
    """A [CLS] model of ModernBERT's architecture (as gte-modernbert-base): the fused forward
    computes its last layer at the first tokens alone, and the vectors are
    sentence-transformers' own."""
    from sentence_transformers import SentenceTransformer

    base = build_tiny_bert(tmp_path / "base", kind="modernbert")
    folder = save_variant(base, tmp_path / "st", Variant("modernbert_cls_norm", "cls",
                                                         normalize=True))
    ours = ours_for(folder)
    assert ours.encoder.fused and ours.first_token_only
    theirs = SentenceTransformer(str(folder), device="cpu").encode(texts, batch_size=32)
    assert_same(ours.encode(texts, "model"), theirs, "modernbert [CLS] documents")


def test_a_cls_pooling_that_counts_its_prompt_computes_the_cls_token_alone(
        st_models: dict[str, Path]) -> None:
    """The [CLS] Pooling that counts the prompt in reads each row's first token: the forward
    computes the last layer there alone (and matches sentence-transformers above); one that
    leaves the prompt out reads the first token after it."""
    assert ours_for(st_models["cls_norm_prompts_counted"]).first_token_only
    assert not ours_for(st_models["cls_dense_norm_prompts"]).first_token_only
    assert not ours_for(st_models["cls_and_mean_dense_identity"]).first_token_only
