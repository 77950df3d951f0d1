"""ModernBERT's fused CPU forward (pipeline.fused_modernbert) computes what transformers' does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import (
    assert_first_tokens_alone_are_the_whole_forwards,
    build_tiny_bert,
    record_first_token_asks,
    record_packed_products,
)
from transformers import ModernBertConfig, ModernBertModel

from pipeline import attention, fused_bert, graph_attention
from pipeline.config import EncoderConfig, PoolerSpec
from pipeline.embedder import Embedder
from pipeline.encoder import batch_limits
from pipeline.errors import ConfigError
from pipeline.fused_modernbert import (
    FusedModernBert,
    Rotary,
    dims,
    fusable,
    pair_order,
    weight_shapes,
)
from pipeline.models import recorded
from pipeline.models.recorded import RecordedConfig
from pipeline.onednn import PackedLinear, packs

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="this torch has no oneDNN")
CPU = torch.device("cpu")


def tiny(**overrides) -> ModernBertModel:
    """4 layers (the first and last global, the others within 4 tokens either way), weights
    that matter (ModernBERT initialises them small)."""
    config = dict(vocab_size=100, hidden_size=48, intermediate_size=40, num_hidden_layers=4,
                  num_attention_heads=4, local_attention=8, global_attn_every_n_layers=3,
                  max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2, cls_token_id=1, sep_token_id=2) | overrides
    torch.manual_seed(0)
    model = ModernBertModel(ModernBertConfig(**config)).eval()
    with torch.no_grad():
        for weight in model.parameters():
            weight.normal_(0.0, 0.3)
    return model


def batch(rows: int = 4, width: int = 21) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids, right-padded rows of different lengths (the first full, one of 3 tokens)."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 100, (rows, width), generator=generator)
    lengths = torch.randint(1, width + 1, (rows,), generator=generator)
    lengths[0], lengths[-1] = width, 3
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    return ids.masked_fill(mask == 0, 0), mask


def real(states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return states[mask.bool()]


def assert_states_match(model: ModernBertModel, fused: FusedModernBert, rows: int, width: int,
                        padded: bool = True) -> None:
    ids, mask = batch(rows, width)
    if not padded:
        mask = torch.ones_like(mask)
    with torch.inference_mode():
        want = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        got = fused(ids, mask, output_hidden_states=True)
    assert len(got.hidden_states) == len(want.hidden_states) == model.config.num_hidden_layers + 1
    for layer, (ours, theirs) in enumerate(zip(got.hidden_states, want.hidden_states,
                                               strict=True)):
        torch.testing.assert_close(real(ours, mask), real(theirs, mask), atol=5e-5, rtol=1e-4,
                                   msg=f"layer {layer}")
    torch.testing.assert_close(got.last_hidden_state, got.hidden_states[-1])


@pytest.mark.parametrize("biases", [False, True], ids=["no-biases", "biases"])
@pytest.mark.parametrize("onednn_fp32", [True, False])
def test_fp32_states_match_the_models_own_at_every_layer(biases: bool,
                                                         onednn_fp32: bool) -> None:
    """Every layer's states, the last after the final LayerNorm (as transformers returns
    them), over rows wider than the sliding layers' band and rows within it."""
    model = tiny(attention_bias=biases, mlp_bias=biases, norm_bias=biases)
    fused = FusedModernBert.from_model(model, onednn_fp32)
    assert fused.kinds == ["full_attention", "sliding_attention", "sliding_attention",
                           "full_attention"]
    for rows, width, padded in [(4, 21, True), (3, 40, False), (2, 5, True)]:
        assert_states_match(model, fused, rows, width, padded)


@pytest.mark.parametrize("kernel", ["sdpa", "blocked", "graph"])
def test_the_sliding_band_reaches_every_attention_kernel(monkeypatch: pytest.MonkeyPatch,
                                                         kernel: str) -> None:
    """fp32 states equal transformers' through each kernel; bf16 ones (packed where that runs
    here) within its rounding; without the band (every layer global) they are not."""
    if kernel == "graph" and not graph_attention.available():
        pytest.skip("this torch has no oneDNN Graph fuser")
    monkeypatch.setattr(attention, "attention_kernel", lambda width, dtype: kernel)
    model = tiny()
    fused, half = (FusedModernBert.from_model(model, onednn_fp32=True) for _ in range(2))
    half.pack(torch.bfloat16)
    ids, mask = batch(4, 40)
    assert_states_match(model, fused, 4, 40)
    with torch.inference_mode():
        want = model(input_ids=ids, attention_mask=mask).last_hidden_state
        got = half(ids, mask).last_hidden_state
        fused.kinds = ["full_attention"] * 4
        unbanded = fused(ids, mask).last_hidden_state
    cosine = F.cosine_similarity(real(got, mask), real(want, mask), -1)
    assert float(cosine.min()) > 0.999
    assert (real(unbanded, mask) - real(want, mask)).abs().max() > 1e-2


@pytest.mark.parametrize("biases", [False, True], ids=["no-biases", "biases"])
def test_the_weights_it_reads_are_the_models_own_names_and_shapes(biases: bool) -> None:
    """``weight_shapes`` names every weight of the model's state dict, in its shape; a
    recorded config (``pipeline.models.recorded``: later starts, no transformers) gives the
    same sizes, the same fusability and the same states."""
    model = tiny(attention_bias=biases, mlp_bias=biases, norm_bias=biases)
    own = {name: tuple(weight.shape) for name, weight in model.state_dict().items()}
    assert weight_shapes(model.config) == own
    recorded_config = RecordedConfig(**recorded.config_attributes(model.config))
    assert dims(recorded_config) == dims(model.config)
    assert fusable(recorded_config, CPU)
    live = FusedModernBert.from_model(model, onednn_fp32=True)
    replayed = FusedModernBert(recorded_config, model.state_dict(), onednn_fp32=True)
    ids, mask = batch()
    with torch.inference_mode():
        assert torch.equal(replayed(ids, mask).last_hidden_state, live(ids, mask).last_hidden_state)


def test_rotation_in_pair_order_is_transformers_rotary_embedding() -> None:
    """The complex product over dimensions in ``pair_order`` gives transformers' rotate-half
    rotation, in that order."""
    from transformers.models.modernbert.modeling_modernbert import apply_rotary_pos_emb

    rotary, head, width = Rotary(10000.0, 16), 16, 7
    x = torch.randn(2, 3, width, head)
    freqs = torch.arange(width).float()[:, None] * rotary.inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    want, _ = apply_rotary_pos_emb(x, x, angles.cos()[None], angles.sin()[None])
    got = Rotary.rotate(x[..., pair_order(head)], rotary.table(width))
    torch.testing.assert_close(got, want[..., pair_order(head)], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_products_give_the_batchs_own_states(dtype: torch.dtype) -> None:
    """Packed for oneDNN (the gated product's halves, no biases), over ``product_rows`` rows:
    the unpacked forward's states (fp32 within rounding; bf16 within its own)."""
    if not packs(dtype, True):
        pytest.skip(f"this CPU or torch packs no {dtype} weights for oneDNN")
    model = tiny()
    plain, packed = (FusedModernBert.from_model(model, onednn_fp32=True) for _ in range(2))
    packed.pack(dtype)
    assert packed.shaped and all(isinstance(layer.gate, PackedLinear) for layer in packed.layers)
    ids, mask = batch(5, 23)
    with torch.inference_mode(), torch.autocast("cpu", dtype=dtype,
                                                enabled=dtype != torch.float32):
        want = plain(ids, mask).last_hidden_state
    with torch.inference_mode():
        got = packed(ids, mask).last_hidden_state
    if dtype == torch.float32:
        torch.testing.assert_close(real(got, mask), real(want, mask), atol=1e-5, rtol=1e-5)
    else:
        cosine = F.cosine_similarity(real(got, mask), real(want, mask), -1)
        assert float(cosine.min()) > 0.999


@pytest.mark.parametrize(("dtype", "onednn_fp32"),
                         [(torch.float32, False), (torch.float32, True), (torch.bfloat16, True)],
                         ids=["mkl", "onednn-fp32", "bf16"])
def test_a_forward_that_keeps_no_states_adds_in_place_to_the_same_vectors(
        dtype: torch.dtype, onednn_fp32: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The residual adds that are passes of their own (fp32 products: into the product's
    output; a bf16 product onto the fp32 stream: into the stream in place when no layer's
    states are kept) give the same last state, bit for bit, as the forward that keeps them
    (and leaves them as transformers' are); packed in bf16, the gate multiplies into the GELU
    half in the epilogue, in fp32 in place after it (``PackedLinear.binary_after``)."""
    if not packs(dtype, onednn_fp32) and dtype != torch.float32:
        pytest.skip(f"this CPU or torch packs no {dtype} weights for oneDNN")
    model = tiny()
    fused = FusedModernBert.from_model(model, onednn_fp32=onednn_fp32)
    fused.pack(dtype)
    calls = record_packed_products(monkeypatch)
    ids, mask = batch(5, 23)
    with torch.inference_mode():
        kept = fused(ids, mask, output_hidden_states=True)
        last = fused(ids, mask)
        want = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    assert last.hidden_states is None
    assert torch.equal(last.last_hidden_state, kept.last_hidden_state)
    binaries = [call.epilogue[1] for call in calls if call.epilogue]
    assert binaries == (["mul"] * 2 * len(fused.layers) if dtype == torch.bfloat16 else [])
    after = [call.after for call in calls if call.after]  # two forwards; fp32 stream adds
    fp32_packed = dtype == torch.float32 and onednn_fp32
    assert after == (["add", "mul", "add"] * 2 * len(fused.layers) if fp32_packed else [])
    for ours, theirs in zip(kept.hidden_states, want.hidden_states, strict=True):
        cosine = F.cosine_similarity(real(ours, mask), real(theirs, mask), -1)
        assert float(cosine.min()) > (0.99999 if dtype == torch.float32 else 0.999)


@pytest.mark.parametrize("layers", [4, 3], ids=["last-global", "last-sliding"])
@pytest.mark.parametrize("unpadded", [True, False])
def test_the_last_layer_at_the_first_tokens_alone_is_the_whole_layers_first_tokens(
        monkeypatch: pytest.MonkeyPatch, layers: int, unpadded: bool) -> None:
    """``first_token_only``: each row's first token of the whole forward's last state (after
    the final LayerNorm), whether the last layer attends globally or within its band (rows
    wider than the band, rows within it; padded or reordered by length where unpadded), in
    fp32 and, packed, bf16."""
    monkeypatch.setattr(attention, "unpadded_below", lambda dtype: 1 << 30 if unpadded else 0)
    model = tiny(num_hidden_layers=layers)
    assert model.config.layer_types[-1] == ("full_attention" if layers == 4
                                            else "sliding_attention")
    fused, packed = (FusedModernBert.from_model(model, onednn_fp32=True) for _ in range(2))
    packed.pack(torch.bfloat16)
    for rows, width in [(4, 21), (3, 40), (2, 5)]:
        assert_first_tokens_alone_are_the_whole_forwards([(fused, 5e-5), (packed, 3e-2)],
                                                          *batch(rows, width))


@pytest.mark.parametrize("layers", [4, 3], ids=["last-global", "last-sliding"])
@pytest.mark.parametrize("unpadded", [True, False])
def test_the_first_tokens_attention_is_the_models_own_attention_probabilities(
        monkeypatch: pytest.MonkeyPatch, layers: int, unpadded: bool) -> None:
    """``first_token_attention``: each row's last-layer attention from its first token
    averaged over heads, as transformers' eager attention gives it, within the sliding band
    where the last layer slides (rows wider than the band), zeros at padding."""
    monkeypatch.setattr(attention, "unpadded_below", lambda dtype: 1 << 30 if unpadded else 0)
    model = tiny(num_hidden_layers=layers)
    model.set_attn_implementation("eager")
    fused = FusedModernBert.from_model(model, onednn_fp32=True)
    for rows, width in [(4, 21), (3, 40), (2, 5)]:
        ids, mask = batch(rows, width)
        with torch.inference_mode():
            out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
            got = fused(ids, mask, first_token_attention=True).first_token_attention
        want = out.attentions[-1][:, :, 0, :].mean(dim=1) * mask
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        band = model.config.local_attention // 2
        if layers == 3 and width > band + 1:  # the first row's keys past the band: no weight
            assert got[0, band + 1:].eq(0).all() and got[0, : band + 1].gt(0).all()


def test_a_row_without_real_tokens_gives_numbers_not_nans() -> None:
    model = tiny()
    ids, mask = batch(3, 30)
    mask[1] = 0
    fused = FusedModernBert.from_model(model, onednn_fp32=True)
    with torch.inference_mode():
        got = fused(ids, mask).last_hidden_state
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got_bf16 = fused(ids, mask).last_hidden_state
    assert torch.isfinite(got).all() and torch.isfinite(got_bf16).all()


@pytest.mark.parametrize(("overrides", "expected"), [
    ({}, True),
    ({"hidden_activation": "gelu_pytorch_tanh"}, True),
    ({"hidden_activation": "silu"}, False),
    ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0,
                                             "rope_theta": 160000.0},
                          "sliding_attention": {"rope_type": "default",
                                                "rope_theta": 10000.0}}}, False),
    ({"auto_map": {"AutoModel": "modeling.CustomModernBert"}}, False),  # its own code
])
def test_only_modernberts_it_computes_exactly_are_fused(overrides: dict, expected: bool) -> None:
    assert fusable(tiny(**overrides).config, CPU) is expected
    # nor by BERT's fused forward, whose layer alone has an int8 path (ModernBERT's int8 runs
    # transformers' model through ONNX Runtime)
    assert not fused_bert.fusable(tiny(**overrides).config, CPU)
    assert not fusable(tiny().config, torch.device("meta"))  # a GPU keeps the model's own


def test_the_encoder_fuses_a_modernbert_and_its_vectors_stay_the_set(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fused in fp32 and under ``auto``, and where a pooler reads the first token's attention
    weights (computed there); the vectors transformers' forward gives, the same sets."""
    from pipeline import fused_modernbert

    folder = build_tiny_bert(tmp_path / "modernbert", kind="modernbert")
    texts = ["a tiny text", "another one, a little longer than the first " * 3, "ok"]

    def embedder(pooler: str = "mean", dtype: str = "fp32") -> Embedder:
        cfg = EncoderConfig(model=str(folder), dtype=dtype, device="cpu")
        return Embedder(cfg, [PoolerSpec(name=pooler)])

    fused, auto, attention = embedder(), embedder(dtype="auto"), embedder("attention")
    assert isinstance(fused.encoder.model, FusedModernBert)
    assert isinstance(auto.encoder.model, FusedModernBert)
    assert attention.encoder.fused
    model = fused.encoder.model  # its batches sized by its gated first product's width
    assert model.dims.inner == 2 * model.config.intermediate_size
    assert (fused.encoder.token_budget, fused.encoder.max_batch_rows) == batch_limits(
        fused.encoder.cfg, CPU, model.dims.hidden, model.dims.inner, "fp32")
    monkeypatch.setattr(fused_modernbert, "fusable", lambda config, device: False)
    plain, plain_attention = embedder(), embedder("attention")
    assert not plain.encoder.fused and not plain_attention.encoder.fused
    np.testing.assert_allclose(fused.encode(texts), plain.encode(texts), atol=1e-5)
    assert fused.fingerprint("mean") == plain.fingerprint("mean")
    np.testing.assert_allclose(attention.encode(texts), plain_attention.encode(texts),
                               atol=1e-5)


def test_a_cls_pooler_of_a_modernbert_runs_its_last_layer_at_the_first_tokens(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The [CLS] pooler alone: the fused forward is asked for the first tokens alone, and the
    vectors are those of transformers' whole forward."""
    from pipeline import fused_modernbert

    folder = build_tiny_bert(tmp_path / "modernbert", kind="modernbert")
    texts = ["a tiny text", "another one, a little longer than the first " * 3, "ok"]
    cfg = EncoderConfig(model=str(folder), dtype="fp32", device="cpu")
    cls = Embedder(cfg, [PoolerSpec(name="cls")])
    asked = record_first_token_asks(monkeypatch, FusedModernBert)
    got = cls.encode(texts)
    assert cls.first_token_only and asked and all(asked)
    monkeypatch.setattr(fused_modernbert, "fusable", lambda config, device: False)
    plain = Embedder(cfg, [PoolerSpec(name="cls")])
    assert not plain.encoder.fused
    np.testing.assert_allclose(got, plain.encode(texts), atol=1e-5)


def test_int8_of_a_modernbert_says_why_onednn_cannot_run_it(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    monkeypatch.setenv("EMBEDPIPE_CACHE", str(tmp_path / "cache"))
    folder = build_tiny_bert(tmp_path / "modernbert", kind="modernbert")
    with pytest.raises(ConfigError, match="int8_kernel onednn cannot run here: ModernBERT's "
                                          "fused forward has no int8 path"):
        Embedder(EncoderConfig(model=str(folder), dtype="int8", int8_kernel="onednn",
                               device="cpu"), [PoolerSpec(name="mean")])
