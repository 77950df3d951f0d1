"""One thread per process loads the model and runs every forward pass (pipeline.torch_thread)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from pipeline import torch_thread
from pipeline.config import EncoderConfig, PoolerSpec
from pipeline.embedder import Embedder, get_embedder
from pipeline.encoder import Encoder
from pipeline.torch_thread import on_torch_thread


def test_load_and_forward_run_on_one_thread_whichever_thread_asks(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, set[str]] = {"load": set(), "forward": set()}
    load, forward = Embedder._load, Encoder.forward

    def spy_load(self, *args, **kwargs):
        seen["load"].add(threading.current_thread().name)
        load(self, *args, **kwargs)

    def spy_forward(self, *args, **kwargs):
        seen["forward"].add(threading.current_thread().name)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(Embedder, "_load", spy_load)
    monkeypatch.setattr(Encoder, "forward", spy_forward)
    config = EncoderConfig(model=str(tiny_model_dir), max_length=32)
    poolers = [PoolerSpec(name="torch-thread-test", strategy="max")]  # a config of its own
    texts = [f"text number {i}" for i in range(40)]
    with ThreadPoolExecutor(3) as pool:
        embedder = pool.submit(get_embedder, config, poolers).result()
        from_threads = list(pool.map(lambda _: embedder.encode(texts), range(3)))
    from_main = embedder.encode(texts)
    Embedder(config, poolers).encode(texts[:3])  # built directly, on this thread's request
    assert len(seen["load"]) == 1 and seen["forward"] == seen["load"]
    (name,) = seen["load"]
    assert name.startswith(torch_thread.NAME) and name != threading.current_thread().name
    for vectors in from_threads:  # the same thread, the same kernels: the same bits
        np.testing.assert_array_equal(vectors, from_main)


def test_errors_are_raised_in_the_caller_and_nested_calls_run_inline() -> None:
    def fails() -> None:
        raise ValueError("model folder has no config.json")

    with pytest.raises(ValueError, match="no config.json"):
        on_torch_thread(fails)
    outer = on_torch_thread(lambda: (threading.get_ident(), on_torch_thread(threading.get_ident)))
    assert outer[0] == outer[1] != threading.get_ident()


def test_a_forked_child_starts_its_own_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    parent = on_torch_thread(threading.get_ident)
    pid, executor = torch_thread._pool
    with monkeypatch.context() as patched:
        # what a forked child sees: the parent's executor, whose thread did not survive the fork
        patched.setattr(torch_thread.os, "getpid", lambda: pid + 1)
        child = on_torch_thread(threading.get_ident)
        forked = torch_thread._pool[1]
    assert child != parent and forked is not executor
    forked.shutdown()
    torch_thread._pool = (pid, executor)
    assert on_torch_thread(threading.get_ident) == parent


@pytest.mark.parametrize(("runner", "workers", "processes"), [
    ("threads", 2, 1),  # shards in threads of one process share its torch thread
    ("processes", 2, 2),
    ("dask", 3, 3),
])
def test_torch_threads_divide_the_cores_between_processes(
        runner: str, workers: int, processes: int, tmp_path: Path) -> None:
    import torch

    from pipeline.config import EmbedJob
    from pipeline.job import limit_threads

    job = EmbedJob(corpus=str(tmp_path / "c.parquet"), out=str(tmp_path / "out"),
                   runner=runner, workers=workers)
    before = on_torch_thread(torch.get_num_threads)
    try:
        on_torch_thread(limit_threads, job)
        wanted = max(1, (os.cpu_count() or 1) // processes)
        assert on_torch_thread(torch.get_num_threads) == wanted
    finally:
        on_torch_thread(torch.set_num_threads, before)
