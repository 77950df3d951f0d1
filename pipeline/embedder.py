"""Texts in, one vector per text and pooler set out, from ONE forward pass per batch.

The steps: tokenize the batch in bulk (fast tokenizer, no truncation; the prompt, if the
model has one, tokenized with each text as one string), plan pieces (the first
``max_length`` tokens, the last ones where the tokenizer truncates on the left, or
overlapping windows that each repeat the prompt inside their token budget), cut pieces into
token-budget batches sorted by length, run the encoder once per batch asking only for what
the poolers need, apply every pooler to the same states, aggregate windows back to rows,
truncate and normalise. Output rows are in input order whatever the batching.

Documents get the model's document prompt (``embed``, ``encode``), queries its query prompt
(``encode_queries``).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pipeline import text_heads
from pipeline.batching import slice_length, slice_rows, text_lengths, token_budget_batches
from pipeline.config import EncoderConfig, PoolerSpec, WindowAgg, stable_hash
from pipeline.data import EmbeddingBatch, TextBatch
from pipeline.encoder import Encoder, EncoderInfo, Prompt
from pipeline.errors import NonFiniteVectors
from pipeline.poolers import Pooler, build_pooler
from pipeline.stages import prefetch
from pipeline.stats import ShardStats
from pipeline.token_rows import TokenRows
from pipeline.torch_thread import on_torch_thread
from pipeline.vectors import nonfinite_rows, unit_rows
from pipeline.windows import Pieces, windows


@dataclass(frozen=True)
class Tokens:
    """Tokenized texts: ids (the prompt's first), the prompt's tokens kept at the start of
    every piece (``lead``; none where a left-truncating tokenizer cuts the prompt with the
    text) and the prompt's length as the pooler sees it."""

    ids: TokenRows
    lead: np.ndarray
    prompt_length: int


class Embedder:
    """An encoder and its configured poolers; build once per worker (see ``get_embedder``)."""

    def __init__(self, encoder: EncoderConfig, poolers: Sequence[PoolerSpec]) -> None:
        on_torch_thread(self._load, encoder, poolers)  # see pipeline.torch_thread
        self.loaded_at = time.perf_counter()  # a shard that finds it newer than its ask loaded it

    def _load(self, encoder: EncoderConfig, poolers: Sequence[PoolerSpec]) -> None:
        self.cfg = encoder
        self.specs = {spec.name: spec for spec in poolers}
        wants_attention = any(_needs_attention(spec) for spec in poolers)
        self.encoder = Encoder(encoder, need_attention=wants_attention)
        self.info: EncoderInfo = self.encoder.info()
        self.poolers: dict[str, Pooler] = {
            name: build_pooler(spec, self.info, self.encoder.parts)
            for name, spec in self.specs.items()
        }
        # a set records whether its vectors really end normalised (the model set: the model's)
        self.specs = {name: spec.model_copy(update={"normalize": self.poolers[name].normalizes})
                      for name, spec in self.specs.items()}
        self.layers = {i for p in self.poolers.values() for i in p.layers}
        self.attention = any(p.needs_attention for p in self.poolers.values())
        # every pooler reads the last layer's first tokens alone: the forward computes those
        self.first_token_only = (self.layers == {self.info.num_layers} and not self.attention
                                 and all(p.first_token_only for p in self.poolers.values()))
        self.encoder.check_window(self.encoder.document_prompt)
        self._check_row_tokens()

    def _check_row_tokens(self) -> None:
        """Every pooler takes the widest row a batch may hold (the window size where windows
        are on, else max_length), so none fails or not by a text's batch-mates."""
        window = self.cfg.window
        tokens = window.size if window else self.encoder.max_length
        source = f"window size {tokens}" if window else f"max_length {tokens}"
        for pooler in self.poolers.values():
            pooler.check_row_tokens(tokens, source)

    def dims(self) -> dict[str, int]:
        return {name: pooler.dim for name, pooler in self.poolers.items()}

    def window_agg(self, name: str) -> WindowAgg:
        spec = self.specs[name]
        return spec.window_agg or (self.cfg.window.agg if self.cfg.window else "first")

    def fingerprint(self, name: str) -> str:
        """Identity of a set's vectors: model files, prompts, pooler, lengths and windows."""
        window = self.cfg.window
        return stable_hash(
            {
                "model_hash": self.info.model_hash,
                "prompts": [self.encoder.document_prompt.text, self.encoder.query_prompt_text],
                "pooler": self.specs[name].spec_dict() | {"window_agg": self.window_agg(name)},
                "pooler_identity": self.poolers[name].identity(),
                "max_length": self.info.max_length,
                "window": [window.size, window.stride] if window else None,
            }
        )

    def embed(self, batch: TextBatch) -> EmbeddingBatch:
        """Document vectors of every set (with the model's document prompt)."""
        return self.encode_tokens(list(batch.ids), self.tokenize(list(batch.texts)))

    def tokenize(self, texts: list[str], prompt: Prompt | None = None) -> Tokens:
        """Step 1 of ``embed`` (a reader thread may run it): each text's token ids behind the
        prompt (the document prompt unless another is given)."""
        prompt = self.encoder.document_prompt if prompt is None else prompt
        ids = self.encoder.tokenize_rows(texts, prompt, self.keeps)
        if self.cuts_prompt:
            return Tokens(ids, np.zeros(len(ids), np.int64), prompt.length)
        return Tokens(ids, self.encoder.prompt_lead(ids, prompt), prompt.length)

    @property
    def keeps(self) -> int | None:
        """How many of a text's first ids (the prompt's with them) its one forward row can
        keep: past those, a long text's tokens are not needed (``Encoder.tokenize_rows``);
        None where every token is (windows, or a tokenizer that keeps a text's end)."""
        if self.cfg.window is not None or self.encoder.cuts_left:
            return None
        return self.encoder.content_length

    @property
    def cuts_prompt(self) -> bool:
        """Whether a long text loses its first tokens, the prompt's first: a tokenizer that
        truncates on the left, windows off. sentence-transformers tokenizes prompt and text as
        one string and truncates that; so do these pieces (windows truncate nothing)."""
        return self.encoder.cuts_left and self.cfg.window is None

    def encode_tokens(self, ids: list, tokens: Tokens) -> EmbeddingBatch:
        """Step 2 of ``embed``: the forward passes and poolers over tokenized texts."""
        if not len(tokens.ids):
            empty = {n: np.zeros((0, d), np.float32) for n, d in self.dims().items()}
            return EmbeddingBatch([], empty)
        rows = len(tokens.ids)
        pieces = self.plan(tokens)
        stats = ShardStats(
            tokens=int(pieces.lengths.sum()),
            windows=len(pieces),
            truncated=int(self.truncated(tokens, pieces).sum()),
        )
        raw = on_torch_thread(self._forward_pieces, tokens, pieces, stats)
        vectors = {name: self._finish(name, raw[name], pieces, rows) for name in raw}
        self._check_finite(ids, vectors)
        return EmbeddingBatch(list(ids), vectors, stats)

    def _check_finite(self, ids: list, vectors: dict[str, np.ndarray]) -> None:
        """No vector with a NaN or infinity leaves the embedder (``NonFiniteVectors`` names
        the pooler and the first of ``ids`` it failed on)."""
        for name, matrix in vectors.items():
            bad = nonfinite_rows(matrix)
            if len(bad):
                row = int(bad[0])
                raise NonFiniteVectors(name, len(bad), row, f"text {ids[row]!r}",
                                       self.encoder.dtype, self.specs[name].head)

    def truncated(self, tokens: Tokens, pieces: Pieces | None = None) -> np.ndarray:
        """Which texts lose tokens to max_length (``pieces``: their ``plan``); none where
        windows cover every token."""
        if self.cfg.window is not None:
            return np.zeros(len(tokens.ids), bool)
        pieces = self.plan(tokens) if pieces is None else pieces
        return tokens.ids.lengths - tokens.lead > pieces.lengths  # one piece per text, in order

    def encode(self, texts: Sequence[str], set_name: str | None = None) -> np.ndarray:
        """Document vectors of ``texts`` for one set (the only set when ``set_name`` is None)."""
        return self._encode(texts, set_name, self.encoder.document_prompt)

    def encode_queries(self, texts: Sequence[str], set_name: str | None = None) -> np.ndarray:
        """Query vectors of ``texts`` (with the model's query prompt) for one set."""
        return self._encode(texts, set_name, self.encoder.query_prompt)

    def _encode(self, texts: Sequence[str], set_name: str | None, prompt: Prompt) -> np.ndarray:
        """Vectors of ``texts`` in slices of ``slice_rows``: a thread tokenizes the next slice
        while this one encodes (on a GPU, tokenizing is as long as the forward passes)."""
        name = set_name or next(iter(self.specs))
        texts = list(texts)
        slices, start = [], 0
        while start < len(texts):
            end = self.slice_end(texts, start)
            slices.append(texts[start:end])
            start = end
        slices = slices or [[]]
        tokenized = (self.tokenize(part, prompt) for part in slices)
        if len(slices) > 1:
            tokenized = prefetch(tokenized, depth=1)
        parts = [self.encode_tokens(list(range(len(tokens.ids))), tokens).vectors[name]
                 for tokens in tokenized]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    @property
    def slice_rows(self) -> int:
        """Texts per ``encode_tokens`` call where the caller tokenizes ahead (see
        ``pipeline.batching.slice_rows``)."""
        return slice_rows(self.encoder.max_batch_rows)

    def slice_end(self, texts: list[str], start: int) -> int:
        """End of the slice of ``texts`` from ``start``: ``slice_rows`` texts, fewer where
        the characters their tokenizing reads pass ``SLICE_CHARS`` (long texts)."""
        part = texts[start : start + self.slice_rows]
        chars = text_lengths(part)
        keep = self.keeps
        if keep is not None and self.encoder.word_local:  # about their heads' lengths
            np.minimum(chars, 2 * text_heads.reach(keep), out=chars)
        return start + slice_length(chars)

    def plan(self, tokens: Tokens) -> Pieces:
        """Pieces over each text's own tokens; the prompt's ``lead`` tokens take their share
        of every piece's budget, as sentence-transformers counts them in max_seq_length."""
        lead = tokens.lead
        lengths = tokens.ids.lengths - lead
        window = self.cfg.window
        if window is None:
            return self.encoder.kept(lengths, self.encoder.content_length - lead)
        specials = len(self.encoder.prefix) + len(self.encoder.suffix)
        return windows(lengths, window.size - specials - lead, window.stride)

    def padded_batches(self, tokens: Tokens, pieces: Pieces
                       ) -> Iterator[tuple[np.ndarray, torch.Tensor, torch.Tensor]]:
        """Token-budget batches of ``pieces`` as (piece positions, ids, mask), longest first."""
        lead = tokens.lead
        specials = len(self.encoder.prefix) + len(self.encoder.suffix)
        batches = token_budget_batches(
            pieces.lengths + lead[pieces.row] + specials, self.encoder.token_budget,
            self.encoder.max_batch_rows, self.encoder.min_fill, self.encoder.batch_shape,
            self.encoder.unpadded_below,
        )
        for idx in batches:
            rows = pieces.row[idx]
            ids, mask = self.encoder.pad_rows(tokens.ids, rows, lead[rows], pieces.start[idx],
                                              pieces.end[idx])
            yield idx, ids, mask

    def _forward_pieces(self, tokens: Tokens, pieces: Pieces, stats: ShardStats
                        ) -> dict[str, np.ndarray]:
        """Each pooler's vector of every piece; ``stats`` counts the token rows the layers
        ran over and their padding."""
        out = {n: np.empty((len(pieces), p.width), np.float32) for n, p in self.poolers.items()}
        pooled: list[tuple[np.ndarray, dict[str, torch.Tensor]]] = []
        for idx, ids, mask in self.padded_batches(tokens, pieces):
            token_rows, padding = self.encoder.token_rows(mask)
            stats.batch_tokens += token_rows
            stats.padding += padding
            states = self.encoder.forward(ids, mask, self.layers, self.attention,
                                          tokens.prompt_length, self.first_token_only)
            pooled.append((idx, {n: p(states).float() for n, p in self.poolers.items()}))
        # copied back only now, so a GPU never waits for the host between batches
        for idx, vectors in pooled:
            for name, vector in vectors.items():
                out[name][idx] = vector.cpu().numpy()
        return out

    def _finish(self, name: str, raw: np.ndarray, pieces: Pieces, rows: int) -> np.ndarray:
        spec = self.specs[name]
        vectors = aggregate_windows(raw, pieces, rows, self.window_agg(name))
        if spec.truncate_dim:
            vectors = vectors[:, : spec.truncate_dim]
        if self.poolers[name].normalizes:
            vectors = unit_rows(vectors)
        return np.ascontiguousarray(vectors, dtype=np.float32)


def aggregate_windows(raw: np.ndarray, pieces: Pieces, rows: int, how: WindowAgg) -> np.ndarray:
    """One vector per row from its pieces' vectors (pieces come in row, start order)."""
    if len(pieces) == rows:  # one piece per row: nothing to aggregate
        return raw[np.argsort(pieces.row, kind="stable")]
    width = raw.shape[1]
    if how == "first":
        first = np.unique(pieces.row, return_index=True)[1]
        return raw[first]
    if how == "max":
        out = np.full((rows, width), -np.inf, np.float32)
        np.maximum.at(out, pieces.row, raw)
        return out
    weights = np.ones(len(pieces), np.float32)
    if how == "weighted":
        weights = np.maximum(pieces.lengths.astype(np.float32), 1e-6)
    sums = np.zeros((rows, width), np.float64)
    np.add.at(sums, pieces.row, raw * weights[:, None])
    totals = np.zeros(rows, np.float64)
    np.add.at(totals, pieces.row, weights)
    return (sums / totals[:, None]).astype(np.float32)


def _needs_attention(spec: PoolerSpec) -> bool:
    from pipeline.poolers.base import registered

    cls = registered(spec.strategy or spec.name)
    return bool(cls and cls.needs_attention)


# read and written on the torch thread only: each config's Embedder, with the digests of the
# learned heads' files it loaded
_CACHE: dict[str, tuple[Embedder, list[list[str]]]] = {}


def preload(encoder: EncoderConfig, poolers: Sequence[PoolerSpec]) -> threading.Thread:
    """Start ``get_embedder`` in a background thread, for a caller that will need the model
    and has something else to wait for meanwhile (a Prefect API server booting). A later
    ``get_embedder`` of the same config waits for this load and reuses it. A failed load
    leaves nothing cached: the caller's own ``get_embedder`` then raises the error, with the
    run's context, where it is handled."""

    def load() -> None:
        with contextlib.suppress(Exception):  # raised again by the caller's own load
            get_embedder(encoder, poolers)

    thread = threading.Thread(target=load, name="model-preload", daemon=True)
    thread.start()
    return thread


def get_embedder(encoder: EncoderConfig, poolers: Sequence[PoolerSpec]) -> Embedder:
    """The process-wide Embedder for this config: the model is loaded once per worker (on the
    process's torch thread, see ``pipeline.torch_thread``), and again (replacing the old one)
    when the model's files or a learned head's changed since (a long-lived worker or server
    across nightly runs, a head trained again in place; the model files' hash is stat-cached,
    see ``pipeline.models.hashing``)."""
    return on_torch_thread(_cached_embedder, encoder, poolers)


def _cached_embedder(encoder: EncoderConfig, poolers: Sequence[PoolerSpec]) -> Embedder:
    from pipeline.models.hashing import folder_hash

    key = json.dumps(
        [encoder.model_dump(mode="json"), [p.model_dump(mode="json") for p in poolers]],
        sort_keys=True,
    )
    heads = _head_digests(poolers)
    cached, loaded_heads = _CACHE.get(key, (None, None))
    if (cached is None or folder_hash(encoder.model) != cached.encoder.files_hash
            or heads != loaded_heads):
        torch.set_grad_enabled(False)
        cached = Embedder(encoder, poolers)
        _CACHE[key] = cached, heads
    return cached


def _head_digests(poolers: Sequence[PoolerSpec]) -> list[list[str]]:
    """The SHA-256 of each learned head's two files, as they are now."""
    from pipeline.head_files import head_file_digests

    return [head_file_digests(p.head) for p in poolers if p.head is not None]
