"""Stages of a shard that overlap: a producer runs ahead in a thread, behind a bounded queue.

``prefetch(items, depth)`` iterates ``items`` in a background thread and yields its values in
order, at most ``depth`` ahead of the consumer (so memory stays bounded whatever the input
size). An exception in the producer is raised in the consumer at the same position; closing
the consumer early (an error downstream) stops the producer at its next value. Reading and
tokenizing overlap the encoder this way: torch and the fast tokenizer release the GIL.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

_END = object()


class _Raised:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def prefetch(items: Iterable[T], depth: int = 2) -> Iterator[T]:
    """Yield ``items`` in order, produced by a background thread at most ``depth`` ahead."""
    if depth < 1:
        raise ValueError("depth must be at least 1")
    slots: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(value: object) -> bool:
        while not stop.is_set():
            try:
                slots.put(value, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(item):
                    return
        except BaseException as exc:  # handed to the consumer, raised there
            put(_Raised(exc))
            return
        put(_END)

    worker = threading.Thread(target=produce, name="prefetch", daemon=True)
    worker.start()
    try:
        while True:
            value = slots.get()
            if value is _END:
                return
            if isinstance(value, _Raised):
                raise value.exc
            yield value
    finally:
        stop.set()
        worker.join()
