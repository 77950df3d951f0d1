"""The fused CPU forward (pipeline.fused_bert) computes what transformers' own forward does."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import (
    assert_first_tokens_alone_are_the_whole_forwards,
    record_first_token_asks,
    record_packed_products,
)
from transformers import (
    BertConfig,
    BertModel,
    CamembertConfig,
    CamembertModel,
    DistilBertConfig,
    DistilBertModel,
    ElectraConfig,
    ElectraModel,
    MPNetConfig,
    MPNetModel,
    RobertaConfig,
    RobertaModel,
)

from pipeline import attention, bert_family, fused_bert, graph_attention
from pipeline.attention import attend
from pipeline.config import EncoderConfig, PoolerSpec
from pipeline.embedder import Embedder
from pipeline.fused_bert import FusedBert, fusable
from pipeline.models import recorded
from pipeline.models.recorded import RecordedConfig
from pipeline.onednn import PackedLinear, packs, product_rows

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="this torch has no oneDNN")
CPU = torch.device("cpu")
TEXTS = ["a tiny text", "another one, a little longer than the first", "x " * 60, "ok"]


def tiny(kind: str = "bert", **overrides) -> torch.nn.Module:
    shape = dict(vocab_size=120, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
                 intermediate_size=96, max_position_embeddings=80) | overrides
    torch.manual_seed(0)
    if kind == "roberta":
        return RobertaModel(RobertaConfig(pad_token_id=1, **shape)).eval()
    if kind == "camembert":  # RoBERTa's model under CamemBERT's name
        return CamembertModel(CamembertConfig(pad_token_id=1, **shape)).eval()
    if kind == "mpnet":
        model = MPNetModel(MPNetConfig(**shape), add_pooling_layer=False).eval()
        with torch.no_grad():  # a relative position bias that matters (initialised ~0.02)
            model.encoder.relative_attention_bias.weight.normal_(0.0, 2.0)
        return model
    if kind == "distilbert":
        return DistilBertModel(distilbert_config(**shape)).eval()
    if kind == "electra":  # embeddings narrower than its layers, widened by a Linear
        return ElectraModel(ElectraConfig(**{"embedding_size": 24} | shape)).eval()
    return BertModel(BertConfig(**shape)).eval()


def distilbert_config(hidden_size: int, num_attention_heads: int, num_hidden_layers: int,
                      intermediate_size: int, hidden_act: str = "gelu", **rest) -> DistilBertConfig:
    """DistilBERT's config of BERT's sizes, under its own names."""
    return DistilBertConfig(dim=hidden_size, n_heads=num_attention_heads,
                            n_layers=num_hidden_layers, hidden_dim=intermediate_size,
                            activation=hidden_act, **rest)


def batch(rows: int = 5, width: int = 23) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids with rows of different real lengths (the first row full), right-padded."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 120, (rows, width), generator=generator)
    lengths = torch.randint(1, width + 1, (rows,), generator=generator)
    lengths[0] = width
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    return ids.masked_fill(mask == 0, 0), mask


def batches(shapes: list[tuple]) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """(rows, width, ids, mask) of ``batch`` for each (rows, width[, padded]); not padded: a
    mask of ones (no key masked)."""
    for rows, width, *padded in shapes:
        ids, mask = batch(rows, width)
        yield rows, width, ids, mask if padded != [False] else torch.ones_like(mask)


def fp32_and_bf16(model: torch.nn.Module) -> tuple[FusedBert, FusedBert]:
    """The fused twin of ``model``, and another packed for bf16."""
    fused, packed = (FusedBert.from_model(model, onednn_fp32=True) for _ in range(2))
    packed.pack(torch.bfloat16)
    return fused, packed


def real(states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return states[mask.bool()]


@pytest.mark.parametrize("kind", ["bert", "roberta", "camembert", "mpnet", "distilbert",
                                  "electra"])
@pytest.mark.parametrize("onednn_fp32", [True, False])
def test_fp32_states_match_the_models_own_at_every_layer(kind: str, onednn_fp32: bool) -> None:
    model = tiny(kind)
    ids, mask = batch()
    with torch.inference_mode():
        want = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        fused = FusedBert.from_model(model, onednn_fp32)
        got = fused(ids, mask, output_hidden_states=True).hidden_states
    assert len(got) == len(want) == 4
    for ours, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(real(ours, mask), real(theirs, mask), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["bert", "roberta", "camembert", "mpnet", "distilbert",
                                  "electra"])
def test_the_weights_it_reads_are_the_models_own_names_and_shapes(kind: str) -> None:
    """``weight_shapes`` names every weight of the model's state dict (none left unread, none
    invented), in its shape; ``dims`` reads the same sizes from the live config and from its
    recorded attributes (``pipeline.models.recorded``)."""
    model = tiny(kind)
    own = {name: tuple(weight.shape) for name, weight in model.state_dict().items()
           if not name.startswith("pooler.")}  # BERT's and RoBERTa's pooler: not read
    assert bert_family.weight_shapes(model.config) == own
    recorded_config = RecordedConfig(**recorded.config_attributes(model.config))
    token_types = 0 if kind in ("mpnet", "distilbert") else 2
    want = bert_family.Dims(48, 4, 3, 96, "gelu", 1e-12, 120, 80, token_types,
                            32 if kind == "mpnet" else 0, 24 if kind == "electra" else 48)
    assert bert_family.dims(model.config) == bert_family.dims(recorded_config) == want
    assert recorded_config.hidden_size == 48  # DistilBERT's ``dim``, as its config answers


def test_an_electra_as_wide_as_its_layers_reads_no_projection() -> None:
    model = tiny("electra", embedding_size=48)
    assert not hasattr(model, "embeddings_project")
    assert bert_family.EMBEDDINGS_PROJECT + ".weight" not in bert_family.weight_shapes(
        model.config)
    ids, mask = batch()
    with torch.inference_mode():
        want = model(input_ids=ids, attention_mask=mask).last_hidden_state
        got = FusedBert.from_model(model, False)(ids, mask).last_hidden_state
    assert FusedBert.from_model(model, False).embeddings.project is None
    torch.testing.assert_close(real(got, mask), real(want, mask), atol=2e-5, rtol=1e-4)


def test_distilbert_with_sinusoidal_positions_matches_its_own_forward() -> None:
    """DistilBERT (its own names, positions from 0 in a sinusoid it stores, no token types,
    LayerNorm epsilon fixed in its model): transformers' states at every layer in fp32, within
    bf16's rounding of them packed in bf16."""
    model = tiny("distilbert", sinusoidal_pos_embds=True)
    fused, packed = (FusedBert.from_model(model, onednn_fp32=True) for _ in range(2))
    packed.pack(torch.bfloat16)
    ids, mask = batch(rows=6, width=30)
    with torch.inference_mode():
        want = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        got = fused(ids, mask, output_hidden_states=True).hidden_states
        half = packed(ids, mask).last_hidden_state
    assert len(got) == len(want.hidden_states) == 4
    for ours, theirs in zip(got, want.hidden_states, strict=True):
        torch.testing.assert_close(real(ours, mask), real(theirs, mask), atol=2e-5, rtol=1e-4)
    cosine = F.cosine_similarity(real(half, mask), real(want.last_hidden_state, mask), -1)
    assert float(cosine.min()) > 0.999
    assert fused.embeddings.token_type_embeddings is None and fused.embeddings.padding_idx is None


@pytest.mark.parametrize("kernel", ["sdpa", "blocked", "graph"])
def test_mpnets_relative_position_bias_reaches_every_attention_kernel(
        monkeypatch: pytest.MonkeyPatch, kernel: str) -> None:
    """MPNet's states, through each attention kernel, over padded batches and a batch without
    padding (the bias then one row's, viewed for every row): transformers' in fp32, within
    bf16's rounding of them in bf16; with its bias zeroed they are not."""
    if kernel == "graph" and not graph_attention.available():
        pytest.skip("this torch has no oneDNN Graph fuser")
    monkeypatch.setattr(attention, "attention_kernel", lambda width, dtype: kernel)
    model = tiny("mpnet", max_position_embeddings=200)
    fused, packed = fp32_and_bf16(model)
    for rows, width, ids, mask in batches([(5, 23), (3, 40, False), (4, 100), (2, 5)]):
        with torch.inference_mode():
            want = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
            got = fused(ids, mask, output_hidden_states=True).hidden_states
            half = packed(ids, mask).last_hidden_state
        for ours, theirs in zip(got, want.hidden_states, strict=True):
            torch.testing.assert_close(real(ours, mask), real(theirs, mask), atol=2e-5,
                                       rtol=1e-4)
        cosine = F.cosine_similarity(real(half, mask), real(want.last_hidden_state, mask), -1)
        assert float(cosine.min()) > 0.999, (rows, width)
    fused.relative.table.weight.zero_()
    with torch.inference_mode():
        unbiased = fused(ids, mask).last_hidden_state
    gap = (real(unbiased, mask) - real(want.last_hidden_state, mask)).abs().max()
    assert float(gap) > 1e-2  # hundreds of times the tolerance above


def test_the_tanh_gelu_is_fused_as_the_tanh_gelu() -> None:
    model = tiny(hidden_act="gelu_pytorch_tanh")
    ids, mask = batch()
    with torch.inference_mode():
        want = model(input_ids=ids, attention_mask=mask).last_hidden_state
        got = FusedBert.from_model(model, onednn_fp32=True)(ids, mask).last_hidden_state
    torch.testing.assert_close(real(got, mask), real(want, mask), atol=2e-5, rtol=1e-4)


def test_bf16_under_autocast_stays_close_to_the_models_own_bf16() -> None:
    model = tiny()
    ids, mask = batch(rows=8, width=40)
    fused = FusedBert.from_model(model, onednn_fp32=True)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(input_ids=ids, attention_mask=mask).last_hidden_state
        got = fused(ids, mask).last_hidden_state
    assert got.dtype == torch.float32  # the states come back fp32, as under autocast
    cosine = F.cosine_similarity(real(got, mask), real(want.float(), mask), dim=-1)
    assert float(cosine.min()) > 0.999


@pytest.mark.parametrize(("dtype", "onednn_fp32"), [(torch.float32, True),
                                                   (torch.float32, False),
                                                   (torch.bfloat16, True)])
def test_packed_weights_give_the_same_states_bit_for_bit(dtype: torch.dtype,
                                                         onednn_fp32: bool) -> None:
    model = tiny(hidden_act="gelu_pytorch_tanh")
    ids, mask = batch(rows=8, width=40)
    plain, packed = (FusedBert.from_model(model, onednn_fp32) for _ in range(2))
    packed.pack(dtype)
    with torch.inference_mode():
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            want = plain(ids, mask, output_hidden_states=True).hidden_states
        got = packed(ids, mask, output_hidden_states=True).hidden_states  # its own dtype now
    for ours, theirs in zip(got, want, strict=True):
        assert torch.equal(ours, theirs)
    kinds = {type(getattr(layer, name)) for layer in packed.layers
             for name in ("qkv", "out_proj", "up", "down")}
    assert kinds == ({PackedLinear} if packs(dtype, onednn_fp32) else {torch.nn.Linear})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_products_take_a_few_row_counts_and_give_the_batchs_own_states(
        monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """Packed for oneDNN, each product runs over ``product_rows`` of the batch's tokens (zero
    rows after them, which stay finite), so a run compiles a few shapes; the states are the
    batch's own, as the products over its tokens alone give them."""
    fused = FusedBert.from_model(tiny(), onednn_fp32=True)
    fused.pack(dtype)
    assert fused.shaped
    calls = record_packed_products(monkeypatch)
    want_rows = []
    for rows, width in [(5, 23), (8, 40), (1, 3)]:
        ids, mask = batch(rows, width)
        tokens = int(mask.sum())  # the real tokens alone (``token_layout``)
        want_rows += [product_rows(tokens)] * 12 + [tokens] * 12
        with torch.inference_mode():
            got = fused(ids, mask, output_hidden_states=True).hidden_states
            fused.shaped = False
            want = fused(ids, mask, output_hidden_states=True).hidden_states
            fused.shaped = True
        assert all(state.shape == (rows, width, 48) for state in got)
        for ours, theirs in zip(got, want, strict=True):
            torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
    assert [call.rows for call in calls] == want_rows  # 4 products x 3 layers a forward
    assert all(call.finite for call in calls)
    assert want_rows[::12] == [128, 96, 256, 162, 16, 3]  # padded: 115, 320 tokens


@pytest.mark.parametrize("kind", ["bert", "mpnet", "distilbert"])
@pytest.mark.parametrize("unpadded", [True, False])
def test_the_last_layer_at_the_first_tokens_alone_is_the_whole_layers_first_tokens(
        monkeypatch: pytest.MonkeyPatch, kind: str, unpadded: bool) -> None:
    """``first_token_only``: [rows, 1, hidden], each row's first token of the whole forward's
    last layer (rows of several lengths, padded or reordered by length where unpadded; a
    batch without padding), in fp32 and, packed, bf16."""
    monkeypatch.setattr(attention, "unpadded_below", lambda dtype: 1 << 30 if unpadded else 0)
    fused, packed = fp32_and_bf16(tiny(kind, max_position_embeddings=200))
    for _, _, ids, mask in batches([(5, 23), (3, 40, False), (4, 100), (1, 7)]):
        assert_first_tokens_alone_are_the_whole_forwards([(fused, 2e-5), (packed, 3e-2)], ids,
                                                          mask)
    with pytest.raises(ValueError, match="first tokens alone"):
        fused(ids, mask, output_hidden_states=True, first_token_only=True)


@pytest.mark.parametrize("kind", ["bert", "mpnet", "distilbert"])
@pytest.mark.parametrize("unpadded", [True, False])
def test_the_first_tokens_attention_is_the_models_own_attention_probabilities(
        monkeypatch: pytest.MonkeyPatch, kind: str, unpadded: bool) -> None:
    """``first_token_attention``: [rows, width], each row's last-layer attention from its
    first token averaged over heads, as transformers' eager attention gives it (MPNet's with
    its relative position bias), zeros at padding; the same beside ``first_token_only``;
    packed bf16 within its rounding."""
    monkeypatch.setattr(attention, "unpadded_below", lambda dtype: 1 << 30 if unpadded else 0)
    model = tiny(kind, max_position_embeddings=200)
    model.set_attn_implementation("eager")
    fused, packed = fp32_and_bf16(model)
    for rows, width, ids, mask in batches([(5, 23), (3, 40, False), (1, 7)]):
        with torch.inference_mode():
            out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
            want = out.attentions[-1][:, :, 0, :].mean(dim=1) * mask
            got = fused(ids, mask, first_token_attention=True).first_token_attention
            with_first = fused(ids, mask, first_token_only=True, first_token_attention=True)
            half = packed(ids, mask, first_token_attention=True).first_token_attention
        assert got.shape == (rows, width) and got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(with_first.first_token_attention, got)
        torch.testing.assert_close(half, want, atol=2e-2, rtol=0)
        assert fused(ids, mask).first_token_attention is None


def test_a_cls_pooler_alone_takes_the_first_tokens_path_and_its_vectors(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The embedder asks for the first tokens alone where every pooler reads nothing else (a
    [CLS] pooler of the last layer), not beside a mean or over more layers; the vectors are
    those of the whole forward."""
    def embedder(*specs: PoolerSpec) -> Embedder:
        return Embedder(EncoderConfig(model=str(tiny_model_dir), dtype="fp32", device="cpu"),
                        list(specs))

    cls = embedder(PoolerSpec(name="cls"))
    assert cls.first_token_only
    assert not embedder(PoolerSpec(name="cls"), PoolerSpec(name="mean")).first_token_only
    assert not embedder(PoolerSpec(name="cls4", strategy="cls", layers=[-1, -2])).first_token_only
    asked = record_first_token_asks(monkeypatch, FusedBert)
    texts = TEXTS * 3
    first = cls.encode(texts)
    cls.first_token_only = False
    whole = cls.encode(texts)
    assert asked and set(asked[: len(asked) // 2]) == {True} and not any(asked[len(asked) // 2:])
    np.testing.assert_allclose(first, whole, atol=1e-6)


@pytest.mark.parametrize("width", [5, 19, 70])  # keys appended (MIN_KEYS); fp32/bf16 softmax
def test_attention_in_blocks_is_attention(monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    """fp32 attention is SDPA's; bf16 attention, in blocks of rows (no AMX), is SDPA's over the
    same (bf16) inputs within bf16's rounding, and the same bit for bit whatever the block."""
    monkeypatch.setattr(attention, "amx_here", lambda: False)
    torch.manual_seed(0)
    half = [torch.randn(7, 3, width, 16).bfloat16() for _ in range(3)]
    q, k, v = (t.float() for t in half)
    _, mask = batch(rows=7, width=width)
    for case in (mask, torch.ones_like(mask)):
        bias = attention.attention_bias(case, torch.float32)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)
        want = want.transpose(1, 2).reshape(7, width, 3 * 16)  # [rows, tokens, heads x head]
        torch.testing.assert_close(attend(q, k, v, bias), want, atol=1e-5, rtol=1e-5)
        bias = attention.attention_bias(case, torch.bfloat16)
        whole = attend(*half, bias)
        assert whole.dtype == torch.bfloat16
        torch.testing.assert_close(whole.float(), want, atol=0.05, rtol=0.02)
        narrow = None if bias is None else bias[..., :width]  # no keys appended
        torch.testing.assert_close(attend(*half, narrow).float(), want, atol=0.05, rtol=0.02)
        with monkeypatch.context() as patched:  # 2 rows a block
            patched.setattr(attention, "SCORE_BLOCK_BYTES", 2 * 3 * width * 16 * 2)
            torch.testing.assert_close(attend(*half, bias), whole, atol=0, rtol=0)


def test_each_kernel_takes_the_widths_and_dtypes_it_was_measured_fastest_at(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention.graph_attention, "_faster_here", lambda: True)
    monkeypatch.setattr(attention, "amx_here", lambda: True)  # AMX runs
    kernel = attention.attention_kernel
    narrow, wide = attention.AMX_SDPA_MIN_KEYS - 1, attention.graph_attention.MIN_KEYS
    assert [kernel(w, torch.bfloat16) for w in (narrow, narrow + 1, wide)] == [
        "blocked", "sdpa", "sdpa"]
    assert [kernel(w, torch.float32) for w in (narrow, wide)] == ["sdpa", "sdpa"]
    assert attention.key_width(wide + 1, torch.bfloat16) == wide + 1  # SDPA: no keys appended
    assert attention.query_width(wide + 1, torch.bfloat16) == wide + 1
    monkeypatch.setattr(attention, "amx_here", lambda: False)  # no AMX
    assert [kernel(w, torch.bfloat16) for w in (narrow, wide)] == ["blocked", "graph"]
    assert [kernel(w, torch.float32) for w in (narrow, wide)] == ["sdpa", "graph"]
    padded = graph_attention.key_width(wide + 1)  # oneDNN Graph pads queries as it pads keys
    assert attention.query_width(wide + 1, torch.float32) == padded > wide + 1
    assert attention.query_width(narrow, torch.bfloat16) == narrow  # blocked: none padded


def test_bf16_states_through_sdpa_where_amx_runs_match_the_models_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever this CPU: SDPA's bf16 attention (what an AMX CPU runs) gives transformers'
    states within bf16's rounding, in every layer, and rows too narrow for it stay blocked:
    each run of rows of one length (``token_layout``) takes the kernel of its own width."""
    monkeypatch.setattr(attention, "amx_here", lambda: True)
    model = tiny(max_position_embeddings=200)
    calls: list[int] = []
    sdpa = F.scaled_dot_product_attention
    wide: list[int] = []
    with torch.inference_mode():
        fused = FusedBert.from_model(model, onednn_fp32=True)
        fused.pack(torch.bfloat16)
        for width in (attention.AMX_SDPA_MIN_KEYS - 1, 150):
            ids, mask = batch(rows=6, width=width)
            mask[-1, 10:] = 0  # a narrow row beside wide ones
            ids = ids.masked_fill(mask == 0, 0)
            want = model(input_ids=ids, attention_mask=mask).last_hidden_state
            with monkeypatch.context() as patched:
                patched.setattr(F, "scaled_dot_product_attention",
                                lambda q, *a, **kw: calls.append(q.shape[2]) or sdpa(q, *a, **kw))
                got = fused(ids, mask).last_hidden_state
            cosine = F.cosine_similarity(real(got, mask), real(want, mask), dim=-1)
            assert cosine.min() > 0.999, width
            lengths = sorted(set(mask.sum(1).tolist()), reverse=True)
            wide += [n for n in lengths if n >= attention.AMX_SDPA_MIN_KEYS]
    assert 150 in wide and 10 not in wide
    assert calls == wide * 3  # 3 layers


@pytest.mark.parametrize("amx", [True, False])
def test_the_residual_stream_is_bf16_only_where_amx_runs_its_adds_then_in_the_products(
        monkeypatch: pytest.MonkeyPatch, amx: bool) -> None:
    """Where AMX runs, a bf16 forward carries its residual stream in bf16 and each add runs in
    the epilogue of the product it follows (two a layer, each forward); elsewhere, and in
    fp32, the stream stays fp32. Either way every layer's states come back fp32, close to
    transformers', and are kept only where asked for."""
    monkeypatch.setattr(attention, "amx_here", lambda: amx)
    model = tiny()
    ids, mask = batch(rows=8, width=40)
    fused = FusedBert.from_model(model, onednn_fp32=True)
    assert fused.residual_dtype(torch.float32) == torch.float32
    assert fused.residual_dtype(torch.bfloat16) == (torch.bfloat16 if amx else torch.float32)
    fused.pack(torch.bfloat16)
    calls = record_packed_products(monkeypatch)
    with torch.inference_mode():
        got = fused(ids, mask, output_hidden_states=True).hidden_states
        last = fused(ids, mask)  # no layer's states kept
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    added = [call.epilogue for call in calls if call.epilogue]
    assert added == ([(torch.bfloat16, "add")] * 4 * len(fused.layers) if amx else [])
    assert last.hidden_states is None and torch.equal(last.last_hidden_state, got[-1])
    for ours, theirs in zip(got, want.hidden_states, strict=True):
        assert ours.dtype == torch.float32
        cosine = F.cosine_similarity(real(ours, mask), real(theirs.float(), mask), dim=-1)
        assert float(cosine.min()) > 0.999


def test_fp32_residual_adds_run_after_the_product_the_same_bit_for_bit_as_in_its_epilogue(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Packed for oneDNN in fp32, a layer's two residual adds run as passes after their
    products (``PackedLinear.binary_after``), and give the states oneDNN's epilogue gives, bit
    for bit, whether the layer owns its input or not."""
    if not packs(torch.float32, True):
        pytest.skip("this torch runs no fp32 product through oneDNN")
    fused = FusedBert.from_model(tiny(), onednn_fp32=True)
    fused.pack(torch.float32)
    calls = record_packed_products(monkeypatch)
    ids, mask = batch(rows=6, width=31)

    def forwards() -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """Every layer's states (kept: no layer owns its input), then the last state alone
        (each layer adds into a stream it owns)."""
        with torch.inference_mode():
            kept = fused(ids, mask, output_hidden_states=True).hidden_states
            return kept, fused(ids, mask).last_hidden_state

    apart, apart_owned = forwards()
    assert [call.epilogue for call in calls if call.epilogue] == []
    assert [call.after for call in calls if call.after] == ["add"] * 2 * 2 * len(fused.layers)
    calls.clear()
    for packed in fused.modules():
        if isinstance(packed, PackedLinear):
            packed.binary_after = False  # oneDNN's epilogue, as bf16 takes it
    in_epilogue, in_epilogue_owned = forwards()
    added = [call.epilogue for call in calls if call.epilogue]
    assert added == [(torch.float32, "add")] * 2 * 2 * len(fused.layers)  # two forwards
    for ours, theirs in zip(apart, in_epilogue, strict=True):
        assert torch.equal(ours, theirs)
    assert torch.equal(apart_owned, in_epilogue_owned)
    assert torch.equal(apart_owned, apart[-1])


def test_the_attention_bias_masks_padding_and_short_rows_keys_finitely() -> None:
    _, mask = batch(rows=7, width=19)
    for dtype in (torch.float32, torch.bfloat16):
        bias = attention.attention_bias(mask, dtype)
        assert bias.dtype == dtype and bias.shape == (7, 1, 1, 19)
        assert torch.isfinite(bias).all() and (bias[:, 0, 0][mask == 0] < -1e38).all()
        assert (bias[:, 0, 0][mask == 1] == 0).all()
    full = torch.ones(3, 5, dtype=torch.long)
    assert attention.attention_bias(torch.ones(3, 17, dtype=torch.long), torch.bfloat16) is None
    assert attention.attention_bias(full, torch.float32) is None  # SDPA: nothing to mask
    short = attention.attention_bias(full, torch.bfloat16)
    assert short.shape == (3, 1, 1, attention.MIN_KEYS)  # keys appended up to MIN_KEYS
    assert (short[..., :5] == 0).all() and (short[..., 5:] < -1e38).all()


@pytest.mark.parametrize(("kind", "overrides", "expected"), [
    ("bert", {}, True),
    ("roberta", {}, True),
    ("camembert", {}, True),
    ("mpnet", {}, True),
    ("distilbert", {}, True),
    ("distilbert", {"sinusoidal_pos_embds": True}, True),  # the sinusoid is its stored table
    ("distilbert", {"hidden_act": "relu"}, False),
    ("electra", {}, True),
    ("electra", {"embedding_size": 48}, True),  # as wide as its layers: no projection
    ("electra", {"position_embedding_type": "relative_key"}, False),
    ("bert", {"hidden_act": "relu"}, False),
    ("bert", {"position_embedding_type": "relative_key"}, False),
    ("bert", {"is_decoder": True}, False),
    ("bert", {"auto_map": {"AutoModel": "modeling.CustomBert"}}, False),  # its own code
])
def test_only_models_it_computes_exactly_are_fused(kind: str, overrides: dict,
                                                   expected: bool) -> None:
    assert fusable(tiny(kind, **overrides).config, CPU) is expected
    # a GPU keeps the model's own forward
    assert not fusable(tiny(kind).config, torch.device("meta"))


def test_the_fused_model_refuses_to_invent_attention_weights() -> None:
    ids, mask = batch()
    with pytest.raises(ValueError, match="no attention weights"):
        FusedBert.from_model(tiny(), onednn_fp32=True)(ids, mask, output_attentions=True)


def test_the_encoder_fuses_where_it_may_and_the_vectors_stay_the_set(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def embedder(pooler: str, fuse: bool = True) -> Embedder:
        if not fuse:
            monkeypatch.setattr(fused_bert, "fusable", lambda model, device: False)
        cfg = EncoderConfig(model=str(tiny_model_dir), dtype="fp32", device="cpu")
        return Embedder(cfg, [PoolerSpec(name=pooler)])

    fused, attention = embedder("mean"), embedder("attention")
    assert fused.encoder.fused and isinstance(fused.encoder.model, FusedBert)
    assert attention.encoder.fused  # the first token's attention weights computed there
    plain, plain_attention = embedder("mean", fuse=False), embedder("attention", fuse=False)
    assert not plain.encoder.fused and not plain_attention.encoder.fused
    np.testing.assert_allclose(fused.encode(TEXTS), plain.encode(TEXTS), atol=1e-5)
    assert fused.fingerprint("mean") == plain.fingerprint("mean")
    # transformers' eager attention probabilities against the fused forward's
    np.testing.assert_allclose(attention.encode(TEXTS), plain_attention.encode(TEXTS),
                               atol=1e-5)
    assert attention.fingerprint("attention") == plain_attention.fingerprint("attention")


def test_a_row_without_real_tokens_gives_numbers_not_nans() -> None:
    model = tiny()
    ids, mask = batch(rows=3, width=9)
    mask[1] = 0  # e.g. an empty text under a tokenizer that adds no special tokens
    with torch.inference_mode():
        got = FusedBert.from_model(model, onednn_fp32=True)(ids, mask).last_hidden_state
        want = model(input_ids=ids, attention_mask=mask).last_hidden_state
        with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 scores and padding bias
            got_bf16 = FusedBert.from_model(model, onednn_fp32=True)(ids, mask).last_hidden_state
    assert torch.isfinite(got).all() and torch.isfinite(got_bf16).all()
    torch.testing.assert_close(got[0][mask[0].bool()], want[0][mask[0].bool()],
                               atol=2e-5, rtol=1e-4)
