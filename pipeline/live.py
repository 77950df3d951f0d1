"""Sets as served live: each new published generation is loaded in the background and swapped in.

A ``LiveSets`` holds one ``Searcher`` per set. A poller thread reads each set's ``_INDEX.json``
and ``_SET.json`` every ``interval_s``; when the published index token, the set generation or
the set's token (the set was removed and made again) differs from what is served, it builds
the new ``Searcher`` (``Searcher.reloaded``: same model, index reloaded only when a new one was
published, snippets re-read for new corpus rows) and warms it (one search, the corpus ids
read) while the old one keeps answering, then swaps the reference in one assignment. A
request takes its ``Searcher`` once with ``get`` and uses it to the end, so it never sees half
a swap; the old generation (index, id map, snippets) is freed once the last request holding
it finishes.

A failed reload leaves the old generation serving: it is logged, counted, kept in
``status()`` and retried when something new is published (or after ``retry_s``).

Given ``discover`` (the names to serve now: the server's "every indexed set under OUT") and
``load``, the poller also adds sets indexed after the server started: loaded and warmed in the
background like a reload, then added in one assignment. A set that fails to load is logged and
tried again after ``retry_s``; the served ones are untouched.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pipeline.errors import StorageError
from pipeline.index import read_meta
from pipeline.search import Searcher
from pipeline.sets import SetFolder

log = logging.getLogger("embedpipe.live")
RETRY_S = 60.0
NICE = 5  # the reload thread's nice value (Linux), below the request threads'


Version = tuple[str, int, str | None]  # (index token, set generation, set token)


@dataclass
class ReloadState:
    """What the poller knows about one set: swaps made and the last failure (if any)."""

    swaps: int = 0
    failures: int = 0
    last_error: str | None = None
    # what failed, and when: the published version whose reload failed, or the error where
    # none could be read (the set or its index removed): each is retried once per retry_s
    failed: Version | str | None = None
    failed_at: float = 0.0


def served_version(searcher: Searcher) -> Version:
    """(index token, set generation, set token): what a ``Searcher`` was loaded from."""
    return searcher.meta.token, searcher.set.generation, searcher.set.token


def _warmed(searcher: Searcher) -> Searcher:
    """Do the first request's one-off work now, off the request path: the index answers a
    search and the corpus ids for snippets are read."""
    searcher.handle.search(np.zeros((1, searcher.meta.dim), np.float32), 1)
    if searcher.snippets is not None:
        searcher.snippets.texts([])
    return searcher


def published_version(out: str, name: str) -> Version | None:
    """(index token, set generation, set token) as published now; None while no index is
    published."""
    meta = read_meta(out, name)
    if meta is None:
        return None
    info = SetFolder(out, name).meta()
    return meta.token, info.generation, info.token


class LiveSets:
    def __init__(self, searchers: dict[str, Searcher], interval_s: float,
                 on_swap: Callable[[Searcher], None] = lambda _: None,
                 on_failure: Callable[[str], None] = lambda _: None,
                 retry_s: float = RETRY_S,
                 discover: Callable[[], list[str]] | None = None,
                 load: Callable[[str], Searcher] | None = None) -> None:
        self._current = dict(searchers)
        self.state = {name: ReloadState() for name in searchers}
        self.interval_s, self.retry_s = interval_s, retry_s
        self._on_swap, self._on_failure = on_swap, on_failure
        self._discover, self._load = discover, load
        self._not_loaded: dict[str, float] = {}  # new set -> when its load last failed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def names(self) -> list[str]:
        return list(self._current)

    def get(self, name: str) -> Searcher:
        """The generation serving ``name`` now; hold it for the whole request."""
        return self._current[name]

    def poll(self) -> None:
        """Check every set once; load and swap in what changed; add newly indexed sets."""
        for name in self.names:
            self._refresh(name)
        if self._discover is not None and self._load is not None:
            self._add_new(self._discover, self._load)

    def _add_new(self, discover: Callable[[], list[str]],
                 load: Callable[[str], Searcher]) -> None:
        try:
            names = [n for n in discover() if n not in self._current]
        except Exception as exc:  # OUT unreadable for a moment: the served sets serve on
            log.error("listing new sets failed: %s: %s", type(exc).__name__, exc)
            return
        for name in names:
            if time.monotonic() - self._not_loaded.get(name, -self.retry_s) < self.retry_s:
                continue
            try:
                searcher = _warmed(load(name))
            except Exception as exc:  # logged and retried later; the others serve on
                self._not_loaded[name] = time.monotonic()
                log.error("new set %r: not served, load failed: %s: %s", name,
                          type(exc).__name__, exc)
                self._on_failure(name)
                continue
            self._not_loaded.pop(name, None)
            self.state[name] = ReloadState()  # before the name is visible to requests
            self._current = {**self._current, name: searcher}  # one reference assignment
            log.info("set %r: now serving, newly indexed (index %s, %d rows)", name,
                     searcher.meta.token, searcher.meta.rows)
            self._on_swap(searcher)

    def _refresh(self, name: str) -> None:
        old = self._current[name]
        try:
            published = published_version(old.out, name)
        except Exception as exc:  # the set unreadable (removed, being made again): as below
            self._failed(name, f"{type(exc).__name__}: {exc}", exc)
            return
        if published is None:  # its index removed: what serves is no longer in OUT
            self._failed(name, "no index", StorageError(
                f"{old.out}: set {name!r} has no published index any more"))
            return
        if published == served_version(old) or self._lately_failed(name, published):
            return
        try:
            new = _warmed(old.reloaded())
        except Exception as exc:  # any failure: logged, counted, exposed; the old one serves on
            self._failed(name, published, exc)
            return
        state = self.state[name]
        self._current = {**self._current, name: new}  # the swap: one reference assignment
        state.swaps += 1
        state.failed, state.last_error = None, None
        log.info("set %r: now serving index %s (generation %d, %d rows)", name,
                 new.meta.token, new.meta.generation, new.meta.rows)
        if new.snippet_note:  # as at the start: the reason hits come without snippets now
            log.warning("set %r: %s", name, new.snippet_note)
        self._on_swap(new)

    def _lately_failed(self, name: str, what: Version | str) -> bool:
        state = self.state[name]
        return what == state.failed and time.monotonic() - state.failed_at < self.retry_s

    def _failed(self, name: str, what: Version | str, exc: Exception) -> None:
        """Log, count and expose a failed reload of ``what`` (once per ``retry_s`` for the
        same cause: a set being made again for hours logged it on every poll)."""
        if self._lately_failed(name, what):
            return
        state = self.state[name]
        state.failures += 1
        state.failed, state.failed_at = what, time.monotonic()
        state.last_error = f"{type(exc).__name__}: {exc}"
        log.error("set %r: reload failed, still serving index %s: %s", name,
                  self._current[name].meta.token, state.last_error)
        self._on_failure(name)

    def status(self, name: str) -> dict:
        s = self.state[name]
        return {"swaps": s.swaps, "failures": s.failures, "last_error": s.last_error}

    def start(self) -> None:
        if self.interval_s <= 0 or self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="embedpipe-reload", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop polling; a reload stuck on storage (a download retried for minutes) does not
        hold the server's shutdown: its thread is a daemon, and ends with the process."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def _loop(self) -> None:
        _background_priority()
        while not self._stop.wait(self.interval_s):
            self.poll()


def _background_priority() -> None:
    """On Linux, where each thread has its own nice value: reloads yield the CPU to requests."""
    if sys.platform.startswith("linux"):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)

