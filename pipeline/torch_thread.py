"""The one thread of a process that loads models and runs their forward passes.

torch's CPU kernels run on libgomp's OpenMP threads, and every Python thread that starts a
parallel region keeps its own team of them for as long as it lives. Between regions those
threads spin a little before they sleep, which is what keeps a transformer's hundreds of short
kernels per batch fast; libgomp throttles that spinning to ~100 iterations once the process
holds more OpenMP threads than cores, i.e. as soon as a second Python thread has run a kernel.
Measured (MiniLM bf16, 2 cores, 3,300 texts): 4.9-5.1 s on the only thread that ever ran
torch, 5.8-6.2 s once the model had been loaded on another thread (a flow loads it on its main
thread, then encodes on a task thread). So the model load and every forward pass of a process
run here, whichever thread asks; the caller waits for the result (errors are raised in it).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

NAME = "embedpipe-torch"
OMP_SPINS = 10_000  # libgomp's spin count between kernels: ~0.1 ms


def spin_briefly() -> None:
    """Let torch's OpenMP threads (libgomp) spin ``OMP_SPINS`` times between kernels before
    they sleep. By default they spin ~300,000 times (milliseconds), which made small kernels
    many times slower when another process shared the cores (a 32-wide Linear 0.9 ms alone,
    22.7 ms beside a second spinning process; the Python API 10-25x slower than the CLI on a
    shared 2-core machine); never spinning (``OMP_WAIT_POLICY=PASSIVE``) made MiniLM's forward
    10-30% slower, as each of its hundreds of short kernels per batch then waits for a woken
    thread. libgomp reads this when torch loads it: the CLI and every API call set it first
    (a process that imported torch before keeps what it had). A user's own
    ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` wins."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", str(OMP_SPINS))


_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (pid that started it, its one thread)


def on_torch_thread(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)`` run on this process's torch thread (inline when already there)."""
    if threading.current_thread().name.startswith(NAME):
        return fn(*args, **kwargs)
    return _executor().submit(fn, *args, **kwargs).result()


def _executor() -> ThreadPoolExecutor:
    """The process's executor; a forked child (whose copy has no thread) starts its own."""
    global _pool
    with _lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix=NAME))
        return _pool[1]
