"""``ShardStats``: the one record of what a shard (or a whole run) did and where its time went.

The embedder fills one per ``encode_tokens`` call (tokens, pieces, padding), a shard adds those
up with its own rows, skips and stage seconds, a run adds the shards' (``ShardStats.total``);
the summary line, the run's Prefect artifact, ``_SET.json`` and the flow's result read it. No
other place keeps counters of rows, tokens or skips.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Literal, get_args

from pydantic import BaseModel

# load: the model, where a shard loads it (a worker process's first shard)
Stage = Literal["load", "read", "tokenize", "encode", "write"]
STAGES: tuple[Stage, ...] = get_args(Stage)  # a shard's stages, in order
READER_STAGES: tuple[Stage, ...] = ("read", "tokenize")  # in the reader thread, beside encode


class ShardStats(BaseModel):
    rows: int = 0  # valid rows read
    embedded: int = 0  # rows whose vector came from this run's encoder
    encoded: int = 0  # distinct texts that went through the encoder
    duplicates: int = 0  # rows that shared the forward pass of an identical text
    reused: int = 0  # rows whose stored vectors every set kept (same id and content hash)
    tokens: int = 0  # content tokens through the encoder (after truncation)
    windows: int = 0  # encoder rows (pieces): one per text, more with windows
    truncated: int = 0  # texts cut at max_length
    # token rows through the encoder's layers: every piece's tokens with its specials and prompt,
    # and the padding of the batches that run padded (a fused forward runs narrow ones unpadded)
    batch_tokens: int = 0
    padding: int = 0  # of ``batch_tokens``: the padding
    skipped: dict[str, int] = {}  # reason -> rows
    seconds: dict[Stage, float] = {}  # busy seconds (stages overlap: they can sum > wall)

    def add_skipped(self, counts: Mapping[str, int]) -> None:
        self.skipped = dict(Counter(self.skipped) + Counter(counts))

    def add_seconds(self, stage: Stage, seconds: float) -> None:
        if stage not in STAGES:  # a misspelt stage would drop out of the summary line
            raise ValueError(f"unknown shard stage {stage!r}: not one of {', '.join(STAGES)}")
        self.seconds = {**self.seconds, stage: self.seconds.get(stage, 0.0) + seconds}

    def add(self, other: ShardStats) -> None:
        """``other``'s counts, skips and seconds added to these."""
        for field in COUNTS:
            setattr(self, field, getattr(self, field) + getattr(other, field))
        self.add_skipped(other.skipped)
        for stage, s in other.seconds.items():
            self.add_seconds(stage, s)

    @classmethod
    def total(cls, parts: Iterable[ShardStats]) -> ShardStats:
        out = cls()
        for p in parts:
            out.add(p)
        return out

    @property
    def padding_share(self) -> float:
        """The padding's share of the token rows through the encoder's layers."""
        return self.padding / self.batch_tokens if self.batch_tokens else 0.0

    def stage_line(self) -> str:
        """``read 1.2s, tokenize 3.4s, ...`` in stage order."""
        return ", ".join(f"{s} {self.seconds[s]:.1f}s" for s in STAGES if s in self.seconds)

    def encoder_line(self) -> str:
        """``1,234 tokens (5 texts truncated), padding 3.2%``: what went through the encoder."""
        truncated = f" ({self.truncated:,} texts truncated)" if self.truncated else ""
        return f"{self.tokens:,} tokens{truncated}, padding {self.padding_share:.1%}"


COUNTS = tuple(name for name, info in ShardStats.model_fields.items() if info.annotation is int)
