"""Admission control (``pipeline.server.gate``): the queue timeout holds while workers are busy,
and no wait, timeout or cancellation leaks a worker slot or frees one twice.

The HTTP test serves a real set from an app made here (uvicorn on loopback, in a thread) so
that it can hold the one search worker busy for as long as it likes; the others drive a
``Gate`` on its own with blocking functions.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from _search_sets import TEXTS, embedded_set
from _serve import serving_app

from pipeline.index import IndexRequest, index_set
from pipeline.search import Searcher
from pipeline.server import ServerConfig, create_app
from pipeline.server.gate import Busy, Gate

HOLD = "hold the worker"  # a query the patched search blocks on until released
HANG_S = 30  # a hang guard, not a timing


@pytest.fixture
def held_server(tmp_path, tiny_model_dir, monkeypatch):
    """(base URL, held, release): one worker, queue 2, queue timeout 0.5s; a search for HOLD
    sets ``held`` and then blocks its worker until ``release`` is set."""
    out = embedded_set(tmp_path, tiny_model_dir)
    index_set(IndexRequest(out=str(out), set_name="mean"), say=lambda _: None)
    held, release = threading.Event(), threading.Event()
    search = Searcher.search

    def holding(self: Searcher, queries: list[str], *args, **kwargs):
        if queries == [HOLD]:
            held.set()
            release.wait(HANG_S)
        return search(self, queries, *args, **kwargs)

    monkeypatch.setattr(Searcher, "search", holding)
    config = ServerConfig(out=str(out), workers=1, queue=2, queue_timeout_s=0.5,
                          reload_interval_s=0)
    with serving_app(create_app(config)) as base:
        try:
            yield base, held, release
        finally:
            release.set()


def _queue_depth(base: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base}/metrics").text
    (depth,) = [s.value for family in text_string_to_metric_families(text)
                for s in family.samples if s.name == "embedpipe_queue_depth"]
    return depth


def test_a_queued_request_gets_503_after_the_timeout_while_the_worker_is_busy(held_server):
    base, held, release = held_server
    answers = {}
    holder = threading.Thread(target=lambda: answers.setdefault("held", httpx.post(
        f"{base}/search", json={"query": HOLD, "k": 1}, timeout=HANG_S)))
    holder.start()
    assert held.wait(HANG_S)  # the one worker is busy now, and stays busy
    started = time.monotonic()
    queued = httpx.post(f"{base}/search", json={"query": TEXTS[2], "k": 1}, timeout=10)
    waited = time.monotonic() - started
    assert queued.status_code == 503, queued.text
    assert "waited over 0.5s for a search worker" in queued.json()["detail"]
    assert queued.headers["retry-after"] == "1"
    assert 0.5 <= waited < 5 and not release.is_set()  # answered while the worker still runs
    assert _queue_depth(base) == 1  # the timed-out request left the queue

    release.set()
    holder.join(HANG_S)
    assert answers["held"].status_code == 200
    after = httpx.post(f"{base}/search", json={"query": TEXTS[2], "k": 1}, timeout=HANG_S)
    assert after.status_code == 200 and after.json()["results"][0][0]["id"] == 102
    assert _queue_depth(base) == 0


async def _blocked(gate: Gate, release: threading.Event) -> asyncio.Task:
    """A task holding the gate's one worker until ``release`` is set (started when this
    returns)."""
    started = threading.Event()

    def block() -> str:
        started.set()
        release.wait(HANG_S)
        return "done"

    task = asyncio.create_task(gate.run(block))
    while not started.is_set():
        await asyncio.sleep(0.01)
    return task


async def _worker_is_held(gate: Gate) -> bool:
    """True when a request now times out waiting for a worker (each slot is taken)."""
    gate.timeout_s, timeout = 0.05, gate.timeout_s
    try:
        await gate.run(lambda: None)
    except Busy as busy:
        assert busy.status == 503
        return True
    finally:
        gate.timeout_s = timeout
    return False


def test_timed_out_and_cancelled_waits_hold_no_slot():
    async def scenario() -> None:
        gate, release = Gate(workers=1, queue=3, queue_timeout_s=HANG_S), threading.Event()
        running = await _blocked(gate, release)
        waiting = asyncio.create_task(gate.run(lambda: "never"))
        await asyncio.sleep(0.05)
        assert gate.pending == 2
        waiting.cancel()  # a client gone while it waited
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert gate.pending == 1 and await _worker_is_held(gate)
        release.set()
        assert await running == "done"
        assert gate.pending == 0 and not await _worker_is_held(gate)  # the slot is back once
        again = threading.Event()
        second = await _blocked(gate, again)
        assert await _worker_is_held(gate)  # ... and only once: one worker, not two
        again.set()
        assert await second == "done"

    asyncio.run(asyncio.wait_for(scenario(), HANG_S))


def test_a_request_cancelled_while_it_runs_holds_its_slot_until_its_thread_ends():
    async def scenario() -> None:
        gate, release = Gate(workers=1, queue=3, queue_timeout_s=HANG_S), threading.Event()
        running = await _blocked(gate, release)
        running.cancel()  # the thread cannot be stopped: its search goes on
        with pytest.raises(asyncio.CancelledError):
            await running
        assert gate.pending == 1 and await _worker_is_held(gate)
        release.set()
        deadline = time.monotonic() + HANG_S
        while gate.pending and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert gate.pending == 0 and await gate.run(lambda: "next") == "next"

    asyncio.run(asyncio.wait_for(scenario(), HANG_S))
