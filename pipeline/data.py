"""The small data types that flow between steps: ids and texts in, ids and vectors out."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pipeline.stats import ShardStats


@dataclass(frozen=True)
class TextBatch:
    """Rows to embed: ``ids[i]`` is the corpus id of ``texts[i]``."""

    ids: list
    texts: list[str]

    def __post_init__(self) -> None:
        if len(self.ids) != len(self.texts):
            raise ValueError(f"TextBatch has {len(self.ids)} ids but {len(self.texts)} texts")

    def __len__(self) -> int:
        return len(self.texts)


@dataclass(frozen=True)
class EmbeddingBatch:
    """Vectors for a batch, one float32 matrix per pooler set, rows aligned with ``ids``."""

    ids: list
    vectors: dict[str, np.ndarray]
    stats: ShardStats = field(default_factory=ShardStats)  # tokens, pieces, padding

    def __post_init__(self) -> None:
        for name, matrix in self.vectors.items():
            if matrix.shape[0] != len(self.ids):
                raise ValueError(
                    f"set {name!r} has {matrix.shape[0]} vectors for {len(self.ids)} ids"
                )

    def __len__(self) -> int:
        return len(self.ids)
