"""Retrieval quality of sets on labelled queries: recall@1, recall@k, MRR@k, nDCG@k.

The queries file is Parquet with columns ``query`` and ``doc_id``; several rows with the same
query give it several relevant documents. Relevance is binary. A set is searched either
exactly over its own vectors (so poolers are compared, not indexes; the default for sets that
fit in ``EXACT_MAX_BYTES``, and for sets without an index) or through its published index.
The metrics are ``pipeline.ranking``'s; the per-query ranks are a polars frame.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel

from pipeline import ranking, storage
from pipeline.corpus import arrow_id_type, blank
from pipeline.errors import ConfigError, CorpusError, EmbedpipeError, StorageError
from pipeline.sets import SetFolder, SetMeta, repeated_ids

EXACT_MAX_BYTES = 2 << 30  # sets up to this many bytes of vectors are scored exactly by default
SEARCH_BATCH = 256  # queries encoded and searched at once
T = TypeVar("T")


class SetScores(BaseModel):
    set: str
    queries: int
    k: int
    search: str  # "exact" (over the set's vectors) or "index" (its published FAISS index)
    scores: dict[str, float]
    unlabelled: int = 0  # rows of the queries file without a query or a doc_id: not scored
    absent: int = 0  # labelled (query, doc_id) pairs whose doc_id the set lacks: misses
    # a run wrote to the set after the last that finished (SetFolder.unfinished): it holds
    # other rows than the corpus's, and its scores are not comparable with a complete set's
    unfinished: bool = False
    stale: bool = False  # search "index": the set changed since its index was built


def load_queries(url: str) -> tuple[pl.DataFrame, int]:
    """Distinct (query, doc_id) rows with a non-blank query and a doc id, and how many rows
    lacked either (not scored). Each file of a folder or glob must have both columns."""
    frames = []
    for path in storage.expand_parquet(url):
        table = storage.read_parquet(path)
        missing = [c for c in ("query", "doc_id") if c not in table.column_names]
        if missing:
            raise CorpusError(
                f"{path} has no column {', '.join(missing)} (its columns: "
                f"{', '.join(table.column_names)})"
            )
        frame = _decoded(pl.from_arrow(table.select(["query", "doc_id"])))
        if frame.schema["query"] != pl.String:
            raise CorpusError(f"{path}: column query is {frame.schema['query']}, not text")
        if frame.schema["doc_id"].is_nested():
            raise CorpusError(f"{path}: column doc_id is {table.schema.field('doc_id').type}, "
                              "not ids (integers or text): one row per (query, doc_id)")
        frames.append(frame)
    try:
        every = pl.concat(frames, how="vertical_relaxed")
    except pl.exceptions.PolarsError:
        raise CorpusError(f"the files of {url} disagree on the type of doc_id") from None
    # a query with no visible character is none (corpus.blank, as a search and embed read
    # text): it was scored as the empty text by exact eval and refused by the index's
    visible = pl.col("query").map_elements(lambda text: not blank(text), return_dtype=pl.Boolean)
    labelled = every.filter(pl.col("query").is_not_null(), visible.fill_null(False),
                            pl.col("doc_id").is_not_null())
    if labelled.is_empty():
        raise CorpusError(f"{url} has no rows with a non-empty query and a doc_id")
    return labelled.unique(maintain_order=True), len(every) - len(labelled)


def _decoded(frame: pl.DataFrame) -> pl.DataFrame:
    """``frame`` with dictionary-encoded (Categorical or Enum) columns as plain strings, so that
    string operations and joins see the same type whichever way the file stored its text."""
    return frame.with_columns(pl.col(pl.Categorical, pl.Enum).cast(pl.String))


def evaluate_sets(out: str, queries: str, sets: Sequence[str] | None = None, k: int = 10,
                  exact: bool | None = None, ranks_out: str | None = None,
                  device: str | None = None, trust_remote_code: bool = False
                  ) -> list[SetScores]:
    """Score ``sets`` (default: every set under OUT) on a queries file; optionally write ranks.

    ``device`` and ``trust_remote_code`` are the operator's, for loading each set's model.
    """
    from pipeline.index import list_sets

    k = ranking.check_k(k)
    check_report_path(out, ranks_out, "ranks_out")
    relevant, unlabelled = load_queries(queries)
    names = list(dict.fromkeys(sets or list_sets(out)))
    if not names:
        raise StorageError(f"no sets under {out}; run `embedpipe embed` first")
    load = {"device": device, "trust_remote_code": trust_remote_code}
    scored = [_named(name, evaluate_set, out, name, relevant, k, exact, load) for name in names]
    if ranks_out:
        write_ranks([ranks for _, ranks in scored], ranks_out)
    return [scores.model_copy(update={"unlabelled": unlabelled}) for scores, _ in scored]


def _named(name: str, score: Callable[..., T], *args: object) -> T:
    """``score(*args)``, its refusal saying which set it is about (one set's missing head or
    model fails the whole eval; ``--set`` scores the others)."""
    try:
        return score(*args)
    except EmbedpipeError as exc:
        if f"set {name!r}" not in str(exc):
            exc.args = (f"set {name!r}: {exc}",)
        raise


def check_report_path(out: str, path: str | None, what: str) -> None:
    """A report file (ranks, plot) ``what`` names is written outside OUT: inside it, it could
    replace a set's or an index's own file; an empty path is refused, not taken for none."""
    if path is None:
        return
    if not path.strip():
        raise ConfigError(f"{what} is an empty path: give the file to write, or leave it out")
    if storage.is_under(path, out):
        raise ConfigError(f"{what} {path} lies inside OUT {out}: write reports elsewhere "
                          "(a file there could replace one of OUT's own)")
    if storage.is_dir(path):  # found before scoring, not after it
        raise ConfigError(f"{what} {path} is a folder: give the file to write")


def evaluate_set(out: str, name: str, relevant: pl.DataFrame, k: int = 10,
                 exact: bool | None = None, load: dict | None = None
                 ) -> tuple[SetScores, pl.DataFrame]:
    """Score one set: its mean metrics, and per relevant (query, doc_id) the rank it got.

    ``load``: keyword arguments for loading the set's model (``device``, ``trust_remote_code``).
    """
    load = load or {}
    folder = SetFolder(out, name)
    info = folder.meta()
    use_exact = choose_exact(out, info, exact)
    queries = relevant["query"].unique(maintain_order=True).to_list()
    stale = False
    if use_exact:
        found, ids = _exact_found(out, info, queries, k, load)
    else:
        found, ids, stale = _index_found(out, name, queries, k, load)
    wanted = relevant.rename({"doc_id": "doc"}).with_columns(
        doc=pl.from_arrow(_as_type(relevant["doc_id"].to_arrow(), ids.type)))
    absent = wanted.join(pl.DataFrame({"doc": pl.from_arrow(ids)}), on="doc", how="anti")
    ranks = ranking.ranks_of(found, wanted)
    per_query = ranking.per_query(ranks, k)
    search = "exact" if use_exact else "index"
    scores = SetScores(set=name, queries=len(queries), k=k, search=search,
                       scores=ranking.mean_scores(per_query, k), absent=absent.height,
                       unfinished=folder.unfinished(info), stale=stale)
    rows = ranks.rename({"doc": "doc_id"}).with_columns(  # doc_id typed as the set's ids
        set=pl.lit(name), search=pl.lit(search), k=pl.lit(k, pl.Int32))
    return scores, rows.select("set", "search", "k", "query", "doc_id", "rank")


def choose_exact(out: str, info: SetMeta, exact: bool | None) -> bool:
    """Exact when asked, when the set has no index, or (by default) when its vectors, as
    ``_SET.json`` counts them, fit in memory (the exact pass reads and checks the parts)."""
    from pipeline.index import read_meta

    if exact is not None:
        if not exact and read_meta(out, info.name) is None:
            raise StorageError(f"set {info.name!r} has no index to evaluate; run `embedpipe "
                               f"index {out} --set {info.name}` or use exact search")
        return exact
    if read_meta(out, info.name) is None:
        return True
    return info.rows_written * info.dim * 4 <= EXACT_MAX_BYTES


def _exact_found(out: str, info: SetMeta, queries: list[str], k: int,
                 load: dict) -> tuple[pl.DataFrame, pa.Array]:
    """(query, doc, rank) of exact top-k search over every vector of the set, and the set's
    ids."""
    from pipeline.index.exact import ExactTopK
    from pipeline.index.plan import BATCH_ROWS
    from pipeline.index.setdata import SetVectors
    from pipeline.search import QueryEncoder

    encoder = QueryEncoder(info, **load)
    vectors = np.concatenate([encoder.encode(queries[s:s + SEARCH_BATCH])
                              for s in range(0, len(queries), SEARCH_BATCH)])
    top = ExactTopK(vectors, k, info.metric)
    ids, offset = [], 0
    data = SetVectors.of(SetFolder(out, info.name), info)
    for batch_ids, batch_vectors in data.iter_batches(BATCH_ROWS):
        top.add(np.arange(offset, offset + len(batch_vectors)), batch_vectors)
        ids.append(batch_ids)
        offset += len(batch_vectors)
    repeated_ids(ids, info.name, out, then=", then eval")  # a doc would be found twice
    positions = top.result()
    every_id = pa.concat_arrays(ids) if ids else pa.array([], arrow_id_type(info.id_type))
    docs = pl.from_arrow(every_id)
    frame = pl.DataFrame({
        "query": np.repeat(np.asarray(queries, dtype=object), k).tolist(),
        "position": positions.reshape(-1),
        "rank": np.tile(np.arange(1, k + 1), len(queries)),
    }).filter(pl.col("position") >= 0)
    found = frame.with_columns(doc=docs.gather(frame["position"])).select("query", "doc", "rank")
    return found, every_id


def _index_found(out: str, name: str, queries: list[str], k: int,
                 load: dict) -> tuple[pl.DataFrame, pa.Array, bool]:
    """(query, doc, rank) of the set's published index, the ids it holds, and whether the
    set changed since it was built."""
    from pipeline.search import Searcher

    searcher = Searcher(out, name, snippets=False, **load)
    rankings = []
    for start in range(0, len(queries), SEARCH_BATCH):
        hits = searcher.search(queries[start:start + SEARCH_BATCH], k, snippets=False)
        rankings += [[h.id for h in row] for row in hits]
    found = ranking.found_frame(rankings, queries)
    ids = searcher.handle.idmap.ids
    typed = found.with_columns(doc=pl.from_arrow(_as_type(found["doc"].to_arrow(), ids.type)))
    return typed, ids, searcher.stale


def _as_type(ids: pa.Array, id_type: pa.DataType) -> pa.Array:
    """doc ids as the set's id type (a file of string ids for an int64 set, and so on); a
    value that is no id of that type is one line naming the first such value. Booleans are
    no ids (Arrow would take them for 0 and 1)."""
    if pa.types.is_boolean(ids.type):
        raise CorpusError(f"doc_id holds booleans, not ids of the set's id type {id_type}")
    try:
        typed = ids.cast(id_type)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        bad = next(v for v in ids.unique() if not _casts(v, id_type))
        raise CorpusError(f"doc_id value {bad.as_py()!r} is not of the set's id type "
                          f"{id_type}") from None
    if pa.types.is_string(ids.type) or pa.types.is_large_string(ids.type):
        # text read as a number must be that number's text: "01" is not the id 1
        other = pc.fill_null(pc.not_equal(typed.cast(ids.type), ids), False)
        if pc.any(other).as_py():
            at = pc.index(other, True).as_py()
            raise CorpusError(f"doc_id value {ids[at].as_py()!r} is not an id of the set's id "
                              f"type {id_type} (it reads as {typed[at].as_py()!r})")
    return typed


def _casts(value: pa.Scalar, id_type: pa.DataType) -> bool:
    try:
        value.cast(id_type)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return False
    return True


def write_ranks(frames: list[pl.DataFrame], url: str) -> None:
    """Every set's per-query ranks as one Parquet file (rank null: not in the top k); doc_id
    of the sets' id type (text where sets of different id types are written together)."""
    storage.write_parquet(url, pl.concat(frames, how="vertical_relaxed").to_arrow())


def table(results: list[SetScores]) -> str:
    """A plain-text table: one row per set, one column per metric, and the search used; a
    last line counts the queries file's rows that were not scored."""
    metrics = ranking.metric_names(results[0].k) if results else ()
    widths = [max(11, len(m) + 2) for m in metrics]
    head = f"{'set':<24}{'queries':>9}{'search':>8}" + "".join(
        f"{m:>{w}}" for m, w in zip(metrics, widths, strict=True))
    rows = [f"{r.set:<24}{r.queries:>9}{r.search:>8}"
            + "".join(f"{r.scores[m]:>{w}.4f}" for m, w in zip(metrics, widths, strict=True))
            for r in results]
    unlabelled = results[0].unlabelled if results else 0
    notes = [note for r in results for note in _notes(r)]
    if unlabelled:
        notes.append(f"({unlabelled} rows of the queries file without a query or a doc_id: "
                     "not scored)")
    return "\n".join([head, *rows, *notes])


def _notes(r: SetScores) -> list[str]:
    """What the table says under a set's row: why its scores may not compare with the
    others', and its labelled docs it could not find."""
    notes = []
    if r.unfinished:
        notes.append(f"(set {r.set}: a run wrote to it since the last one that finished: it "
                     "holds other rows than the corpus's, so its scores do not compare with a "
                     "complete set's; finish it with `embedpipe embed` or `backfill`)")
    if r.stale:
        notes.append(f"(set {r.set}: changed since its index was built, which was searched; "
                     "run `embedpipe index`, or score it exactly)")
    if r.absent:
        where = (f"the index of set {r.set}" if r.stale else f"set {r.set}")
        why = ("" if r.unfinished or r.stale
               else "; was the queries file made for this corpus?")
        notes.append(f"({r.absent} labelled doc_id(s) not in {where}: scored as misses{why})")
    return notes


def plot(results: list[SetScores], path: str) -> None:
    """A grouped bar chart of the metrics per set, as PNG (headless matplotlib)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = ranking.metric_names(results[0].k) if results else ()
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(metrics) * max(len(results), 1) / 2), 4))
    width = 0.8 / max(len(results), 1)
    for i, r in enumerate(results):
        xs = [j + i * width for j in range(len(metrics))]
        ax.bar(xs, [r.scores[m] for m in metrics], width, label=f"{r.set} ({r.search})")
    ax.set_xticks([j + width * (len(results) - 1) / 2 for j in range(len(metrics))], metrics)
    ax.set_ylim(0, 1)
    ax.set_ylabel("score")
    ax.legend()
    ax.set_title("retrieval quality by set")
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    storage.write_bytes(path, buf.getvalue())
