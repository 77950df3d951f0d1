"""Searching a set: its own embedder encodes the queries, its published index answers.

The encoder and pooler come from the set's ``_SET.json`` (``get_embedder(EncoderConfig(
**meta['encoder']), [PoolerSpec(**meta['pooler'])])``), and the embedder's fingerprint is
checked against both the set's and the index's, so a query can never be encoded by a model
or pooler other than the one that made the vectors it is compared with.
"""

from __future__ import annotations

import threading

import numpy as np
from pydantic import BaseModel

from pipeline.config import EncoderConfig, PoolerSpec
from pipeline.data import TextBatch
from pipeline.errors import FingerprintError, StorageError
from pipeline.index import IndexMeta, index_url, list_sets, open_index, read_meta, read_set
from pipeline.snippets import SnippetStore


class Hit(BaseModel):
    rank: int
    id: int | str | float | None
    score: float
    snippet: str | None = None


def pick_set(out: str, name: str | None) -> str:
    """``name``, or the only indexed set under OUT when none is given."""
    if name:
        return name
    indexed = [s for s in list_sets(out) if read_meta(out, s) is not None]
    if len(indexed) == 1:
        return indexed[0]
    if not indexed:
        sets = list_sets(out)
        hint = f"; build one with `embedpipe index {out}`" if sets else ""
        raise StorageError(f"no indexed sets under {out} (sets: {', '.join(sets) or 'none'}){hint}")
    raise StorageError(f"{out} has several indexed sets ({', '.join(indexed)}): pass --set NAME")


class Searcher:
    """One set, loaded once: embedder, index, id map and (if known) the corpus for snippets."""

    def __init__(self, out: str, set_name: str | None = None, device: str | None = None,
                 corpus: str | None = None, previous: Searcher | None = None) -> None:
        """``previous``: the same set loaded earlier; its model (same fingerprint) and its index
        (same published token) are reused, so a reload reads only what changed."""
        self.out, self.corpus, self.device = out, corpus, device
        self.name = pick_set(out, set_name)
        self.set = read_set(out, self.name)
        meta = read_meta(out, self.name)
        if meta is None:
            raise StorageError(
                f"set {self.name!r} has no index under {index_url(out, self.name)}; build it "
                f"with `embedpipe index {out} --set {self.name}`"
            )
        self.meta: IndexMeta = meta
        self._check_index()
        same_model = previous is not None and previous.set.fingerprint == self.set.fingerprint
        self.embedder = previous.embedder if same_model else self._embedder(device)
        self._lock = previous._lock if same_model else threading.Lock()  # one model, one lock
        same_index = same_model and previous.meta.token == meta.token
        self.handle = previous.handle if same_index else open_index(out, meta)
        corpus = corpus or self.set.corpus
        self.snippets = (SnippetStore(corpus, self.set.id_column, self.set.text_column)
                         if corpus else None)

    def _check_index(self) -> None:
        if self.meta.fingerprint != self.set.fingerprint or self.meta.dim != self.set.dim:
            raise FingerprintError(
                f"index {index_url(self.out, self.name)} was built from vectors of fingerprint "
                f"{self.meta.fingerprint} (dim {self.meta.dim}) but set {self.name!r} is now "
                f"{self.set.fingerprint} (dim {self.set.dim}); rebuild with "
                f"`embedpipe index {self.out} --set {self.name} --rebuild`"
            )

    def _embedder(self, device: str | None):
        from pipeline.embedder import get_embedder

        encoder = EncoderConfig(**self.set.encoder)
        if device:
            encoder = encoder.model_copy(update={"device": device})
        spec = PoolerSpec(**self.set.pooler)
        embedder = get_embedder(encoder, [spec])
        made = embedder.fingerprint(spec.name)
        if made != self.set.fingerprint:
            raise FingerprintError(
                f"set {self.name!r} was made with fingerprint {self.set.fingerprint} but its "
                f"model and pooler load as {made} now (model files changed?); re-embed the set"
            )
        return embedder

    @property
    def stale(self) -> bool:
        """The set has changed since the index was built (run `embedpipe index` to catch up)."""
        return read_set(self.out, self.name).generation > self.meta.generation

    def reloaded(self) -> Searcher:
        """This set as published now, reusing this one's model and (if unchanged) index."""
        return Searcher(self.out, self.name, self.device, self.corpus, previous=self)

    def embed(self, texts: list[str]) -> tuple[np.ndarray, int]:
        """The set's own vectors for ``texts`` (as `embed` wrote them) and the tokens read."""
        with self._lock:
            batch = self.embedder.embed(TextBatch(list(range(len(texts))), list(texts)))
        return batch.vectors[self.set.pooler.get("name")], int(batch.stats["tokens"])

    def encode(self, queries: list[str]) -> np.ndarray:
        with self._lock:  # one forward pass at a time per model
            return self.embedder.encode(queries, self.set.pooler.get("name"))

    def search(self, queries: list[str], k: int = 10,
               snippets: bool = True) -> list[list[Hit]]:
        """Per query, the k best (id, score) with rank and snippet; best first."""
        if not queries:
            return []
        found = self.handle.search(self.encode(queries), k)
        texts = {}
        if snippets and self.snippets is not None:
            texts = self.snippets.texts([i for hits in found for i, _ in hits])
        return [
            [Hit(rank=r + 1, id=i, score=s, snippet=texts.get(i)) for r, (i, s) in enumerate(h)]
            for h in found
        ]
