"""Every pooler, layer combination and window aggregation on the tiny BERT.

Each expectation is computed the slow, obvious way: the model runs on one text at a time
(no padding at all), and the pooled vector is written out by hand from its hidden states.
The embedder runs the same texts batched with padding; they must agree.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from pipeline.config import EncoderConfig, PoolerSpec, WindowConfig
from pipeline.data import TextBatch
from pipeline.embedder import Embedder

TEXTS = [
    "a",
    "hello world",
    "the quick brown fox jumps over the lazy dog " * 3,
    "embedding pipelines pool token states into one vector per text",
    "x",
    "pooling " * 40,
]


class Reference:
    """Unpadded, one-text-at-a-time forward of the same model."""

    def __init__(self, folder: Path) -> None:
        self.tok = AutoTokenizer.from_pretrained(str(folder))
        self.model = AutoModel.from_pretrained(str(folder), attn_implementation="eager").eval()

    @torch.no_grad()
    def states(self, text: str, max_length: int = 128):
        enc = self.tok(text, truncation=True, max_length=max_length, return_tensors="pt")
        out = self.model(**enc, output_hidden_states=True, output_attentions=True)
        hidden = [h[0] for h in out.hidden_states]  # [tokens, hidden] per layer
        first = out.attentions[-1][0, :, 0, :].mean(0)  # [tokens]
        return hidden, first


def by_hand(strategy: str, h: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    n = h.shape[0]
    if strategy == "cls":
        return h[0]
    if strategy == "mean":
        return h.mean(0)
    if strategy == "max":
        return h.max(0).values
    if strategy == "mean_sqrt_len":
        return h.sum(0) / n**0.5
    if strategy == "weighted_mean":
        w = torch.arange(1, n + 1, dtype=torch.float32)
        return (h * w[:, None]).sum(0) / w.sum()
    if strategy == "last_token":
        return h[-1]
    if strategy == "attention":
        return (h * (first / first.sum())[:, None]).sum(0)
    raise AssertionError(strategy)


def fp32(model: Path, **kw) -> EncoderConfig:
    return EncoderConfig(model=str(model), dtype="fp32", device="cpu", **kw)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Reference:
    return Reference(tiny_model_dir)


STRATEGIES = ["cls", "mean", "max", "mean_sqrt_len", "weighted_mean", "last_token", "attention"]


def test_every_pooler_matches_unpadded_reference(tiny_model_dir: Path, reference) -> None:
    specs = [PoolerSpec(name=s, normalize=False) for s in STRATEGIES]
    emb = Embedder(fp32(tiny_model_dir, token_budget=256), specs)
    out = emb.embed(TextBatch(list(range(len(TEXTS))), TEXTS))
    for row, text in enumerate(TEXTS):
        hidden, first = reference.states(text)
        for strategy in STRATEGIES:
            expected = by_hand(strategy, hidden[-1], first).numpy()
            np.testing.assert_allclose(
                out.vectors[strategy][row], expected, atol=1e-5, err_msg=f"{strategy} / {text!r}"
            )


@pytest.mark.parametrize("combine", ["mean", "max", "concat", "weighted"])
def test_layer_combinations(tiny_model_dir: Path, reference, combine: str) -> None:
    layers = (-1, -2, 0)
    weights = (0.5, 0.3, 0.2) if combine == "weighted" else None
    spec = PoolerSpec(
        name="x", strategy="mean", layers=layers, layer_combine=combine,
        layer_weights=weights, normalize=False,
    )
    emb = Embedder(fp32(tiny_model_dir), [spec])
    out = emb.embed(TextBatch([0, 1], TEXTS[1:3])).vectors["x"]
    for row, text in enumerate(TEXTS[1:3]):
        hidden, _ = reference.states(text)
        per_layer = torch.stack([hidden[i] for i in layers])  # hidden has 3 entries: 0, 1, 2
        if combine == "concat":
            combined = torch.cat(list(per_layer), dim=-1)
        elif combine == "max":
            combined = per_layer.max(0).values
        elif combine == "weighted":
            combined = torch.einsum("l,ltd->td", torch.tensor(weights), per_layer)
        else:
            combined = per_layer.mean(0)
        np.testing.assert_allclose(out[row], combined.mean(0).numpy(), atol=1e-5)
    assert emb.dims()["x"] == (96 if combine == "concat" else 32)


def test_normalize_and_truncate_dim(tiny_model_dir: Path) -> None:
    specs = [
        PoolerSpec(name="raw", strategy="mean", normalize=False),
        PoolerSpec(name="small", strategy="mean", truncate_dim=8),
    ]
    out = Embedder(fp32(tiny_model_dir), specs).embed(TextBatch([0, 1], TEXTS[:2])).vectors
    assert out["small"].shape == (2, 8)
    np.testing.assert_allclose(np.linalg.norm(out["small"], axis=1), 1.0, atol=1e-6)
    expected = out["raw"][:, :8] / np.linalg.norm(out["raw"][:, :8], axis=1, keepdims=True)
    np.testing.assert_allclose(out["small"], expected, atol=1e-6)


def test_truncation_is_counted(tiny_model_dir: Path, reference) -> None:
    long_text = "word " * 1000
    emb = Embedder(fp32(tiny_model_dir), [PoolerSpec(name="mean", normalize=False)])
    out = emb.embed(TextBatch(["long", "short"], [long_text, "short"]))
    assert out.stats.truncated == 1
    hidden, _ = reference.states(long_text, max_length=128)
    np.testing.assert_allclose(out.vectors["mean"][0], hidden[-1].mean(0).numpy(), atol=1e-5)


@pytest.mark.parametrize("agg", ["mean", "max", "weighted", "first"])
def test_window_aggregation(tiny_model_dir: Path, reference, agg: str) -> None:
    """A text far longer than max_length: each window pooled, then aggregated by hand."""
    tok = reference.tok
    text = " ".join(f"token{i}" for i in range(300))
    content = tok(text, add_special_tokens=False)["input_ids"]
    size, stride = 40, 25
    window = WindowConfig(size=size, stride=stride, agg=agg)
    emb = Embedder(fp32(tiny_model_dir, window=window), [PoolerSpec(name="m", strategy="mean",
                                                                     normalize=False)])
    out = emb.embed(TextBatch([7, 8], [text, "tiny"]))
    assert out.stats.windows > 2 and out.stats.truncated == 0
    starts = list(range(0, len(content) - (size - 2), stride)) + [len(content) - (size - 2)]
    vecs, counts = [], []
    for s in starts:
        piece = [tok.cls_token_id] + content[s : s + size - 2] + [tok.sep_token_id]
        with torch.no_grad():
            h = reference.model(input_ids=torch.tensor([piece])).last_hidden_state[0]
        vecs.append(h.mean(0).numpy())
        counts.append(len(piece) - 2)
    vecs = np.stack(vecs)
    expected = {
        "mean": vecs.mean(0),
        "max": vecs.max(0),
        "weighted": (vecs * np.array(counts)[:, None]).sum(0) / sum(counts),
        "first": vecs[0],
    }[agg]
    np.testing.assert_allclose(out.vectors["m"][0], expected, atol=1e-5)
    short = reference.states("tiny")[0][-1].mean(0).numpy()
    np.testing.assert_allclose(out.vectors["m"][1], short, atol=1e-5)


def test_pooler_may_override_window_agg(tiny_model_dir: Path) -> None:
    window = WindowConfig(size=20, stride=10, agg="mean")
    specs = [
        PoolerSpec(name="first", strategy="cls", window_agg="first"),
        PoolerSpec(name="mean", strategy="cls"),
    ]
    emb = Embedder(fp32(tiny_model_dir, window=window), specs)
    out = emb.embed(TextBatch([0], ["many words in a long text " * 20])).vectors
    assert not np.allclose(out["first"], out["mean"])
    assert emb.fingerprint("first") != emb.fingerprint("mean")


def test_one_forward_pass_for_all_poolers(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    specs = [PoolerSpec(name=s) for s in ("cls", "mean", "max")]
    emb = Embedder(fp32(tiny_model_dir, token_budget=100_000), specs)
    monkeypatch.setattr(emb.encoder, "min_fill", 0.0)  # one batch: no cut for padding
    calls = []
    hook = emb.encoder.model.register_forward_hook(lambda *a: calls.append(1))
    try:
        emb.embed(TextBatch(list(range(len(TEXTS))), TEXTS))
    finally:
        hook.remove()
    assert len(calls) == 1
    assert emb.layers == {2} and emb.attention is False


def test_fingerprint_depends_on_what_changes_vectors(tiny_model_dir: Path) -> None:
    base = Embedder(fp32(tiny_model_dir), [PoolerSpec(name="a", strategy="mean")])
    same = Embedder(fp32(tiny_model_dir), [PoolerSpec(name="a", strategy="mean")])
    other = Embedder(fp32(tiny_model_dir, max_length=64), [PoolerSpec(name="a", strategy="mean")])
    assert base.fingerprint("a") == same.fingerprint("a") != other.fingerprint("a")
