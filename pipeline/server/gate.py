"""Admission control: ``workers`` requests run (in a thread pool), ``queue`` more wait.

A request arriving when both are full gets 429 at once; one that waited longer than
``queue_timeout_s`` for a worker gets 503. Both carry ``Retry-After``. Memory stays flat under
any load because nothing beyond ``workers + queue`` requests is ever held.
"""

from __future__ import annotations

import asyncio
import time
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
            queued = time.perf_counter()
            async with self.slots:
                if time.perf_counter() - queued > self.timeout_s:
                    raise Busy(503, f"waited over {self.timeout_s:g}s for a search worker")
                loop = asyncio.get_running_loop()
                return await loop.run_in_executor(self.pool, fn, *args)
        finally:
            self.pending -= 1
