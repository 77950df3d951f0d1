"""Tokenizing in worker processes, so that a host can keep a GPU fed.

The fast tokenizer's Rust work runs in parallel, but turning its output into Python lists holds
the GIL, and the thread that launches the GPU's kernels needs the GIL too. On a 16-core H200
host (bench/gpu.py, MiniLM, 60,000 PyPI summaries) the forward passes alone ran ~300,000
docs/s while tokenizing in the process ran 150,000-225,000 docs/s, and a tokenizer thread
beside the encoder slowed its launches: end to end 50,000-69,000 docs/s. Here each worker
process holds its own single-threaded copy of the tokenizer, tokenizes a part of the texts and
sends back flat numpy ids and lengths; the caller only waits (without the GIL) and joins them.

Workers start from a fork server, on the first texts sent, and stop when the pool is garbage-
collected or the process exits.
"""

from __future__ import annotations

import multiprocessing
import os
import weakref
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np

from pipeline.errors import ModelError
from pipeline.token_rows import TokenRows

PART_TEXTS = 1024  # texts per task: small enough to spread a slice over every worker
MIN_TEXTS = 4096  # fewer texts are tokenized in the caller's process (no round trip)
MAX_WORKERS = 8


def pool_workers(device_type: str, cpus: int | None = None) -> int:
    """Tokenizer processes for an encoder on ``device_type``: none for a CPU encoder (the
    encoder's own threads use the cores) or a host of under 4 cores; else all cores but two
    (the encoder's launching thread and the caller's reader), at most ``MAX_WORKERS``."""
    cpus = cpus or os.cpu_count() or 1
    if device_type == "cpu" or cpus < 4:
        return 0
    return min(MAX_WORKERS, cpus - 2)


class TokenizerPool:
    """``workers`` processes, each with the tokenizer given as its JSON (``Tokenizer.to_str``)."""

    def __init__(self, tokenizer_json: str, workers: int) -> None:
        if workers < 1:
            raise ValueError("a tokenizer pool needs at least one worker")
        self.workers = workers
        context = _context()
        self._executor = ProcessPoolExecutor(workers, mp_context=context, initializer=_start,
                                             initargs=(tokenizer_json,))
        weakref.finalize(self, self._executor.shutdown, wait=False, cancel_futures=True)

    def encode(self, texts: list[str]) -> TokenRows:
        """Content ids of each text (no special tokens, no truncation), in input order."""
        parts = [texts[i : i + PART_TEXTS] for i in range(0, len(texts), PART_TEXTS)]
        try:
            results = list(self._executor.map(_encode, parts))
        except BrokenProcessPool as exc:
            raise ModelError(f"a tokenizer worker process died: {exc}") from None
        if not results:
            return TokenRows(np.zeros(0, np.int64), np.zeros(1, np.int64))
        lengths = np.concatenate([lengths for _, lengths in results])
        offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return TokenRows(np.concatenate([values for values, _ in results]), offsets)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


def _context():
    """A fork server (one fresh process that imports the caller's ``__main__`` and this
    module once, then forks each worker): workers start fast and are never forked from a
    process that holds a CUDA context and threads. As with any multiprocessing, a script's
    own work must sit under ``if __name__ == "__main__"``."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["__main__", __name__])
    return context


_TOKENIZER = None


def _start(tokenizer_json: str) -> None:
    global _TOKENIZER
    os.environ["RAYON_NUM_THREADS"] = "1"  # one thread per worker: the workers are the threads
    from tokenizers import Tokenizer

    _TOKENIZER = Tokenizer.from_str(tokenizer_json)
    _TOKENIZER.no_truncation()
    _TOKENIZER.no_padding()


def _encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    rows = TokenRows.from_lists(
        [e.ids for e in _TOKENIZER.encode_batch_fast(texts, add_special_tokens=False)])
    return rows.values, rows.lengths
