"""Invariants of the pure planning code: windows, token-budget batches, padded rows."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from pipeline.batching import UNPADDED_PADDED_BUDGETS, padding_efficiency, token_budget_batches
from pipeline.onednn import product_rows
from pipeline.token_rows import TokenRows, pad_rows
from pipeline.windows import truncate, window_starts, windows

lengths_st = st.lists(st.integers(min_value=0, max_value=400), min_size=0, max_size=60)


@given(lengths_st, st.integers(1, 64), st.integers(1, 64))
def test_windows_cover_every_token_in_order(lengths: list[int], content: int, stride: int) -> None:
    stride = min(stride, content)
    pieces = windows(np.array(lengths, dtype=np.int64), content, stride)
    assert sorted(set(pieces.row.tolist())) == list(range(len(lengths)))
    for row, length in enumerate(lengths):
        mine = pieces.row == row
        starts, ends = pieces.start[mine], pieces.end[mine]
        assert np.all(np.diff(starts) > 0), "windows of a row come in order"
        assert np.all(ends - starts <= content)
        assert starts[0] == 0 and ends[-1] == length, "first starts at 0, last ends at the end"
        covered = np.zeros(length, dtype=bool)
        for s, e in zip(starts, ends, strict=True):
            covered[s:e] = True
        assert covered.all()
        if length > content:
            assert np.all(ends - starts == content), "no short window when the text is long"


@given(st.integers(0, 5000), st.integers(1, 512), st.integers(1, 512))
def test_window_count_is_minimal_for_stride(length: int, content: int, stride: int) -> None:
    stride = min(stride, content)
    starts = window_starts(length, content, stride)
    assert len(starts) == (1 if length <= content else -(-(length - content) // stride) + 1)


@given(lengths_st, st.integers(1, 300))
def test_truncate_keeps_one_piece_per_row(lengths: list[int], content: int) -> None:
    pieces = truncate(np.array(lengths, dtype=np.int64), content)
    assert pieces.row.tolist() == list(range(len(lengths)))
    assert pieces.lengths.tolist() == [min(n, content) for n in lengths]


@given(
    st.lists(st.integers(1, 600), min_size=0, max_size=200),
    st.integers(1, 4096),
    st.integers(1, 64),
)
def test_batches_hold_every_index_once_within_budget(
    lengths: list[int], budget: int, max_rows: int
) -> None:
    arr = np.array(lengths, dtype=np.int64)
    batches = token_budget_batches(arr, budget, max_rows)
    flat = np.concatenate(batches) if batches else np.array([], dtype=np.int64)
    assert sorted(flat.tolist()) == list(range(len(lengths)))
    for batch in batches:
        assert 1 <= len(batch) <= max_rows
        assert len(batch) == 1 or len(batch) * arr[batch].max() <= budget
    longest = [int(arr[b].max()) for b in batches]
    assert longest == sorted(longest, reverse=True), "batches go from long to short"
    if lengths:
        assert 0 < padding_efficiency(arr, batches) <= 1.0


@given(st.integers(0, 1 << 20))
def test_product_rows_cover_the_rows_from_a_short_ladder(rows: int) -> None:
    padded = product_rows(rows)
    assert padded >= rows and padded == product_rows(padded), "a size of the ladder"
    assert padded <= max(16, 2 * rows - 1), "a power of two up to 1,024"
    if rows > 1024:
        assert padded - rows < max(1024, rows // 4), "then steps of 1,024 or an 8th octave"


def test_product_rows_take_fourteen_sizes_up_to_8192() -> None:
    sizes = {product_rows(rows) for rows in range(8193)}
    assert len(sizes) == 14 and max(sizes) == 8192
    assert product_rows(10) == 16 and product_rows(6145) == 7168


@given(
    st.lists(st.integers(1, 300), min_size=0, max_size=300),
    st.sampled_from([2048, 4096, 8192, 5000]),
    st.integers(1, 300),
    st.sampled_from([0.0, 0.9]),
)
def test_shaped_batches_fill_their_product_rows(
    lengths: list[int], budget: int, max_rows: int, min_fill: float
) -> None:
    """With a shape, a batch takes rows past max_rows and past its min_fill cut only while its
    padded tokens stay within the product rows the cut batch takes anyway, and the budget; and
    fills those rows: fewer than one of its rows' worth is left to zeros (where the budget and
    the texts left allow)."""
    arr = np.array(lengths, dtype=np.int64)
    batches = token_budget_batches(arr, budget, max_rows, min_fill, shape=product_rows)
    flat = np.concatenate(batches) if batches else np.array([], dtype=np.int64)
    assert sorted(flat.tolist()) == list(range(len(lengths)))
    left = len(lengths)
    for batch in batches:
        left -= len(batch)
        longest = int(arr[batch].max())
        padded = len(batch) * longest
        assert len(batch) == 1 or padded <= budget
        cut = min(max_rows, budget // longest) or 1  # the rows before the min_fill cut
        if min_fill:
            ordered = np.sort(arr[batch])[::-1]
            means = np.cumsum(ordered) / np.arange(1, len(batch) + 1)
            cut = min(cut, max(1, int((means >= min_fill * longest).sum())))
        computed = product_rows(cut * longest)
        assert padded <= max(computed, longest)
        if left and computed <= budget:
            assert computed - padded < longest, "the product rows left to zeros"
    assert token_budget_batches(arr, budget, max_rows, min_fill, shape=lambda n: n) == [] or all(
        np.array_equal(a, b) for a, b in zip(
            token_budget_batches(arr, budget, max_rows, min_fill, shape=lambda n: n),
            token_budget_batches(arr, budget, max_rows, min_fill), strict=True))


@given(
    st.lists(st.integers(min_value=1, max_value=300), min_size=1, max_size=80),
    st.integers(1, 4096), st.integers(1, 64), st.sampled_from([0, 100, 1 << 30]),
    st.booleans(),
)
def test_batches_of_real_tokens_alone_count_those(
    lengths: list[int], budget: int, max_rows: int, unpadded_below: int, shaped: bool
) -> None:
    """A batch whose longest row is under ``unpadded_below`` holds at most ``budget`` real
    tokens (or one row) and ``max_rows`` rows, then with a shape the rows whose tokens fit the
    product rows its cut takes anyway, within the budget, and its padded tokens (its states
    come back padded) within ``UNPADDED_PADDED_BUDGETS`` budgets; a wider one is planned
    padded, of rows no shorter than ``unpadded_below``; every row once, longest first."""
    arr = np.array(lengths, dtype=np.int64)
    shape = product_rows if shaped else None
    batches = token_budget_batches(arr, budget, max_rows, shape=shape,
                                   unpadded_below=unpadded_below)
    flat = np.concatenate(batches)
    assert sorted(flat.tolist()) == list(range(len(lengths)))
    assert np.all(np.diff(arr[flat]) <= 0)
    for batch in batches:
        tokens, longest = int(arr[batch].sum()), int(arr[batch].max())
        if longest >= unpadded_below:
            assert len(batch) == 1 or len(batch) * longest <= budget
            assert int(arr[batch].min()) >= unpadded_below  # a short row never runs padded
            continue
        assert len(batch) == 1 or tokens <= budget
        assert len(batch) == 1 or len(batch) * longest <= UNPADDED_PADDED_BUDGETS * budget
        cut = np.cumsum(arr[batch])[: max_rows]
        cut = cut[cut <= budget]
        computed = product_rows(int(cut[-1])) if shaped and len(cut) else 0
        assert len(batch) <= max(max_rows, 1) or tokens <= computed


def test_sorting_by_length_wastes_little_padding() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 250, size=5000)
    batches = token_budget_batches(lengths, 8192, 256)
    assert padding_efficiency(lengths, batches) > 0.95


@st.composite
def pieces_of_texts(draw):
    """Texts of ids, then pieces: a text, how many leading ids are its prompt, a slice after."""
    texts = draw(st.lists(st.lists(st.integers(5, 999), max_size=30), min_size=1, max_size=12))
    pieces = []
    for _ in range(draw(st.integers(1, 20))):
        row = draw(st.integers(0, len(texts) - 1))
        lead = draw(st.integers(0, len(texts[row])))
        start = draw(st.integers(0, len(texts[row]) - lead))
        end = draw(st.integers(start, len(texts[row]) - lead))
        pieces.append((row, lead, start, end))
    return texts, pieces


@given(pieces_of_texts(), st.lists(st.integers(1, 4), max_size=2),
       st.lists(st.integers(1, 4), max_size=2))
def test_padded_rows_are_prefix_prompt_slice_suffix_then_padding(
    drawn, prefix: list[int], suffix: list[int]
) -> None:
    texts, pieces = drawn
    rows, lead, start, end = (np.array(column) for column in zip(*pieces, strict=True))
    ids, mask = pad_rows(TokenRows.from_lists(texts), rows, lead, start, end, prefix, suffix, 0)
    expected = [prefix + texts[r][:k] + texts[r][k + s : k + e] + suffix
                for r, k, s, e in pieces]
    assert ids.shape == (len(pieces), max(map(len, expected)))
    for got, keep, want in zip(ids.tolist(), mask.tolist(), expected, strict=True):
        assert got == want + [0] * (len(got) - len(want))
        assert keep == [True] * len(want) + [False] * (len(got) - len(want))


def test_batch_limits_are_the_jobs_else_the_devices_and_a_gpus_shrink_with_width() -> None:
    import torch

    from pipeline.batching import SLICE_ROWS, slice_rows
    from pipeline.config import EncoderConfig
    from pipeline.encoder import BATCH_LIMITS, CPU_ACTIVATION_BYTES, batch_limits

    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # a device name needs no GPU
    job = EncoderConfig()
    tokens, rows = BATCH_LIMITS["cpu"]
    assert 1536 * tokens * 2 <= CPU_ACTIVATION_BYTES  # MiniLM in bf16: the whole budget
    for dtype in ("bf16", "int8"):
        assert batch_limits(job, cpu, 384, 1536, dtype) == (tokens, rows)
        assert batch_limits(job, cpu, 32, 64, dtype) == (tokens, rows)  # never above it
    # twice the bytes a token: half the tokens and rows (BERT-base in bf16, MiniLM in fp32)
    assert batch_limits(job, cpu, 384, 1536, "fp32") == (tokens // 2, rows // 2)
    assert batch_limits(job, cpu, 768, 3072, "bf16") == (tokens // 2, rows // 2)
    assert batch_limits(job, cpu, 768, 3072, "fp32") == (tokens // 4, rows // 4)
    assert batch_limits(job, cpu, 10**4, 10**9, "fp32")[1] == 1  # at least a row
    tokens, rows = BATCH_LIMITS["cuda"]
    for dtype in ("bf16", "fp16", "fp32"):
        assert batch_limits(job, cuda, 384, 1536, dtype) == (tokens, rows)
    assert batch_limits(job, cuda, 1024, 4096, "bf16") == (tokens * 384 // 1024, rows)
    assert batch_limits(job, cuda, 10**6, 10**6, "bf16")[0] == BATCH_LIMITS["cpu"][0]
    mine = EncoderConfig(token_budget=5000, max_batch_rows=70)
    assert batch_limits(mine, cuda, 1024, 4096, "bf16") == (5000, 70)
    assert batch_limits(mine, cpu, 768, 3072, "fp32") == (5000, 70)
    # a slice holds a few batches' rows, never fewer than SLICE_ROWS texts
    assert slice_rows(BATCH_LIMITS["cpu"][1]) == SLICE_ROWS
    assert slice_rows(rows) == 4 * rows
