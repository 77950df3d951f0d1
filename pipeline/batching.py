"""Pure planning of forward batches by token budget instead of a fixed row count.

Sorting by length and cutting when ``rows * longest`` would pass the budget keeps padding
small and the work per batch roughly constant, whatever the mix of short and long texts.
"""

from __future__ import annotations

import numpy as np


def token_budget_batches(
    lengths: np.ndarray, token_budget: int, max_rows: int
) -> list[np.ndarray]:
    """Indices of ``lengths`` cut into batches, longest first.

    Each batch holds at most ``max_rows`` rows and at most ``token_budget`` padded tokens
    (``rows * longest``), except that a single row longer than the budget forms its own batch.
    """
    if token_budget <= 0 or max_rows <= 0:
        raise ValueError("token_budget and max_rows must be positive")
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-lengths, kind="stable")
    batches: list[np.ndarray] = []
    start = 0
    while start < len(order):
        longest = max(int(lengths[order[start]]), 1)
        rows = max(1, min(max_rows, token_budget // longest))
        batches.append(order[start : start + rows])
        start += rows
    return batches


def padding_efficiency(lengths: np.ndarray, batches: list[np.ndarray]) -> float:
    """Real tokens / padded tokens over the batches (1.0 means no padding at all)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    real = sum(int(lengths[b].sum()) for b in batches)
    padded = sum(int(lengths[b].max()) * len(b) for b in batches if len(b))
    return real / padded if padded else 1.0
