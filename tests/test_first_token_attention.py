"""The attention pooler's weights beside transformers' SDPA forward
(pipeline.first_token_attention) are the eager model's attention probabilities."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_fused_bert import TEXTS, batches, tiny

from pipeline import first_token_attention, fused_bert
from pipeline.attention import masked_bias
from pipeline.config import EncoderConfig, PoolerSpec
from pipeline.embedder import Embedder
from pipeline.first_token_attention import FirstTokenAttention, supported


@pytest.mark.parametrize("kind", ["bert", "roberta", "electra", "distilbert"])
def test_the_weights_beside_sdpa_are_the_eager_models_probabilities(kind: str) -> None:
    """Each row's last-layer attention from its first token, averaged over heads, zeros at
    padding: padded batches and one without padding, a one-row batch."""
    eager, sdpa = (tiny(kind, max_position_embeddings=200) for _ in range(2))  # same seed
    eager.set_attn_implementation("eager")
    sdpa.set_attn_implementation("sdpa")
    first = FirstTokenAttention(sdpa, sdpa.config)
    for rows, width, ids, mask in batches([(5, 23), (3, 40, False), (1, 7)]):
        with torch.inference_mode():
            out = eager(input_ids=ids, attention_mask=mask, output_attentions=True)
            want = out.attentions[-1][:, :, 0, :].mean(dim=1)
            sdpa(input_ids=ids, attention_mask=mask)
            got = first.weights(mask)
        assert got.shape == (rows, width) and got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        assert bool(torch.all(got[mask == 0] == 0))
    with pytest.raises(RuntimeError, match="no forward ran"):  # read once a forward
        first.weights(mask)


def test_the_weights_are_computed_on_the_masks_device() -> None:
    """A GPU's forward hands a mask on the GPU: the bias is built there too (the meta device
    stands in for it: no data, but the device of every tensor made from the mask)."""
    model = tiny("bert")
    first = FirstTokenAttention(model, model.config).to("meta")
    first._keep(model, (torch.zeros(2, 7, model.config.hidden_size, device="meta"),), {})
    mask = torch.ones(2, 7, dtype=torch.long, device="meta")
    assert masked_bias(mask == 0, torch.float32).device.type == "meta"
    assert first.weights(mask).device.type == "meta"


def test_models_whose_scores_have_more_in_them_keep_the_eager_model() -> None:
    assert supported(tiny("bert").config) and supported(tiny("distilbert").config)
    assert not supported(tiny("mpnet").config)  # its relative position bias
    assert not supported(tiny("bert", position_embedding_type="relative_key").config)


def test_the_attention_set_beside_sdpa_is_the_eager_models(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no fused forward runs the model (a GPU's case), an attention set loads the
    SDPA model and gets the vectors the eager model gives."""
    monkeypatch.setattr(fused_bert, "fusable", lambda config, device: False)
    cfg = EncoderConfig(model=str(tiny_model_dir), dtype="fp32", device="cpu")
    specs = [PoolerSpec(name="attention"), PoolerSpec(name="mean")]
    beside = Embedder(cfg, specs)
    assert beside.encoder.first_attention is not None
    assert beside.encoder.model.config._attn_implementation == "sdpa"
    monkeypatch.setattr(first_token_attention, "supported", lambda config: False)
    eager = Embedder(cfg, specs)
    assert eager.encoder.first_attention is None
    assert eager.encoder.model.config._attn_implementation == "eager"
    texts = TEXTS * 3
    np.testing.assert_allclose(beside.encode(texts, "attention"),
                               eager.encode(texts, "attention"), atol=1e-6)
