"""Retrieval quality of sets on labelled queries: recall@1, recall@10, MRR@10, nDCG@10.

The queries file is Parquet with columns ``query`` and ``doc_id``; several rows with the same
query give it several relevant documents. Relevance is binary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pyarrow as pa
from pydantic import BaseModel

from pipeline import storage
from pipeline.errors import CorpusError

METRICS = ("recall@1", "recall@10", "mrr@10", "ndcg@10")


class SetScores(BaseModel):
    set: str
    queries: int
    k: int
    scores: dict[str, float]


def load_queries(url: str) -> dict[str, list]:
    """{query: [relevant doc ids]} from a Parquet file of (query, doc_id) rows."""
    table = storage.read_parquet(url)
    missing = [c for c in ("query", "doc_id") if c not in table.column_names]
    if missing:
        raise CorpusError(
            f"{url} has no column {', '.join(missing)} (its columns: "
            f"{', '.join(table.column_names)})"
        )
    relevant: dict[str, list] = {}
    for query, doc in zip(table.column("query").to_pylist(), table.column("doc_id").to_pylist(),
                          strict=True):
        if not isinstance(query, str) or not query.strip() or doc is None:
            continue
        relevant.setdefault(query, [])
        if doc not in relevant[query]:
            relevant[query].append(doc)
    if not relevant:
        raise CorpusError(f"{url} has no rows with a non-empty query and a doc_id")
    return relevant


def recall_at(ranked: Sequence, relevant: set, k: int) -> float:
    return len(set(ranked[:k]) & relevant) / len(relevant) if relevant else 0.0


def mrr_at(ranked: Sequence, relevant: set, k: int) -> float:
    for i, doc in enumerate(ranked[:k]):
        if doc in relevant:
            return 1.0 / (i + 1)
    return 0.0


def ndcg_at(ranked: Sequence, relevant: set, k: int) -> float:
    dcg = sum(1.0 / math.log2(i + 2) for i, d in enumerate(ranked[:k]) if d in relevant)
    ideal = sum(1.0 / math.log2(i + 2) for i in range(min(len(relevant), k)))
    return dcg / ideal if ideal else 0.0


def score_rankings(rankings: Sequence[Sequence], relevant: Sequence[set],
                   k: int = 10) -> dict[str, float]:
    """Mean metrics over queries; ``rankings[i]`` are the ids returned for query i."""
    n = len(rankings)
    if n == 0:
        return dict.fromkeys(METRICS, 0.0)
    sums = dict.fromkeys(METRICS, 0.0)
    for ranked, rel in zip(rankings, relevant, strict=True):
        sums["recall@1"] += recall_at(ranked, rel, 1)
        sums["recall@10"] += recall_at(ranked, rel, k)
        sums["mrr@10"] += mrr_at(ranked, rel, k)
        sums["ndcg@10"] += ndcg_at(ranked, rel, k)
    return {m: round(v / n, 6) for m, v in sums.items()}


def evaluate_set(searcher, relevant: dict[str, list], k: int = 10,
                 batch: int = 256) -> SetScores:
    """Search every query with ``searcher`` (a pipeline.search.Searcher) and score it."""
    queries = list(relevant)
    id_type = searcher.handle.idmap.ids.type
    rankings = []
    for start in range(0, len(queries), batch):
        hits = searcher.search(queries[start:start + batch], k, snippets=False)
        rankings += [[h.id for h in row] for row in hits]
    wanted = [set(_as_type(relevant[q], id_type)) for q in queries]
    return SetScores(set=searcher.name, queries=len(queries), k=k,
                     scores=score_rankings(rankings, wanted, k))


def _as_type(ids: list, id_type: pa.DataType) -> list:
    """doc ids as the set's id type (a file of string ids for an int64 set, and so on)."""
    try:
        return pa.array(ids).cast(id_type).to_pylist()
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        raise CorpusError(f"doc_id values such as {ids[0]!r} are not of the set's id type "
                          f"{id_type}") from None


def table(results: list[SetScores]) -> str:
    """A plain-text table: one row per set, one column per metric."""
    head = f"{'set':<24}{'queries':>9}" + "".join(f"{m:>11}" for m in METRICS)
    rows = [f"{r.set:<24}{r.queries:>9}" + "".join(f"{r.scores[m]:>11.4f}" for m in METRICS)
            for r in results]
    return "\n".join([head, *rows])


def plot(results: list[SetScores], path: str) -> None:
    """A grouped bar chart of the metrics per set, as PNG (headless matplotlib)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(METRICS) * max(len(results), 1) / 2), 4))
    width = 0.8 / max(len(results), 1)
    for i, r in enumerate(results):
        xs = [j + i * width for j in range(len(METRICS))]
        ax.bar(xs, [r.scores[m] for m in METRICS], width, label=r.set)
    ax.set_xticks([j + width * (len(results) - 1) / 2 for j in range(len(METRICS))], METRICS)
    ax.set_ylim(0, 1)
    ax.set_ylabel("score")
    ax.legend()
    ax.set_title("retrieval quality by set")
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    storage.write_bytes(path, buf.getvalue())
