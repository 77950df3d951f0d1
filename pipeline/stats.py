"""``ShardStats``: the one record of what a shard (or a whole run) did and where its time went.

A shard fills one; a run adds them up (``ShardStats.total``); the summary line, ``_SET.json``
and the flow's result read it. No other place keeps counters of rows, tokens or skips.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Literal, get_args

from pydantic import BaseModel

Stage = Literal["read", "tokenize", "encode", "write"]
STAGES: tuple[Stage, ...] = get_args(Stage)  # a shard's stages, in order
READER_STAGES: tuple[Stage, ...] = ("read", "tokenize")  # in the reader thread, beside encode


class ShardStats(BaseModel):
    rows: int = 0  # valid rows read
    embedded: int = 0  # rows whose vector came from this run's encoder
    encoded: int = 0  # distinct texts that went through the encoder
    duplicates: int = 0  # rows that shared the forward pass of an identical text
    reused: int = 0  # rows whose stored vector was kept (same id and content hash)
    tokens: int = 0  # content tokens through the encoder (after truncation)
    windows: int = 0  # encoder rows (pieces): one per text, more with windows
    truncated: int = 0  # texts cut at max_length
    skipped: dict[str, int] = {}  # reason -> rows
    seconds: dict[Stage, float] = {}  # busy seconds (stages overlap: they can sum > wall)

    def add_skipped(self, counts: Mapping[str, int]) -> None:
        self.skipped = dict(Counter(self.skipped) + Counter(counts))

    def add_seconds(self, stage: Stage, seconds: float) -> None:
        if stage not in STAGES:  # a misspelt stage would drop out of the summary line
            raise ValueError(f"unknown shard stage {stage!r}: not one of {', '.join(STAGES)}")
        self.seconds = {**self.seconds, stage: self.seconds.get(stage, 0.0) + seconds}

    def add_encoder(self, counts: Mapping[str, int]) -> None:
        """The embedder's per-batch counts (its ``EmbeddingBatch.stats``)."""
        self.tokens += int(counts.get("tokens", 0))
        self.windows += int(counts.get("windows", 0))
        self.truncated += int(counts.get("truncated", 0))

    @classmethod
    def total(cls, parts: Iterable[ShardStats]) -> ShardStats:
        out = cls()
        for p in parts:
            for field in ("rows", "embedded", "encoded", "duplicates", "reused", "tokens",
                          "windows", "truncated"):
                setattr(out, field, getattr(out, field) + getattr(p, field))
            out.add_skipped(p.skipped)
            for stage, s in p.seconds.items():
                out.add_seconds(stage, s)
        return out

    def stage_line(self) -> str:
        """``read 1.2s, tokenize 3.4s, ...`` in stage order."""
        return ", ".join(f"{s} {self.seconds[s]:.1f}s" for s in STAGES if s in self.seconds)
