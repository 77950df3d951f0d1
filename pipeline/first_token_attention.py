"""The attention pooler's weights beside transformers' own forward, which then keeps SDPA.

transformers' model gives attention probabilities only through its eager attention: every
layer's, every query's ([rows, heads, tokens, tokens] a layer, all kept until the forward
ends), where the attention pooler reads one row of the last layer's, averaged over heads. Where
no fused forward runs the model (a GPU; a CPU without oneDNN), ``FirstTokenAttention`` keeps
the last layer's input (a forward pre-hook) and computes that row from the layer's own query and
key projections in fp32 (``pipeline.attention.first_query_weights``, as the fused forward
does), for the encoders whose attention scores are q k^T / sqrt(head) plus the padding mask
(``supported``): BERT, RoBERTa (XLM-RoBERTa, CamemBERT) and ELECTRA with absolute positions,
and DistilBERT. The others (MPNet's relative position bias, ModernBERT's rotary positions, a
model's own code), and a model handed on to ``torch.compile`` or ONNX, keep the eager model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pipeline import bert_family
from pipeline.attention import first_query_weights, masked_bias

if TYPE_CHECKING:
    from pipeline.models.recorded import ModelConfig

SUPPORTED_TYPES = bert_family.FUSABLE_TYPES - {"mpnet"}


def supported(config: ModelConfig) -> bool:
    """Whether ``FirstTokenAttention`` computes what the eager model of ``config`` gives."""
    return config.model_type in SUPPORTED_TYPES and bert_family.plain(config)


class FirstTokenAttention(torch.nn.Module):
    """The last layer's attention from each row's first token, averaged over heads, of the
    transformers ``model`` of ``config`` (``supported``): copies of its query and key
    projections (fp32, whatever the forward later casts or packs), its input kept by a hook
    on the layer from each forward to the next ``weights``."""

    def __init__(self, model: torch.nn.Module, config: ModelConfig) -> None:
        super().__init__()
        d = bert_family.dims(config)
        last = d.layers - 1
        self.heads, self.scale = d.heads, (d.hidden // d.heads) ** -0.5
        self.query, self.key = (
            _fp32_copy(model.get_submodule(bert_family.own_part(config.model_type, last, part)))
            for part in ("attention.self.query", "attention.self.key"))
        self._input: torch.Tensor | None = None
        layer = model.get_submodule(bert_family.own_part(config.model_type, last))
        layer.register_forward_pre_hook(self._keep, with_kwargs=True)

    def _keep(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        self._input = args[0] if args else kwargs["hidden_states"]

    def weights(self, mask: torch.Tensor) -> torch.Tensor:
        """[rows, tokens] fp32 for the forward just run over ``mask`` ([rows, tokens], nonzero
        at real tokens): zero at padding, as transformers' probabilities are."""
        if self._input is None:
            raise RuntimeError("no forward ran since the last attention weights were read")
        states, self._input = self._input.float(), None
        rows, width, _ = states.shape
        q = self.query(states[:, :1]) * self.scale
        k = self.key(states)
        q, k = (t.view(rows, -1, self.heads, t.shape[-1] // self.heads).transpose(1, 2)
                for t in (q, k))
        # the mask's bias as it is: ``attention_bias`` would ask the device whether any key
        # is masked (a GPU's sync each batch) to save the fused kernels an add
        bias = masked_bias(mask == 0, torch.float32)[:, None, None, :]
        return first_query_weights(q, k, bias)


def _fp32_copy(linear: torch.nn.Module) -> torch.nn.Linear:
    """An fp32 ``nn.Linear`` with ``linear``'s weight and bias, no gradients."""
    from pipeline.fused_bert import frozen

    return frozen(torch.nn.Linear, linear.weight.float(), linear.bias.float())
