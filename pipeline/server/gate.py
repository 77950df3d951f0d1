"""Admission control: ``workers`` requests run (in a thread pool), ``queue`` more wait.

A request arriving when both are full gets 429 at once; one that has waited
``queue_timeout_s`` for a worker gets 503 then, however long the busy workers still run. Both
carry ``Retry-After``. Memory stays flat under any load because nothing beyond
``workers + queue`` requests is ever held (a cancelled request counts until its search ends).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class Busy(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


class Gate:
    def __init__(self, workers: int, queue: int, queue_timeout_s: float) -> None:
        self.limit = workers + queue
        self.pending = 0  # running + waiting: the queue depth /metrics reports
        self.timeout_s = queue_timeout_s
        self.slots = asyncio.Semaphore(workers)  # binds to the server's loop on first use
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="search")

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on a worker thread, or ``Busy`` when the server is full."""
        if self.pending >= self.limit:
            raise Busy(429, f"server busy: {self.limit} requests in progress or queued")
        self.pending += 1
        try:
            await self._slot()
        except BaseException:  # 503, or the request was cancelled while it waited
            self.pending -= 1
            raise
        return await self._on_worker(fn, args)

    async def _slot(self) -> None:
        """Take a worker slot, waiting at most ``timeout_s``, else ``Busy`` (503).

        The wait is cancelled in this task (``asyncio.timeout``, no inner task), so
        ``Semaphore.acquire`` gives back a slot it was granted as it was cancelled: a wait that
        timed out, or a request cancelled while waiting, holds no slot.
        """
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.slots.acquire()
        except TimeoutError:
            raise Busy(503, f"waited over {self.timeout_s:g}s for a search worker") from None

    async def _on_worker(self, fn: Callable[..., Any], args: tuple) -> Any:
        """``fn(*args)`` in the pool; its slot and its place are freed once, when the thread is
        done. A request cancelled meanwhile leaves both held while its search still runs, so
        ``workers`` bounds the threads at work and queued requests wait in ``_slot`` (with its
        timeout), never in the pool's own queue."""
        try:
            future = asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        except BaseException:  # the pool is shut down: no thread will finish
            self._finished()
            raise
        future.add_done_callback(lambda _: self._finished())
        return await asyncio.shield(future)

    def _finished(self) -> None:
        self.slots.release()
        self.pending -= 1
