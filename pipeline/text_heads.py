"""The head of a long text: cut where tokenizing it gives the whole text's first tokens.

A text truncated at max_length tokens needs only its first ones, but a fast tokenizer tokenizes
all of a text before it truncates (sentence-transformers' does too): 200 texts of ~200 KB took
6.7 s and 1 GB to tokenize for 256 tokens each (MiniLM's tokenizer, AMX Xeon). Where the
tokenizer is *word-local* - its normalizers change a text piece by piece (a character, or a
grapheme) and keep a plain space a plain space, its pre-tokenizer splits at plain spaces and
its model tokenizes each split alone (WordPiece, BPE, Unigram, WordLevel) - the text before a
space tokenizes to exactly the whole text's tokens before that space, provided the head's
normalized text ends in neither whitespace nor nothing (a normalizer that turns a character into
a space, or deletes it, would leave whitespace the whole text merges with the cut space:
XLM-R's runs of spaces collapsed, byte-level BPE's runs of whitespace). So a long text is cut at
the first plain space ``chars`` characters in that qualifies; the caller tokenizes a cut text
whole again where its head gave too few tokens (``Encoder.tokenize_rows``). Other tokenizers
are never cut.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Callable
from typing import Any

import numpy as np

# pre-tokenizers that split at every plain space (with ``_SPLITS_IF``), and others allowed
# beside one of them in a Sequence: they only split further, one character class at a time
_SPLITTERS = {"BertPreTokenizer", "Whitespace", "WhitespaceSplit", "ByteLevel", "Metaspace"}
_SPLITS_IF = {"ByteLevel": ("use_regex", True), "Metaspace": ("split", True)}
_FINER = {"Punctuation", "Digits"}
# normalizers that change characters one at a time (or one grapheme: Precompiled) and keep a
# plain space a plain space (others may become spaces or vanish: ``heads`` checks the cut);
# Strip and Prepend only touch the text's ends
_NORMALIZERS = {"BertNormalizer", "Lowercase", "NFC", "NFD", "NFKC", "NFKD", "StripAccents",
                "Strip", "Prepend", "Precompiled"}
_MODELS = {"WordPiece", "BPE", "Unigram", "WordLevel"}
_COLLAPSE_SPACES = " {2,}"  # XLM-R's and T5's Replace: runs of spaces to one
# characters of head per token kept: English runs ~4.5 per WordPiece token, CJK 1-2; a head
# that still falls short (long words, runs of symbols) costs one more, whole, tokenization
CHARS_PER_TOKEN = 10

# Unicode's grapheme cluster break property Prepend: such a character joins the next one, a
# space too, into one grapheme (what the Precompiled normalizer maps); a cut never follows one
# (Unicode 16; later versions may add more beyond the BMP, where a cut never follows a letter
# or mark: see ``_ends_word``)
PREPEND = frozenset(
    chr(c)
    for first, last in ((0x0600, 0x0605), (0x06DD, 0x06DD), (0x070F, 0x070F),
                        (0x0890, 0x0891), (0x08E2, 0x08E2), (0x0D4E, 0x0D4E),
                        (0x110BD, 0x110BD), (0x110CD, 0x110CD), (0x111C2, 0x111C3),
                        (0x113D1, 0x113D1), (0x1193F, 0x1193F), (0x11941, 0x11941),
                        (0x11A3A, 0x11A3A), (0x11A84, 0x11A89), (0x11D46, 0x11D46),
                        (0x11F02, 0x11F02))
    for c in range(first, last + 1)
)
_UNSURE_BEYOND_BMP = {"Lo", "Lm", "Mn", "Mc", "Cf"}


def word_local(tokenizer_json: str) -> bool:
    """Whether the tokenizer saved as ``tokenizer_json`` (``Tokenizer.to_str``) tokenizes the
    text before a plain space (as ``heads`` cuts it) as the whole text's tokens before it."""
    spec = json.loads(tokenizer_json)
    model = spec.get("model") or {}
    return (
        model.get("type") in _MODELS
        and not model.get("dropout")  # random merges: no two tokenizations agree
        and _normalizes_locally(spec.get("normalizer"))
        and _splits_at_spaces(spec.get("pre_tokenizer"))
        and not _added_token_spans_a_space(spec, tokenizer_json)
    )


def _added_token_spans_a_space(spec: dict[str, Any], tokenizer_json: str) -> bool:
    """Whether an added token could match across a cut: one with whitespace and more in its
    content (normalized, where it is matched in the normalized text). Runs of whitespace alone
    (GPT-NeoX's) match only after a cut, which never follows whitespace."""
    added = spec.get("added_tokens") or []
    normalize = None
    if spec.get("normalizer") is not None and any(t.get("normalized") for t in added):
        from tokenizers import Tokenizer

        normalize = Tokenizer.from_str(tokenizer_json).normalizer.normalize_str
    for token in added:
        content = token.get("content", "")
        if token.get("normalized") and normalize is not None:
            content = normalize(content)
        if any(c.isspace() for c in content) and not content.isspace():
            return True
    return False


def _normalizes_locally(normalizer: dict[str, Any] | None) -> bool:
    if normalizer is None:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_normalizes_locally(n) for n in normalizer.get("normalizers") or [])
    if kind == "Replace":
        return _local_replace(normalizer.get("pattern") or {}, normalizer.get("content", ""))
    return kind in _NORMALIZERS


def _local_replace(pattern: dict[str, str], content: str) -> bool:
    """One character that is not a space, to anything; or runs of spaces to one space."""
    plain = pattern.get("String")
    if plain is not None:
        return len(plain) == 1 and not plain.isspace()
    return pattern.get("Regex") == _COLLAPSE_SPACES and content == " "


def _splits_at_spaces(pre: dict[str, Any] | None) -> bool:
    if pre is None:
        return False
    members = pre.get("pretokenizers") or [] if pre.get("type") == "Sequence" else [pre]
    splits = False
    for member in members:
        kind = member.get("type")
        if kind in _SPLITTERS:
            key, wanted = _SPLITS_IF.get(kind, (None, None))
            if key is not None and member.get(key, wanted) != wanted:
                return False
            splits = True
        elif kind not in _FINER:
            return False
    return splits


def reach(keep: int) -> int:
    """Characters a head spans, at least, for ``keep`` tokens and one more (which tells that
    the text was longer)."""
    return CHARS_PER_TOKEN * (keep + 1)


def cut_at(text: str, chars: int, normalize: Callable[[str], str] | None = None) -> int:
    """Where to cut ``text``: the first plain space at or past ``chars`` (and past the first
    character) after a character that ends a word, where the head ``normalize`` gives
    (the tokenizer's normalizer) ends in neither whitespace nor nothing; -1 where there is none.
    """
    at = text.find(" ", max(chars, 1))
    while at > 0:
        if _ends_word(text[at - 1]) and (normalize is None or _ends_in_text(normalize(text[:at]))):
            return at
        at = text.find(" ", at + 1)
    return -1


def _ends_word(char: str) -> bool:
    """Not whitespace, and not a character that joins the next into one grapheme (Prepend:
    the ones Unicode 16 names, and any letter, mark or format character beyond the BMP)."""
    if char.isspace() or char in PREPEND:
        return False
    return ord(char) < 0x10000 or unicodedata.category(char) not in _UNSURE_BEYOND_BMP


def _ends_in_text(normalized: str) -> bool:
    return bool(normalized) and not normalized[-1].isspace()


def heads(texts: list[str], chars: int, normalize: Callable[[str], str] | None = None
          ) -> tuple[list[str], np.ndarray]:
    """Each text cut at ``cut_at(text, chars, normalize)`` where it is longer, and which ones
    were cut."""
    out = list(texts)
    cut = np.zeros(len(texts), bool)
    for i, text in enumerate(texts):
        if len(text) > chars:
            at = cut_at(text, chars, normalize)
            if at > 0:
                out[i] = text[:at]
                cut[i] = True
    return out, cut
