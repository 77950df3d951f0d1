"""Tokenizing in worker processes (a GPU encoder's host side): the same ids, in order, as the
tokenizer in this process; a dead worker is one clear error; prompts are found the same way."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
from _st_models import VARIANTS, real_texts, save_variant
from hypothesis import given
from hypothesis import strategies as st

from pipeline.config import EncoderConfig, PoolerSpec
from pipeline.embedder import Embedder
from pipeline.encoder import Encoder, Prompt
from pipeline.errors import ModelError
from pipeline.token_rows import TokenRows
from pipeline.tokenize_pool import MIN_TEXTS, PART_TEXTS, TokenizerPool, pool_workers


def _texts(n: int) -> list[str]:
    base = real_texts(300) + ["", " ", "\u00e9t\u00e9 \U0001f680", "x" * 3000]
    return [base[i % len(base)] + f" {i}" * (i % 3) for i in range(n)]


@pytest.fixture(scope="module")
def encoder(tiny_model_dir: Path) -> Encoder:
    return Encoder(EncoderConfig(model=str(tiny_model_dir), device="cpu", dtype="fp32"))


def test_worker_processes_give_the_ids_of_the_tokenizer_in_this_process(encoder) -> None:
    pool = TokenizerPool(encoder._ids.to_str(), workers=2)
    try:
        texts = _texts(2 * PART_TEXTS + 17)  # three parts, the last one short
        got = pool.encode(texts)
        want = TokenRows.from_lists(encoder.tokenize(texts))
        np.testing.assert_array_equal(got.offsets, want.offsets)
        np.testing.assert_array_equal(got.values, want.values)
        assert len(pool.encode([])) == 0
    finally:
        pool.close()


def test_a_dead_worker_is_one_clear_error(encoder) -> None:
    pool = TokenizerPool(encoder._ids.to_str(), workers=1)
    try:
        pool.encode(["starts the worker"])
        for pid in list(pool._executor._processes):
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(ModelError, match="a tokenizer worker process died"):
            pool.encode(_texts(50))
    finally:
        pool.close()


def test_only_a_gpu_encoder_on_a_host_of_four_cores_or_more_gets_workers() -> None:
    assert pool_workers("cpu", cpus=64) == 0
    assert pool_workers("cuda", cpus=2) == 0
    assert pool_workers("cuda", cpus=6) == 4
    assert pool_workers("cuda", cpus=16) == 8


def test_an_embedder_with_tokenizer_workers_gives_the_same_vectors(tiny_model_dir: Path,
                                                                   tmp_path: Path) -> None:
    """A model with a document prompt: the prompt is tokenized with each text in the worker,
    and its leading ids are found in the flat rows as in this process."""
    variant = next(v for v in VARIANTS if v.name == "mean_norm_prompts")
    folder = save_variant(tiny_model_dir, tmp_path / variant.name, variant)
    embedder = Embedder(EncoderConfig(model=str(folder), device="cpu", dtype="fp32"),
                        [PoolerSpec(name="model")])
    texts = _texts(MIN_TEXTS + 10)
    alone = embedder.encode(texts)
    embedder.encoder.tokenizer_workers = 2
    try:
        tokens = embedder.tokenize(texts)
        assert embedder.encoder._pool is not None  # the workers tokenized these
        assert tokens.lead.min() == len(embedder.encoder.document_prompt.ids) > 0
        np.testing.assert_allclose(embedder.encode(texts), alone, atol=1e-6)
    finally:
        embedder.encoder._pool.close()


ids_st = st.lists(st.integers(0, 3), max_size=6)


@given(st.lists(ids_st, max_size=20), ids_st)
def test_prompt_lead_counts_the_leading_ids_each_row_shares_with_the_prompt(
        rows: list[list[int]], prompt_ids: list[int]) -> None:
    lead = Encoder.prompt_lead(TokenRows.from_lists(rows), Prompt("p", tuple(prompt_ids), 1))
    for row, got in zip(rows, lead, strict=True):
        want = 0
        while want < min(len(row), len(prompt_ids)) and row[want] == prompt_ids[want]:
            want += 1
        assert got == want
