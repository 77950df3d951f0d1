"""A text's vector depends on nothing but the text: not batch mates, order or batch size."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.config import EncoderConfig, PoolerSpec, WindowConfig
from pipeline.data import TextBatch
from pipeline.embedder import Embedder

WORDS = ["alpha", "beta", "search", "vector", "pool", "token", "é", "🚀", "x", "longerword"]
texts_st = st.lists(
    st.lists(st.sampled_from(WORDS), min_size=1, max_size=150).map(" ".join),
    min_size=1, max_size=12,
)
SPECS = [PoolerSpec(name=n) for n in ("mean", "cls", "max", "last_token", "weighted_mean")]


@pytest.fixture(scope="module")
def embedders(tiny_model_dir: Path) -> list[Embedder]:
    """Same model, very different batching: tiny budgets, one row per batch, huge budgets."""
    window = WindowConfig(size=48, stride=30, agg="weighted")
    configs = [
        {"token_budget": 64, "max_batch_rows": 1},
        {"token_budget": 300, "max_batch_rows": 3},
        {"token_budget": 1 << 20, "max_batch_rows": 1024},
    ]
    return [
        Embedder(EncoderConfig(model=str(tiny_model_dir), dtype="fp32", window=window, **c), SPECS)
        for c in configs
    ]


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(texts=texts_st, seed=st.integers(0, 1000))
def test_vectors_do_not_depend_on_batching(embedders: list[Embedder], texts, seed: int) -> None:
    first = embedders[0]
    alone = {name: np.stack([first.encode([t], name)[0] for t in texts]) for name in first.specs}
    order = np.random.default_rng(seed).permutation(len(texts))
    shuffled = [texts[i] for i in order]
    for emb in embedders:
        out = emb.embed(TextBatch(order.tolist(), shuffled))
        assert out.ids == order.tolist()
        for name, matrix in out.vectors.items():
            np.testing.assert_allclose(matrix, alone[name][order], atol=1e-5)



@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_a_short_text_never_runs_padded_beside_wide_rows(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    """Where wide batches run padded (oneDNN Graph's attention: 96 tokens and more on an
    AVX-512 CPU without AMX; forced at 40 tokens here), a short text never joins one: beside
    long texts it went through the padded forward (another attention kernel), alone through
    the unpadded one, its bf16 vector a last bit apart (1e-4), int8's more (3e-3)."""
    from pipeline import attention

    monkeypatch.setattr(attention, "unpadded_below", lambda dtype: 40)
    ours = Embedder(EncoderConfig(model=str(tiny_model_dir), dtype=dtype, device="cpu"),
                    [PoolerSpec(name="mean")])
    assert ours.encoder.unpadded_below == 40
    long = " ".join(["longer"] * 120)
    for n in (12, 20, 30):
        texts = [" ".join(["word"] * n)] + [long] * 8
        tokens = ours.tokenize(texts)
        widths = [(int(mask.shape[1]), mask.sum(1).tolist())
                  for _, _, mask in ours.padded_batches(tokens, ours.plan(tokens))]
        assert len(widths) == 2 and all(min(real) >= 40 for width, real in widths if width >= 40)
        np.testing.assert_array_equal(ours.encode(texts[:1]), ours.encode(texts)[:1])
