"""Searching a set: its own embedder encodes the queries, its published index answers.

The encoder and pooler come from the set's ``_SET.json`` (``get_embedder(EncoderConfig(
**meta['encoder']), [PoolerSpec(**meta['pooler'])])``), and the embedder's fingerprint is
checked against both the set's and the index's, so a query can never be encoded by a model
or pooler other than the one that made the vectors it is compared with.

What ``_SET.json`` cannot choose: ``trust_remote_code`` comes only from the caller (the
operator's ``--trust-remote-code``), and a model that would need it is refused before
transformers sees it; snippets come only from a corpus that ``SnippetStore.check`` finds to
hold the set's ids (``snippet_note`` says why there are none).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel

from pipeline.config import EncoderConfig, PoolerSpec, parse
from pipeline.corpus import blank
from pipeline.errors import ConfigError, FingerprintError, StorageError, TokenLimitError
from pipeline.index import (
    IndexMeta,
    holds_set_vectors,
    index_url,
    list_sets,
    open_index,
    read_meta,
)
from pipeline.models.hashing import int8_kernel_of
from pipeline.ranking import check_k
from pipeline.sets import SetFolder, SetMeta
from pipeline.snippets import SnippetStore
from pipeline.vectors import unit_rows


class Hit(BaseModel):
    rank: int
    id: int | str | float | None
    score: float
    snippet: str | None = None


def pick_set(out: str, name: str | None) -> str:
    """``name``, or the only indexed set under OUT when it is None (an empty name is refused
    as a set name, never taken for none)."""
    if name is not None:
        return name
    indexed = [s for s in list_sets(out) if read_meta(out, s) is not None]
    if len(indexed) == 1:
        return indexed[0]
    if not indexed:
        sets = list_sets(out)
        hint = f"; build one with `embedpipe index {out}`" if sets else ""
        raise StorageError(f"no indexed sets under {out} (sets: {', '.join(sets) or 'none'}){hint}")
    raise StorageError(f"{out} has several indexed sets ({', '.join(indexed)}): name one "
                       "(--set NAME; set_name= in Python)")


def check_queries(queries: Sequence[object]) -> list[str]:
    """``queries`` as a list when each is text the tokenizer reads: a string, not blank, valid
    Unicode (a lone surrogate is what a command line's bytes that were not UTF-8 become), else
    one line naming the first that is not."""
    for i, text in enumerate(queries):
        if not isinstance(text, str):
            raise ConfigError(f"query {i} is {type(text).__name__}, not text")
        if blank(text):
            raise ConfigError(f"query {i} is empty or whitespace (no visible character)")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ConfigError(f"query {i} is not valid text at character {exc.start} "
                              "(bytes that are not UTF-8?)") from None
    return list(queries)


class QueryEncoder:
    """A set's own model and pooler, checked against the set's fingerprint, for queries.

    ``trust_remote_code`` is the operator's choice, never the set's (the model loader refuses
    a folder that would run its own code unless it is given).
    """

    def __init__(self, info: SetMeta, device: str | None = None,
                 trust_remote_code: bool = False) -> None:
        from pipeline.embedder import get_embedder

        self.info = info
        stored = {**info.encoder, "trust_remote_code": trust_remote_code}
        if device:
            stored["device"] = device
        made_by = int8_kernel_of(info.model_hash)
        if made_by:  # the int8 kernel that made the set (auto might pick the other one here)
            stored["int8_kernel"] = made_by
        encoder = parse(EncoderConfig, stored, f"encoder of set {info.name!r}")
        spec = parse(PoolerSpec, info.pooler, f"pooler of set {info.name!r}")
        self.embedder = get_embedder(encoder, [spec])
        _ = self.embedder.encoder.query_prompt  # one with no room fails here, at the load
        made = self.embedder.fingerprint(spec.name)
        if made != info.fingerprint:
            raise FingerprintError(
                f"set {info.name!r} was made with fingerprint {info.fingerprint} but its "
                f"model and pooler load as {made} now (its model files or pooling head "
                "changed since?); re-embed the set"
            )
        _check_comparison(info, self.embedder.info.similarity, spec.normalize)
        self.lock = threading.Lock()  # one forward pass at a time per model

    def encode(self, queries: list[str]) -> np.ndarray:
        """The queries' vectors as search compares them (unit length for ``unit_search``)."""
        with self.lock:
            vectors = self.embedder.encode_queries(queries, self.info.pooler.get("name"))
        return unit_rows(vectors) if self.info.unit_search else vectors


def _check_comparison(info: SetMeta, similarity: str, normalize: bool) -> None:
    """How the set says its vectors compare (``similarity``, ``normalize``: which metric and
    scaling search and its index use) is how its model and pooler compare them: neither is in
    the fingerprint, so an edited ``_SET.json`` would otherwise rank by another measure
    without a word. A set recorded before embedpipe kept its similarity is taken as it is."""
    recorded = (info.similarity or similarity, info.normalize)
    if recorded != (similarity, normalize):
        raise FingerprintError(
            f"set {info.name!r}: its _SET.json says similarity {recorded[0]} with normalize "
            f"{str(info.normalize).lower()}, its model and pooler compare by {similarity} with "
            f"normalize {str(normalize).lower()} (_SET.json edited?); restore it, or re-embed "
            "the set"
        )


class Searcher:
    """One set, loaded once: embedder, index, id map and (if checked) the corpus for snippets.

    ``trust_remote_code`` is the operator's choice, never the set's; ``corpus`` overrides the
    one recorded in ``_SET.json``; ``snippets=False`` skips the corpus (evaluation).
    """

    def __init__(self, out: str, set_name: str | None = None, device: str | None = None,
                 corpus: str | None = None, trust_remote_code: bool = False,
                 snippets: bool = True, previous: Searcher | None = None) -> None:
        """``previous``: the same set loaded earlier; its model (same fingerprint) and its index
        (same published token) are reused, so a reload reads only what changed."""
        if corpus is not None and not corpus.strip():  # not the recorded one: a mistake
            raise ConfigError("corpus (--corpus) is empty: give the corpus to take snippets "
                              "from, or leave it out for the one recorded in _SET.json")
        self.out, self.corpus, self.device = out, corpus, device
        self.trust_remote_code, self.with_snippets = trust_remote_code, snippets
        self.name = pick_set(out, set_name)
        self.set = SetFolder(out, self.name).meta()
        meta = read_meta(out, self.name)
        if meta is None:
            raise StorageError(
                f"set {self.name!r} has no index under {index_url(out, self.name)}; build it "
                f"with `embedpipe index {out} --set {self.name}`"
            )
        self.meta: IndexMeta = meta
        holds_set_vectors(meta, self.set, out)
        same_model = previous is not None and previous.set.fingerprint == self.set.fingerprint
        self.queries = (previous.queries if same_model
                        else QueryEncoder(self.set, device, trust_remote_code))
        self.embedder = self.queries.embedder
        same_index = same_model and previous.meta.token == meta.token
        self.handle = previous.handle if same_index else open_index(out, meta)
        self.snippets: SnippetStore | None = None
        self.snippet_note: str | None = None
        if snippets:
            self.snippets, self.snippet_note = self._snippets(corpus, previous)

    def _snippets(self, corpus: str | None, previous: Searcher | None = None
                  ) -> tuple[SnippetStore | None, str | None]:
        """A checked corpus for snippets, or None and the one-line reason there is none. The
        corpus ``previous`` checked for this very set serves on unchecked (a reload reads no
        corpus footers again)."""
        source = corpus or self.set.corpus
        if not source:
            return None, f"set {self.name!r} records no corpus: pass --corpus for snippets"
        store = SnippetStore(source, self.set.id_column, self.set.text_column)
        if (previous is not None and previous.snippets is not None
                and previous.snippets.corpus == source and previous.set.token == self.set.token):
            return store, None
        problem = store.check(self._ids_in_the_set())
        if problem:
            return None, f"no snippets for set {self.name!r}: {problem}"
        return store, None

    def _ids_in_the_set(self) -> pa.Array:
        """The index's ids that are still the set's: those a run deleted since the index was
        built are not in the corpus either, and a stale index's sample of them failed the
        corpus check (every hit lost its snippet, the corpus named as not the set's)."""
        ids = self.handle.idmap.ids
        if self.set.token != self.meta.set_token:
            return ids
        changes = SetFolder(self.out, self.name).changes_since(self.meta.generation, self.set)
        deleted = [i for change in changes or [] for i in change.deleted_ids]
        if not deleted:
            return ids
        return ids.filter(pc.invert(pc.is_in(ids, value_set=pa.array(deleted, ids.type))))

    def notes(self) -> list[str]:
        """What a caller should know of the answers so far, one line each: why there are no
        snippets, the hits whose text the corpus no longer holds, an index older than its
        set (the CLI prints them, the Python API warns them)."""
        notes = [self.snippet_note] if self.snippet_note else []
        if self.snippets is not None and self.snippets.problem:
            notes.append(self.snippets.problem)
        if self.stale:
            notes.append(f"set {self.name!r} changed since it was indexed; run "
                         f"`embedpipe index {self.out} --set {self.name}`")
        return notes

    @property
    def stale(self) -> bool:
        """The set has changed since the index was built: a new generation, or the set was
        removed and made again (another token); `embedpipe index` brings the index up to date."""
        now = SetFolder(self.out, self.name).meta()
        return now.token != self.meta.set_token or now.generation != self.meta.generation

    def reloaded(self) -> Searcher:
        """This set as published now, reusing this one's model and (if unchanged) index."""
        return Searcher(self.out, self.name, self.device, self.corpus, self.trust_remote_code,
                        self.with_snippets, previous=self)

    def embed(self, texts: list[str], truncate: bool = True) -> tuple[np.ndarray, int]:
        """The set's own vectors for ``texts`` (as `embed` wrote them) and the tokens read;
        ``truncate`` False refuses a text longer than the model's rows (TEI's ``truncate``)."""
        with self.queries.lock:
            tokens = self.embedder.tokenize(list(texts))
            long = [] if truncate else np.flatnonzero(self.embedder.truncated(tokens))
            if len(long):  # planned here only where asked: encode_tokens plans its own
                raise TokenLimitError(
                    f"input {int(long[0])} is longer than {self.embedder.encoder.max_length} "
                    f"tokens, the most set {self.name!r} reads, and truncate is false"
                )
            batch = self.embedder.encode_tokens(list(range(len(texts))), tokens)
        return batch.vectors[self.set.pooler.get("name")], batch.stats.tokens

    def encode(self, queries: list[str]) -> np.ndarray:
        return self.queries.encode(queries)

    def search(self, queries: list[str], k: int = 10,
               snippets: bool = True) -> list[list[Hit]]:
        """Per query, the k best (id, score) with rank and snippet; best first."""
        k = check_k(k)
        queries = check_queries(queries)
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
