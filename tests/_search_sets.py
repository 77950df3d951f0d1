"""A real set embedded with the tiny BERT (through the lead's embedder), plus its corpus."""

from __future__ import annotations

import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from _index_sets import write_changes, write_meta, write_part

from pipeline.config import EncoderConfig, PoolerSpec
from pipeline.embedder import get_embedder

TEXTS = [
    "the cat sat on the mat", "stock markets fell sharply today", "a recipe for lemon cake",
    "rust borrow checker explained", "how to train a neural network", "the history of rome",
    "python packaging with pyproject", "tips for growing tomatoes", "a guide to faiss indexes",
    "learning to play the violin", "weather forecast for the weekend", "quantum computing 101",
    "best hiking trails in the alps", "writing unit tests in pytest", "the moon landing of 1969",
    "making sourdough bread at home", "introduction to linear algebra", "jazz piano voicings",
    "how vaccines work", "chess openings for beginners",
]


def embedded_set(root: Path, model_dir: Path, name: str = "mean", texts=TEXTS,
                 strategy: str | None = None) -> Path:
    """OUT under ``root`` with one set of ``texts`` (ids 100, 101, ...) and the corpus file."""
    out = root / "out"
    corpus = root / "corpus.parquet"
    root.mkdir(parents=True, exist_ok=True)
    ids = list(range(100, 100 + len(texts)))
    pq.write_table(pa.table({"id": ids, "text": list(texts)}), corpus)
    encoder = EncoderConfig(model=str(model_dir), dtype="fp32", device="cpu")
    spec = PoolerSpec(name=name, strategy=strategy)
    emb = get_embedder(encoder, [spec])
    vectors = emb.encode(list(texts), name)
    (out / "sets" / name).mkdir(parents=True, exist_ok=True)
    write_part(out, name, "part-00000.parquet", ids, vectors)
    write_meta(out, name, {
        "name": name, "fingerprint": emb.fingerprint(name), "model": emb.info.model,
        "model_hash": emb.info.model_hash, "encoder": encoder.model_dump(mode="json"),
        "pooler": spec.model_dump(mode="json"), "dim": int(vectors.shape[1]),
        "dtype": "fp32", "normalize": spec.normalize, "max_length": emb.info.max_length,
        "window": None, "generation": 1, "id_type": "int64", "corpus": str(corpus),
        "id_column": "id", "text_column": "text", "token": uuid.uuid4().hex,
        "shards_done": 1, "rows_written": len(ids),  # as the run that wrote the part ended
    })
    write_changes(out, name, 1, ["part-00000.parquet"], [])
    return out
