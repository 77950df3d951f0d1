"""A BERT-family encoder's forward on a CPU with fewer, larger operations than transformers'.

transformers' BERT layer runs its three projections as three products, lets autocast cast the
same fp32 activations to bf16 before each, applies GELU as a pass of its own and hands
attention to ``scaled_dot_product_attention``, whose CPU kernel is slow for BERT's 32-wide heads
(MiniLM, 256 rows x 24 tokens: 25 GFLOP/s; 32 rows x 256 tokens: 126). On a 2-core AVX512-BF16
VM these took 47% of a bf16 forward over PyPI summaries while its products ran at ~90% of the
matrix peak. ``FusedBert`` runs the same arithmetic as:

* one [hidden, 3 x hidden] product for query, key and value (the 1/sqrt(head) scale folded into
  the query weights once), one cast of an fp32 residual stream per product;
* the batch's real tokens alone, flat (``pipeline.token_layout``: rows by length, attention
  once a run of rows of one length, over exactly its keys), so that no embedding, product or
  attention computes padding and a text's vector does not depend on its batch-mates (but
  padded where oneDNN Graph's attention kernel runs, ``unpadded_below``);
* the tokens flat, then zero rows up to ``pipeline.onednn.product_rows`` of them once
  the products run through oneDNN (``FusedBert.shaped``: packed, or int8 once calibrated), so
  that oneDNN compiles a few kernels a run, not four a batch (3,000 PyPI summaries, MiniLM
  bf16 on a 2-core AMX Xeon VM: 1.44-1.59 s -> 1.12-1.18 s; the planner fills those rows with
  texts, ``pipeline.batching.token_budget_batches``);
* GELU in the product's epilogue (oneDNN's fused ``linear_pointwise``; fp32 through oneDNN
  where the CPU probe timed it at least as fast as MKL (``pipeline.onednn.FUSED_MIN_GAIN``),
  else ``F.linear`` then ``F.gelu``);
* attention through the kernel measured fastest for the CPU, dtype and width
  (``pipeline.attention``).

The residual stream (but see ``FusedBert.residual_dtype``: bf16 where AMX runs, its adds then in
the products' epilogues), LayerNorms and returned states stay fp32, as under autocast. The
weights are the model's own state dict, under BERT's names (only query/key/value are concatenated;
packed for oneDNN once the encoder fixed the dtype, ``FusedBert.pack``), read by
``pipeline.models.loader.read_fused_weights`` straight from ``model.safetensors`` where it can
(else from the transformers model), so the model hash and the vectors' set are unchanged: fp32
states match transformers' within float rounding (tested), bf16 ones pass the same cosine >=
0.9999 check against fp32.

Used on a CPU for ``model_type`` bert / roberta / xlm-roberta / camembert / electra with
absolute positions and GELU, for distilbert and for mpnet (its relative position bias added to
the padding mask; what tells them apart: ``pipeline.bert_family``), the attention pooler's
weights too (``first_token_attention``), and not with ``--compile`` (which takes the
transformers model). ``dtype int8`` runs it too (``to_int8``) where oneDNN's int8
product and bf16 run natively here, else takes the transformers model to ONNX Runtime
(``pipeline.quantize``). A GPU keeps transformers' forward and SDPA's fused kernels.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pipeline import attention, bert_family, hardware
from pipeline.int8_ffn import Int8FeedForward
from pipeline.int8_linear import Int8Linear, calibrate
from pipeline.onednn import Binary, PackedLinear, packs, product_rows
from pipeline.token_layout import Layout, PaddedStates, Run

if TYPE_CHECKING:
    from pipeline.models.recorded import ModelConfig

GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}  # oneDNN's algorithm


def fusable(config: ModelConfig, device: torch.device) -> bool:
    """Whether ``FusedBert`` computes what the model of ``config`` computes, on ``device``."""
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and bert_family.plain(config) and bert_family.dims(config).activation in GELU)


@dataclass(frozen=True)
class FusedOutput:
    """What the encoder reads of a transformers model's output."""

    last_hidden_state: torch.Tensor
    hidden_states: Sequence[torch.Tensor] | None = None  # each layer's, padded when read
    # [rows, width] fp32: the last layer's attention from each row's first token, averaged
    # over heads (what the attention pooler reads of transformers' attention probabilities)
    first_token_attention: torch.Tensor | None = None


class Embeddings(torch.nn.Module):
    """The input embeddings: word + token type (where the model has them) + position, then
    LayerNorm, then (a narrower ELECTRA) the Linear that widens them to the layers'. Positions
    count from 0, or (RoBERTa, MPNet: ``bert_family.position_padding``) from the padding index
    + 1 over real tokens, padding keeping the index, as transformers'
    ``create_position_ids_from_input_ids`` does."""

    def __init__(self, config: ModelConfig, state: Mapping[str, torch.Tensor], eps: float
                 ) -> None:
        super().__init__()
        def table(name: str) -> torch.nn.Embedding:
            return torch.nn.Embedding.from_pretrained(state[f"embeddings.{name}.weight"],
                                                      freeze=True)

        self.word_embeddings, self.position_embeddings = table("word_embeddings"), table(
            "position_embeddings")
        types = "embeddings.token_type_embeddings.weight" in state  # not MPNet's, DistilBERT's
        self.token_type_embeddings = table("token_type_embeddings") if types else None
        self.norm = layer_norm_from(state, "embeddings.LayerNorm", eps)
        project = f"{bert_family.EMBEDDINGS_PROJECT}.weight" in state
        self.project = linear_from(state, bert_family.EMBEDDINGS_PROJECT) if project else None
        self.padding_idx = bert_family.position_padding(config)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None,
                layout: Layout) -> torch.Tensor:
        """The embeddings of the batch's tokens ([rows, width] ids) that ``layout`` puts in
        the stream, [tokens, hidden]: only those are looked up and normalized."""
        positions = self.positions(input_ids)
        x = self.word_embeddings(layout.flat(input_ids))
        if self.token_type_embeddings is not None:
            types = (layout.flat(token_type_ids) if token_type_ids is not None
                     else torch.zeros(len(x), dtype=torch.long))
            x = x + self.token_type_embeddings(types)
        x = self.norm(x + self.position_embeddings(layout.flat(positions)))
        return x if self.project is None else self.project(x)

    def positions(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Each token's position in its row ([rows, width]), as the model counts them."""
        if self.padding_idx is None:
            return torch.arange(input_ids.shape[1]).expand_as(input_ids)
        real = input_ids.ne(self.padding_idx).int()
        return (torch.cumsum(real, dim=1).type_as(real) * real).long() + self.padding_idx


class ProductLayer(torch.nn.Module):
    """A layer whose Linears (``PRODUCTS``, GELU after ``GELU_PRODUCT``'s) run as the fused
    forward runs them: packed for oneDNN once the dtype is fixed, the bias, GELU, a residual
    add or a gate's multiply in the product's epilogue where oneDNN runs it (in fp32 the
    residual or gate as a pass after it, ``PackedLinear.binary_after``). Subclasses set
    ``gelu`` (oneDNN's algorithm name) and ``onednn_fp32``."""

    PRODUCTS: tuple[str, ...] = ()
    GELU_PRODUCT = "up"
    gelu: str
    onednn_fp32: bool

    def pack(self, dtype: torch.dtype) -> None:
        """Run the products that are still ``nn.Linear`` in ``dtype`` through oneDNN over
        weights packed once (``PackedLinear``), where that runs here; else cast their weights
        to ``dtype`` once (an fp32 forward through MKL keeps them as they are)."""
        for name in self.PRODUCTS:
            linear = getattr(self, name)
            if not isinstance(linear, torch.nn.Linear):
                continue
            if packs(dtype, self.onednn_fp32):
                gelu = self.gelu if name == self.GELU_PRODUCT else None
                apart = dtype == torch.float32 and hardware.fp32_gelu_apart()
                setattr(self, name, PackedLinear(linear, dtype, gelu, gelu_apart=apart))
            else:
                linear.to(dtype)

    def _attention(self, qkv: torch.Tensor, runs: Sequence[tuple[Run, tuple]],
                   x: torch.Tensor, owned: bool, first: torch.Tensor | None,
                   weights: list[torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(context, the stream it is added to, whether the layer owns that stream): over
        every token of ``x``; with ``first`` (``x`` at each row's first token, a tensor the
        layer made) over those alone, whose queries alone are then attended. ``weights``:
        ``_attend``'s."""
        if first is None:
            return self._attend(qkv, runs, weights=weights), x, owned
        return self._attend(qkv, runs, first=len(first), weights=weights), first, True

    def _attend(self, qkv: torch.Tensor, runs: Sequence[tuple[Run, tuple]],
                first: int | None = None, weights: list[torch.Tensor] | None = None
                ) -> torch.Tensor:
        """Attention's context [tokens, hidden] from the query/key/value product's [tokens,
        3 x hidden] (its rows past the runs' tokens: zeros), once a run of rows, each with its
        inputs: its bias (one row's, which all its rows share, or each row's), then what
        ``positioned`` takes. ``first``: the context of each row's first query alone, [rows
        run by run, then zeros up to ``first``, hidden]. ``weights``: each run's
        ``first_query_weights`` appended, flat (the run's share of the stream)."""
        context = qkv.new_empty((len(qkv) if first is None else first, qkv.shape[1] // 3))
        end = 0
        for run, (bias, *positions) in runs:
            span = run.span
            heads = qkv[span].view(run.rows, run.width, 3, self.heads, -1).permute(
                2, 0, 3, 1, 4)
            q, k, v = self.positioned(heads, *positions)
            if bias is not None:
                bias = bias.expand(run.rows, *bias.shape[1:])
            if weights is not None:
                weights.append(attention.first_query_weights(q, k, bias).flatten())
            if first is None:
                out, end = context[span].view(run.rows, run.width, -1), span.stop
            else:  # one query a row, over the run's own keys (a padded bias's past them)
                q, bias = q[:, :, :1], None if bias is None else bias[:, :, :1, : run.width]
                out, end = context[end : end + run.rows].view(run.rows, 1, -1), end + run.rows
            # one query a row: SDPA's kernel (1,500 summaries, bf16, a 2-core AMX Xeon VM,
            # profiled: the blocked kernel's batched products 218 ms in all with these rows,
            # 53 ms with SDPA taking them, SDPA's own time 35 -> 37 ms)
            attention.attend(q, k, v, bias, out=out, kernel=None if first is None else "sdpa")
        context[end:] = 0
        return context

    def positioned(self, heads: torch.Tensor, *positions: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Query, key and value ([3, rows, heads, width, head]) with the positions the layer
        gives them in attention (none here: BERT's are in its embeddings)."""
        return heads[0], heads[1], heads[2]

    def _linear(self, x: torch.Tensor, layer: torch.nn.Module, dtype: torch.dtype,
                activation: bool = False, residual: torch.Tensor | None = None,
                times: torch.Tensor | None = None, owned: bool = False) -> torch.Tensor:
        """``layer(x)`` in ``dtype``, GELU after where ``activation``, ``+ residual`` or ``*
        times`` (a gated feed-forward's other half) where given: in the product's epilogue where
        that tensor has the product's dtype and oneDNN runs it (a ``PackedLinear`` in fp32
        applies it after, ``binary_after``), else as a pass of its own, in place into ``times``,
        into the product's output where it has the residual's dtype, or into ``residual`` where
        the layer ``owned`` it (made it, and no caller keeps it), else into a new tensor. An
        fp32 residual + a bf16 product: torch widens the product in a pass of its own first
        (1.06 ms against 0.70 for fp32 + fp32 over [32, 256, 384] on an AMX Xeon VM; in place
        over [4,096, 768] 0.91 against 1.21 ms); no CPU kernel of torch 2.13 writes a bf16
        product in fp32, see bench/RESULTS.md."""
        other, binary = (residual, "add") if times is None else (times, "mul")
        if other is None:
            return self._product(x, layer, dtype, activation, None)
        if other.dtype == dtype and self._onednn(layer, dtype):
            return self._product(x, layer, dtype, activation, other, binary)
        out = self._product(x, layer, dtype, activation, None)
        if times is not None:
            return times.mul_(out)
        if out.dtype == residual.dtype:  # into the product's own output: no copy of x
            return out.add_(residual)
        return residual.add_(out) if owned else residual + out

    def _onednn(self, layer: torch.nn.Module, dtype: torch.dtype) -> bool:
        """Whether ``_product`` runs ``layer`` through oneDNN's (non-int8) product."""
        return isinstance(layer, PackedLinear) or (
            not isinstance(layer, Int8Linear) and (dtype != torch.float32 or self.onednn_fp32))

    def _product(self, x: torch.Tensor, layer: torch.nn.Module, dtype: torch.dtype,
                 activation: bool, other: torch.Tensor | None,
                 binary: Binary = "add") -> torch.Tensor:
        """``layer(x)`` in ``dtype``, ``other`` added or multiplied (``binary``) in oneDNN's
        epilogue where given (an ``Int8Linear`` or a ``PackedLinear`` casts ``x`` and applies
        its GELU itself)."""
        if isinstance(layer, PackedLinear):
            return layer(x, other, binary)
        if isinstance(layer, Int8Linear):
            return layer(x)
        x, weight = x.to(dtype), layer.weight.to(dtype)  # no-ops once the dtype is fixed
        bias = None if layer.bias is None else layer.bias.to(dtype)
        if other is not None:
            return torch.ops.mkldnn._linear_pointwise.binary(x, other, weight, bias, binary)
        if self._onednn(layer, dtype):
            attr, algorithm = ("gelu", self.gelu) if activation else ("none", "")
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, attr, [], algorithm)
        out = F.linear(x, weight, bias)
        return F.gelu(out, approximate=self.gelu) if activation else out


class FusedLayer(ProductLayer):
    """One transformer layer: fused projections, blocked attention, post-LayerNorm residuals."""

    PRODUCTS = ("qkv", "out_proj", "up", "down")

    def __init__(self, dims: bert_family.Dims, state: Mapping[str, torch.Tensor],
                 onednn_fp32: bool) -> None:
        super().__init__()
        heads, eps = dims.heads, dims.eps
        scale = (dims.hidden // heads) ** -0.5
        self.qkv = _concat([(linear_from(state, "attention.self.query"), scale),
                            (linear_from(state, "attention.self.key"), 1.0),
                            (linear_from(state, "attention.self.value"), 1.0)])
        self.out_proj = linear_from(state, "attention.output.dense")
        self.norm1 = layer_norm_from(state, "attention.output.LayerNorm", eps)
        self.up = linear_from(state, "intermediate.dense")
        self.down = linear_from(state, "output.dense")
        self.norm2 = layer_norm_from(state, "output.LayerNorm", eps)
        self.heads, self.gelu, self.onednn_fp32 = heads, GELU[dims.activation], onednn_fp32
        self.ffn: Int8FeedForward | None = None  # up and down in int8 (``to_int8``)

    def forward(self, x: torch.Tensor, runs: Sequence[tuple[Run, tuple]], dtype: torch.dtype,
                owned: bool = False, first: torch.Tensor | None = None,
                weights: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The layer over ``x``: [tokens, hidden], the batch's ``runs`` of rows with each one's
        attention bias (``FusedEncoder.forward``), then rows of zeros up to its product rows,
        which stay finite; written in place where ``owned`` (no caller keeps it). ``first``:
        ``x`` at each row's first token (run by run, then zero rows up to its product rows),
        the layer there alone: keys and values over every token, the rest over those
        ([``len(first)``, hidden], into ``first``). ``weights``: the attention from each row's
        first token appended, run by run (``ProductLayer._attend``)."""
        context, x, owned = self._attention(self._linear(x, self.qkv, dtype), runs, x, owned,
                                            first, weights)
        x = self.norm1(self._linear(context, self.out_proj, dtype, residual=x, owned=owned))
        return self.norm2(self._feed_forward(x, dtype))

    def _feed_forward(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``x`` + the FFN's output (into ``x``, which the layer made, where not added in the
        product's epilogue)."""
        if self.ffn is not None:
            return self.ffn(x)
        inner = self._linear(x, self.up, dtype, activation=True)
        return self._linear(inner, self.down, dtype, residual=x, owned=True)

    def to_int8(self) -> None:
        """Query/key/value, the attention output and the FFN (``pipeline.int8_ffn``, settled
        once calibrated) in int8."""
        self.qkv, self.out_proj = Int8Linear(self.qkv), Int8Linear(self.out_proj)
        self.ffn = Int8FeedForward(self.up, self.down, self.gelu)
        self.up = self.down = None


class FusedEncoder(torch.nn.Module):
    """What the fused forwards share (``FusedBert``, ``pipeline.fused_modernbert.
    FusedModernBert``): built from the model's config and own state dict (no prefix; the
    names ``checkpoint_weights`` gives), called like the transformers model, run in the dtype
    ``pack`` fixed (else autocast's, else fp32), the batch's tokens flat over
    ``product_rows`` rows once oneDNN runs every product."""

    ARCHITECTURE: str  # in messages
    INT8 = False  # has an int8 path (``to_int8``)
    layers: torch.nn.ModuleList  # of ``ProductLayer``

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.dtype: torch.dtype | None = None  # fixed by ``pack``: else autocast's, or fp32
        self.shaped = False  # products over ``product_rows`` rows: where oneDNN runs them all

    @classmethod
    def checkpoint_weights(cls, config: ModelConfig) -> tuple[dict[str, tuple[int, ...]], str]:
        """The weights this forward reads, as the model's own state dict names them, and
        their shapes; and the base model's name inside its task models' checkpoints."""
        raise NotImplementedError

    @classmethod
    def from_model(cls, model: torch.nn.Module, onednn_fp32: bool) -> FusedEncoder:
        """The fused twin of a loaded transformers model: the same weights."""
        return cls(model.config, model.state_dict(), onednn_fp32)

    def pack(self, dtype: torch.dtype) -> None:
        """Run in ``dtype`` from now on, the products over packed weights where they run here
        (``ProductLayer.pack``): once the encoder chose its dtype."""
        for layer in self.layers:
            layer.pack(dtype)
        self.dtype, self.shaped = dtype, packs(dtype, self.layers[0].onednn_fp32)

    def forward_dtype(self) -> torch.dtype:
        """The dtype this call's products run in."""
        if self.dtype is not None:
            return self.dtype
        if torch.is_autocast_enabled("cpu"):
            return torch.get_autocast_dtype("cpu")
        return torch.float32

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None, output_hidden_states: bool = False,
                output_attentions: bool = False, first_token_only: bool = False,
                first_token_attention: bool = False) -> FusedOutput:
        """The transformers model's call: the embeddings (``embed``), then each layer over the
        batch's tokens flat (``layout``) with its own inputs for each run of rows
        (``layer_inputs``), written in place where no state is kept, the last one through
        ``final``; the states as transformers gives them, fp32 (zeros at the padding where
        the stream held the real tokens alone), each layer's padded when read
        (``PaddedStates``). ``first_token_only``: the last layer
        at each row's first token alone, [rows, 1, hidden]; its queries, attention output and
        feed-forward over one token a row instead of all (a [CLS] pooler reads no more).
        ``first_token_attention``: the last layer's attention from each row's first token,
        averaged over heads, too (``FusedOutput.first_token_attention``; the attention pooler
        reads no more of the weights)."""
        if output_attentions:
            raise ValueError(f"{self.ARCHITECTURE}'s fused forward computes no attention "
                             "weights but the first token's (first_token_attention); use "
                             "the model's own")
        if first_token_only and output_hidden_states:
            raise ValueError(f"{self.ARCHITECTURE}'s fused forward computes the first tokens "
                             "alone only where it keeps no hidden states")
        dtype = self.forward_dtype()
        layout = self.layout(attention_mask, dtype)
        with torch.autocast("cpu", enabled=False):
            x = self.stream(self.embed(input_ids, token_type_ids, layout), dtype)
            layers = [(layer, list(zip(layout.runs, runs, strict=True))) for layer, runs in
                      zip(self.layers, self.layer_inputs(attention_mask, layout, dtype),
                          strict=True)]
            last_layer, last_runs = layers.pop()
            states = [x] if output_hidden_states else None  # else each freed once read
            for layer, runs in layers:
                x = layer(x, runs, dtype, owned=states is None)
                if states is not None:
                    states.append(x)
            weights = [] if first_token_attention else None  # the last layer's, run by run
            if first_token_only:
                last = self._first_tokens(last_layer, last_runs, x, dtype, layout, weights)
            else:
                x = last_layer(x, last_runs, dtype, owned=states is None, weights=weights)
                last = layout.batch(self.final(x[: layout.tokens]))
        hidden = None if states is None else PaddedStates(layout, states, last)
        return FusedOutput(last, hidden, attention.first_weights(weights, layout))

    def _first_tokens(self, layer: FusedLayer, runs: list, x: torch.Tensor, dtype: torch.dtype,
                      layout: Layout, weights: list[torch.Tensor] | None) -> torch.Tensor:
        """The last ``layer`` at each row's first token ([rows, 1, hidden], fp32, in the
        batch's row order), over the stream ``x`` the layers before it made (``weights``: its
        forward's)."""
        at, rows = layout.first_tokens()
        first = self.stream(x[at], dtype)
        y = self.final(layer(x, runs, dtype, first=first, weights=weights)[: len(at)])
        out = y.new_zeros((layout.shape[0], 1, y.shape[-1]), dtype=torch.float32)
        out[rows, 0] = y.float()
        return out

    def embed(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None,
              layout: Layout) -> torch.Tensor:
        """The embeddings of the tokens ``layout`` puts in the stream (the batch's ids are
        [rows, width]), [tokens, hidden] in fp32."""
        raise NotImplementedError

    def residual_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The residual stream's dtype in a forward whose products run in ``dtype``."""
        return torch.float32

    def unpadded_below(self) -> int:
        """Batches narrower than this many tokens run unpadded (module's ``unpadded_below``)
        in the dtype ``pack`` fixed."""
        return attention.unpadded_below(self.dtype or torch.float32)

    def layout(self, mask: torch.Tensor, dtype: torch.dtype) -> Layout:
        """The batch's tokens unpadded (``token_layout``) where it is narrower than
        ``unpadded_below``, else padded."""
        if mask.shape[1] < attention.unpadded_below(dtype):
            return Layout.unpadded(mask)
        return Layout.padded(mask)

    def layer_inputs(self, mask: torch.Tensor, layout: Layout, dtype: torch.dtype
                     ) -> list[list[tuple]]:
        """Each layer's inputs for each run of ``layout`` (its attention bias, ...), built once
        a forward."""
        raise NotImplementedError

    def final(self, x: torch.Tensor) -> torch.Tensor:
        """The last layer's output [tokens, hidden] as the model returns it (as it is here)."""
        return x

    def stream(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The embeddings [tokens, hidden] as the residual stream (``residual_dtype``), then
        zero rows up to the products' shape where the forward is ``shaped``: one pass."""
        tokens, residual = len(x), self.residual_dtype(dtype)
        rows = product_rows(tokens) if self.shaped else tokens
        if rows == tokens:
            return x.to(residual)
        out = x.new_empty((rows, x.shape[1]), dtype=residual)
        out[tokens:] = 0
        out[:tokens] = x
        return out


class FusedBert(FusedEncoder):
    """A BERT-family encoder with a fused forward (``bert_family.weight_shapes``)."""

    ARCHITECTURE, INT8 = "BERT-family", True

    def __init__(self, config: ModelConfig, state: Mapping[str, torch.Tensor],
                 onednn_fp32: bool) -> None:
        super().__init__(config)
        self.int8 = False  # ``to_int8``
        state, dims = bert_family.bert_names(config, state), bert_family.dims(config)
        self.dims = dims  # its sizes, whatever its config calls them
        self.embeddings = Embeddings(config, state, dims.eps)
        relative = state.get(bert_family.RELATIVE_BIAS)
        self.relative = None if relative is None else bert_family.RelativeBias(relative)
        self.layers = torch.nn.ModuleList(
            FusedLayer(dims, under(state, f"encoder.layer.{i}."), onednn_fp32)
            for i in range(dims.layers))

    @classmethod
    def checkpoint_weights(cls, config: ModelConfig) -> tuple[dict[str, tuple[int, ...]], str]:
        return (bert_family.weight_shapes(config),
                bert_family.CHECKPOINT_PREFIX.get(config.model_type, ""))

    def to_int8(self, calibration: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Run in int8 from now on: each layer's products through oneDNN's int8 inner
        product, everything else in bf16 (``dtype int8`` where ``pipeline.int8_linear.
        onednn_int8_available``); their inputs' scales fixed by a forward over
        ``calibration``'s (ids, mask) batches (``int8_linear.calibration_batches``), which
        also finds the feed-forward channels kept apart in fp32 (``pipeline.int8_ffn``)."""
        for layer in self.layers:
            layer.to_int8()
        self.dtype, self.int8 = torch.bfloat16, True
        ranges = calibrate(self, calibration)
        for layer in self.layers:
            layer.ffn.settle(ranges)
        self.shaped = True  # after the calibration, which the zero rows would widen

    def embed(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None,
              layout: Layout) -> torch.Tensor:
        return self.embeddings(input_ids, token_type_ids, layout)

    def layer_inputs(self, mask: torch.Tensor, layout: Layout, dtype: torch.dtype
                     ) -> list[list[tuple]]:
        """Every layer's attention bias for each run, the same ones (``_attention_bias``)."""
        biases = [(self._attention_bias(m, dtype),) for m in layout.masks(mask)]
        return [biases] * len(self.layers)

    def _attention_bias(self, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """What every layer adds to its attention scores: the padding mask
        (``attention_bias``), plus MPNet's relative position bias ([rows, heads,
        ``query_width``, keys]; a view of one row's where nothing is masked). Built once a
        forward."""
        padding = attention.attention_bias(mask, dtype)
        if self.relative is None:
            return padding
        rows, width = mask.shape
        keys = width if padding is None else padding.shape[-1]
        relative = self.relative(attention.query_width(width, dtype), keys, dtype)
        return relative.expand(rows, -1, -1, -1) if padding is None else relative + padding

    def residual_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The residual stream's dtype in a forward whose products run in ``dtype``: fp32, as
        under autocast; but bf16 where AMX runs (``amx_here``) and the products are bf16, not
        int8. There the products are fast enough that the fp32 stream's passes (a cast before
        each product, a widening before each add) cost more than they buy: with the stream in
        bf16 its adds run in the products' epilogues (``FusedLayer._linear``) and the casts
        are gone. MiniLM, bf16, on a 2-core AMX Xeon VM: 300 long texts 2.07 -> 1.78 s, 2,000
        summaries 1.32 -> 1.21 s; min cosine to fp32 0.99996 -> 0.99995 and -> 0.99993. On an
        AVX512-BF16 EPYC VM (no AMX) it was no faster, so the stream stays fp32 there."""
        bf16 = dtype == torch.bfloat16 and not self.int8 and attention.amx_here()
        return torch.bfloat16 if bf16 else torch.float32


def variant() -> str:
    """The fused forward's name in the caches of measurements made with it (the dtype check):
    where AMX runs its arithmetic differs (``FusedBert.residual_dtype``)."""
    return "fused-amx" if attention.amx_here() else "fused"


def under(state: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The weights of ``state`` under ``prefix``, named without it."""
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def linear_from(state: Mapping[str, torch.Tensor], name: str) -> torch.nn.Linear:
    """The Linear ``name`` of ``state`` (no bias where it has none: ModernBERT's)."""
    return frozen(torch.nn.Linear, state[f"{name}.weight"], state.get(f"{name}.bias"))


def layer_norm_from(state: Mapping[str, torch.Tensor], name: str, eps: float
                    ) -> torch.nn.LayerNorm:
    """The LayerNorm ``name`` of ``state`` (no bias where it has none)."""
    norm = frozen(torch.nn.LayerNorm, state[f"{name}.weight"], state.get(f"{name}.bias"))
    norm.eps = eps
    return norm


def _concat(scaled: list[tuple[torch.nn.Linear, float]]) -> torch.nn.Linear:
    """One Linear computing the outputs of ``scaled``'s Linears side by side, each times its
    scale."""
    with torch.no_grad():
        weight = torch.cat([lin.weight * scale for lin, scale in scaled])
        bias = torch.cat([lin.bias * scale for lin, scale in scaled])
    return frozen(torch.nn.Linear, weight, bias)


def frozen(kind: type[torch.nn.Module], weight: torch.Tensor, bias: torch.Tensor | None
           ) -> torch.nn.Module:
    """A ``Linear`` or ``LayerNorm`` holding copies of ``weight`` and ``bias`` (None: none),
    no gradients; built without the random initialisation its constructor would run, all of
    it overwritten (MiniLM's build: 0.061 -> 0.024 s)."""
    shape = (weight.shape[1], weight.shape[0]) if kind is torch.nn.Linear else weight.shape[:1]
    module = kind(*shape, bias=bias is not None, device="meta", dtype=weight.dtype)
    module.weight = torch.nn.Parameter(weight.detach().clone(), requires_grad=False)
    if bias is not None:
        module.bias = torch.nn.Parameter(bias.detach().clone(), requires_grad=False)
    return module
