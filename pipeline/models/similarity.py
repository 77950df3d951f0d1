"""How the model compares vectors: ``similarity_fn_name`` of ``config_sentence_transformers.json``.

This is what ``SentenceTransformer.similarity`` computes, cosine where the file names none (and
for a plain Hugging Face folder). Search follows it (``pipeline.sets.SetMeta.metric``): a model
without a Normalize module is searched by cosine, as its users compare its vectors, not by L2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, get_args

from pipeline.errors import ModelError
from pipeline.models.jsonfile import read_optional_json
from pipeline.models.prompts import CONFIG

Similarity = Literal["cosine", "dot", "euclidean", "manhattan"]
SIMILARITIES = get_args(Similarity)
ALIASES = {"dot_product": "dot"}  # sentence-transformers' other spelling
DEFAULT: Similarity = "cosine"


def read_similarity(folder: Path) -> Similarity:
    path = folder / CONFIG
    name = read_optional_json(path).get("similarity_fn_name") or DEFAULT
    name = ALIASES.get(name, name) if isinstance(name, str) else name
    if name not in SIMILARITIES:
        raise ModelError(f"{path}: similarity_fn_name {name!r} is not one of "
                         f"{', '.join(SIMILARITIES)} (embedpipe embeds one vector per text)")
    return name
