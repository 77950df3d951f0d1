"""Recall, MRR and nDCG at a cut-off: the one implementation behind eval, index tuning and training.

Everything starts from a frame of *relevant* (query, doc) pairs with the 1-based ``rank`` at
which the search returned that doc (null when it did not). Relevance is binary:

- ``recall@k``: share of a query's relevant docs ranked within ``k``;
- ``mrr@k``: 1 / rank of its best-ranked relevant doc within ``k`` (0 if none);
- ``ndcg@k``: sum of 1/log2(rank + 1) over its relevant docs within ``k``, over the same sum
  for an ideal ranking (its relevant docs first).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import polars as pl

MAX_K = 1000  # the largest cut-off a search or an evaluation takes


DEFAULT_K = 10  # hits a search returns where its caller names no k


def check_k(k: int) -> int:
    """``k`` as an int when it is a cut-off search takes (1..``MAX_K``; any integer type, a
    numpy one too, but a bool), else one line saying so."""
    from numbers import Integral

    from pipeline.errors import ConfigError

    if isinstance(k, bool | np.bool_) or not isinstance(k, Integral) or not 1 <= k <= MAX_K:
        raise ConfigError(f"-k must be an integer between 1 and {MAX_K}, got {k!r}")
    return int(k)


def metric_names(k: int) -> tuple[str, ...]:
    """The metrics ``per_query`` and ``mean_scores`` give for cut-off ``k``, in table order."""
    first = () if k == 1 else ("recall@1",)
    return (*first, f"recall@{k}", f"mrr@{k}", f"ndcg@{k}")


def found_frame(rankings: Sequence[Sequence], queries: Sequence | None = None) -> pl.DataFrame:
    """``rankings[i]`` (the docs returned for query i, best first) as rows (query, doc, rank)."""
    keys = list(range(len(rankings))) if queries is None else list(queries)
    frame = pl.DataFrame({"query": keys, "doc": [list(r) for r in rankings]})
    return (frame.with_columns(rank=pl.int_ranges(1, pl.col("doc").list.len() + 1))
            .explode("doc", "rank").drop_nulls("doc"))


def ranks_of(found: pl.DataFrame, relevant: pl.DataFrame) -> pl.DataFrame:
    """Each relevant (query, doc) with the rank the search gave it (null: not returned)."""
    found = found.with_columns(pl.col("doc").cast(relevant.schema["doc"]))  # e.g. none found
    best = found.group_by("query", "doc").agg(pl.col("rank").min())
    return relevant.join(best, on=["query", "doc"], how="left")


def per_query(ranks: pl.DataFrame, k: int) -> pl.DataFrame:
    """One row per query: its metrics at ``k`` from (query, rank) rows of relevant docs."""
    within = pl.col("rank").is_not_null() & (pl.col("rank") <= k)
    ideal = pl.DataFrame({"n": np.arange(1, k + 1),
                          "ideal": np.cumsum(1.0 / np.log2(np.arange(2, k + 2)))})
    per = (
        ranks.group_by("query", maintain_order=True)
        .agg(
            relevant=pl.len(),
            top1=(pl.col("rank") == 1).sum(),
            hits=within.sum(),
            best=pl.col("rank").filter(within).min(),
            dcg=(1.0 / (pl.col("rank").filter(within).cast(pl.Float64) + 1).log(2)).sum(),
        )
        .with_columns(n=pl.min_horizontal(pl.col("relevant"), pl.lit(k)).cast(ideal["n"].dtype))
        .join(ideal, on="n", how="left", maintain_order="left")
    )
    columns = {
        "recall@1": pl.col("top1") / pl.col("relevant"),
        f"recall@{k}": pl.col("hits") / pl.col("relevant"),
        f"mrr@{k}": (1.0 / pl.col("best").cast(pl.Float64)).fill_null(0.0),
        f"ndcg@{k}": pl.col("dcg") / pl.col("ideal"),
    }
    return per.select("query", *(columns[m].alias(m) for m in metric_names(k)))


def mean_scores(table: pl.DataFrame, k: int, digits: int = 6) -> dict[str, float]:
    """The mean of each metric over the queries of a ``per_query`` table (0 when empty)."""
    if table.is_empty():
        return dict.fromkeys(metric_names(k), 0.0)
    means = table.select(pl.col(m).mean() for m in metric_names(k)).row(0, named=True)
    return {m: round(float(v), digits) for m, v in means.items()}


def score(ranks: pl.DataFrame, k: int) -> dict[str, float]:
    """Mean metrics at ``k`` over the queries of a (query, rank) frame of relevant docs."""
    return mean_scores(per_query(ranks, k), k)


def score_gold_ranks(ranks: np.ndarray, k: int) -> dict[str, float]:
    """Metrics when every query has exactly one relevant doc, found at ``ranks[i]`` (1-based)."""
    frame = pl.DataFrame({"query": np.arange(len(ranks)), "rank": np.asarray(ranks, np.int64)})
    return score(frame, k)


def recall_of_labels(found: np.ndarray, truth: np.ndarray, k: int) -> float:
    """Mean share of each query's true top-k labels within ``found[:, :k]`` (-1 = no result).
    ``truth``'s columns past k name rows that score as its k-th does (``ExactTopK.truth``):
    found, such a row counts as the true one it displaced (an exact index scored 0.991 for
    rows tied with the 10th within float rounding).

    Queries without any true label are left out; with none at all the recall is 1.
    """
    if not len(truth):
        return 1.0
    relevant = _label_frame(truth[:, :k]).drop("rank")
    if relevant.is_empty():
        return 1.0
    found = _ties_as_truth(found[:, :k], truth[:, :k], truth[:, k:])
    ranks = ranks_of(_label_frame(found), relevant)
    return score(ranks, k)[f"recall@{k}"]


def _ties_as_truth(found: np.ndarray, top: np.ndarray, tied: np.ndarray) -> np.ndarray:
    """``found`` with each label in a query's ``tied`` replaced by a true ``top`` label the
    query did not find (one for one)."""
    if not tied.size or (tied < 0).all():
        return found
    found = found.copy()
    for q in np.flatnonzero((tied >= 0).any(axis=1)):
        extra = set(tied[q][tied[q] >= 0].tolist())
        missing = [t for t in top[q].tolist() if t >= 0 and t not in set(found[q].tolist())]
        for j, label in enumerate(found[q].tolist()):
            if missing and label in extra:
                found[q, j] = missing.pop()
    return found


def _label_frame(labels: np.ndarray) -> pl.DataFrame:
    rows, cols = labels.shape
    frame = pl.DataFrame({
        "query": np.repeat(np.arange(rows), cols),
        "doc": labels.reshape(-1).astype(np.int64),
        "rank": np.tile(np.arange(1, cols + 1), rows),
    })
    return frame.filter(pl.col("doc") >= 0)
