"""glibc's heap handed back to the OS once freed memory piles up (``pipeline.heap``)."""

from __future__ import annotations

import pytest

from pipeline import heap

pytestmark = pytest.mark.skipif(heap._libc() is None, reason="glibc's malloc_trim only")

MB = 1 << 20


def _fragment(blocks: int) -> list[bytes]:
    """``blocks`` 64 KiB heap blocks (under glibc's mmap threshold), each followed by a 1 KiB
    block that stays alive; the large ones are freed: resident, but unusable for the heap's
    top to shrink past the small ones."""
    big, keep = [], []
    for _ in range(blocks):
        big.append(bytearray(64 << 10))
        big[-1][::4096] = b"x" * len(big[-1][::4096])  # touched: resident
        keep.append(bytes(1024))  # over pymalloc's 512 bytes: from glibc's heap too
    del big
    return keep


def test_heapwatch_trims_only_past_its_slack():
    heap.release_freed_memory()  # what earlier tests freed: not counted here
    watch = heap.HeapWatch(slack=64 * MB)
    watch.after_batch()  # the first batch sets the limit
    assert watch.limit is not None and watch.trims == 0
    small = _fragment(256)  # ~16 MB freed: within the slack
    watch.after_batch()
    assert watch.trims == 0
    large = _fragment(2048)  # ~128 MB freed: past it
    before = heap.resident_bytes()
    watch.after_batch()
    after = heap.resident_bytes()
    assert watch.trims == 1 and watch.limit is None  # the next batch sets a new limit
    assert before - after > 64 * MB, (before, after)
    assert len(small) + len(large) == 256 + 2048


def test_resident_bytes_is_this_process_rss():
    import psutil

    assert abs(heap.resident_bytes() - psutil.Process().memory_info().rss) < 16 * MB
