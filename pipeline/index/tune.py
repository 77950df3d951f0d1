"""Tuning search parameters: the cheapest setting whose recall@10 reaches the target."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pipeline.index.handle import IndexHandle, hnsw_of, ivf_of
from pipeline.ranking import recall_of_labels

EF_SEARCH = (16, 32, 64, 128, 256, 512, 1024, 2048)


def candidates(handle: IndexHandle) -> list[dict[str, int]]:
    """Settings to try, cheapest first; one empty setting for kinds with nothing to tune."""
    ivf = ivf_of(handle.index)
    if ivf is not None:
        steps, value = [], 1
        while value < ivf.nlist:
            steps.append(value)
            value *= 2
        return [{"nprobe": v} for v in [*steps, ivf.nlist]]
    if hnsw_of(handle.index) is not None:
        return [{"efSearch": v} for v in EF_SEARCH]
    return [{}]


def tune(handle: IndexHandle, queries: np.ndarray, truth: np.ndarray, target: float,
         k: int = 10, log: Callable[[str], None] | None = None,
         floor: dict | None = None) -> tuple[dict, float, list]:
    """Try settings in order and keep the first reaching ``target`` (else the best seen).

    Each setting is tried and recorded as a search for ``k`` rows runs it
    (``IndexHandle.settings_for``): an IVF whose smallest lists hold fewer than k rows runs a
    small nprobe raised, so the settings below that run alike and count once. ``floor``: no
    setting below it is tried (a catch-up, whose queries are rows the index holds, keeps at
    least what the build chose on queries it did not hold).
    """
    tried: list[dict] = []
    best: tuple[float, dict] | None = None
    for wanted in candidates(handle):
        if floor and any(wanted.get(name, value) < value for name, value in floor.items()):
            continue
        handle.tune(wanted)
        params = handle.settings_for(k)
        if tried and all(tried[-1].get(name) == value for name, value in params.items()):
            continue  # runs as the setting just tried
        handle.tune(params)
        _, found = handle.search_labels(queries, k)
        recall = recall_of_labels(found, truth, k)
        tried.append({**params, "recall_at_10": round(recall, 4)})
        if log:
            log(f"  {params or 'exact'}: recall@{k} {recall:.4f}")
        if best is None or recall > best[0] + 1e-9:
            best = (recall, params)
        if recall >= target or _plateau(tried):
            break
    recall, params = best if best else (1.0, {})
    handle.tune(params)
    return params, recall, tried


def _plateau(tried: list[dict], steps: int = 3) -> bool:
    """Recall has not moved over the last ``steps`` settings (quantisation bounds it)."""
    last = [t["recall_at_10"] for t in tried[-steps:]]
    return len(last) == steps and max(last) - min(last) < 1e-3
