"""Pure planning of forward batches by token budget instead of a fixed row count.

Sorting by length and cutting when ``rows * longest`` would pass the budget keeps padding
small and the work per batch roughly constant, whatever the mix of short and long texts.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

SLICE_ROWS = 4096  # texts per encode call, at least, where the caller tokenizes ahead
# characters one slice tokenizes, at most (a single text may pass it): the fast tokenizer holds
# ~25 bytes per character it reads until its ids are copied out (200 texts of ~200 KB: +1 GB)
SLICE_CHARS = 32 << 20


def slice_rows(max_batch_rows: int) -> int:
    """Texts per encode call where the caller tokenizes the next slice meanwhile (a shard's
    reader thread, ``Embedder.encode``): smaller slices overlap sooner and hold less memory,
    but a slice of under a few batches' rows leaves a GPU's batches part-empty."""
    return max(SLICE_ROWS, 4 * max_batch_rows)


def slice_length(chars: np.ndarray, budget: int | None = None) -> int:
    """How many of the leading texts, whose tokenizer reads ``chars`` characters each, one
    slice takes: as many as stay within ``budget`` (``SLICE_CHARS``) characters, at least one."""
    budget = SLICE_CHARS if budget is None else budget
    within = np.searchsorted(np.cumsum(chars), budget, side="right")
    return max(1, min(int(within), len(chars)))


def text_lengths(texts: list[str]) -> np.ndarray:
    return np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))


# A batch of real tokens alone still returns its states padded ([rows, width, hidden]: what
# the poolers read), so its padded tokens stay within this many budgets. Unbounded, one long
# text among short ones made MiniLM's layer-mixing pooler peak at 1,765 MB (3,000 summaries
# and 60 long texts, bf16, AMX Xeon); 1,265 MB within two budgets, at the same speed.
UNPADDED_PADDED_BUDGETS = 2


def token_budget_batches(
    lengths: np.ndarray, token_budget: int, max_rows: int, min_fill: float = 0.0,
    shape: Callable[[int], int] | None = None, unpadded_below: int = 0,
) -> list[np.ndarray]:
    """Indices of ``lengths`` cut into batches, longest first.

    Each batch holds at most ``max_rows`` rows and at most ``token_budget`` padded tokens
    (``rows * longest``), except that a single row longer than the budget forms its own batch.
    With ``min_fill`` > 0 a batch also ends before its real tokens fall below ``min_fill`` of
    its padded tokens: on a CPU a padded token costs as much as a real one, while one more
    forward call costs about as much as a few dozen tokens. With ``shape`` (padded tokens ->
    the tokens the forward computes, ``pipeline.onednn.product_rows``), a batch then takes
    more rows, past ``max_rows`` and past that cut, up to the tokens ``shape`` gives the rows
    it has (within the budget): rows the forward computes anyway, now over texts instead of
    zeros. (Cut after that fill, 1,000 PyPI summaries through a DistilBERT of 4,096-token
    batches put 25% of its product rows on zeros or padding, against 12% filled after the cut.)
    A batch whose longest row is shorter than ``unpadded_below`` goes to a forward that
    computes its real tokens alone (``pipeline.token_layout``): its tokens, budget and shape
    count those, and its padding costs little (no ``min_fill`` cut) but memory (its padded
    tokens within ``UNPADDED_PADDED_BUDGETS`` budgets). A row shorter than ``unpadded_below``
    never joins a padded batch: its vector, computed by one kernel whatever its batch-mates,
    depends on the text alone (in bf16 and int8 too).
    """
    if token_budget <= 0 or max_rows <= 0:
        raise ValueError("token_budget and max_rows must be positive")
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-lengths, kind="stable")
    ordered = np.maximum(lengths[order], 1)
    batches: list[np.ndarray] = []
    start = 0
    while start < len(order):
        longest = int(ordered[start])
        if longest < unpadded_below:
            rows = _unpadded_rows(ordered[start:], token_budget, max_rows, shape)
            batches.append(order[start : start + rows])
            start += rows
            continue
        rows = max(1, min(max_rows, token_budget // longest))
        if min_fill > 0 and rows > 1:
            # rows sorted longest first: the running mean only falls as the batch grows
            head = ordered[start : start + rows]
            means = np.cumsum(head) / np.arange(1, len(head) + 1)
            rows = max(1, int(np.searchsorted(-means, -min_fill * longest, side="right")))
        if shape is not None:
            rows = max(rows, min(shape(rows * longest), token_budget) // longest)
        if unpadded_below:  # a row under it always runs unpadded, whatever its batch-mates
            rows = min(rows, max(1, int(np.searchsorted(-ordered[start:], -unpadded_below,
                                                        side="right"))))
        batches.append(order[start : start + rows])
        start += rows
    return batches


def _unpadded_rows(lengths: np.ndarray, token_budget: int, max_rows: int,
                   shape: Callable[[int], int] | None) -> int:
    """Rows of ``lengths`` (longest first) for a batch of real tokens alone: within the
    budget and ``max_rows``, then with ``shape``, the rows whose tokens fit the tokens it
    computes anyway; its padded tokens within ``UNPADDED_PADDED_BUDGETS`` budgets."""
    tokens = np.cumsum(lengths)
    rows = max(1, min(max_rows, int(np.searchsorted(tokens, token_budget, side="right"))))
    if shape is not None:
        fits = min(shape(int(tokens[rows - 1])), token_budget)
        rows = max(rows, int(np.searchsorted(tokens, fits, side="right")))
    return max(1, min(rows, UNPADDED_PADDED_BUDGETS * token_budget // int(lengths[0])))


def padding_efficiency(lengths: np.ndarray, batches: list[np.ndarray]) -> float:
    """Real tokens / padded tokens over the batches (1.0 means no padding at all)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    real = sum(int(lengths[b].sum()) for b in batches)
    padded = sum(int(lengths[b].max()) * len(b) for b in batches if len(b))
    return real / padded if padded else 1.0
