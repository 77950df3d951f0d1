"""Plan a corpus into shards: pure code, no IO (the reader hands in each file's row groups).

A shard is a contiguous range of row groups of ONE file; its id is made from the file's name
(relative to the corpus root) and that range only, so the same corpus always plans into the
same shards and a rerun finds the done markers of an earlier run.

Why shards stay put as a corpus grows
-------------------------------------
Boundaries inside a file are cut greedily from the first row group: a shard closes as soon
as it holds at least ``rows_per_shard`` rows. A boundary therefore depends only on the row
groups before it, never on what follows, so:

* a new file adds new shards and leaves every other file's shards unchanged;
* row groups appended to a file leave all its closed shards unchanged; only the file's last,
  still open shard (fewer rows than the target) grows into a new range, hence a new id. The
  run that sees it reuses the vectors of the old range's unchanged rows and retires the old
  shard, so at most one shard per file is rewritten and nothing is embedded twice;
* a file rewritten in place (same name, other rows) keeps its shard ids when its row-group
  sizes stay the same; a shard's content digest (the footer's sizes and statistics of its id
  and text columns) tells a plain rerun to redo it, and the per-row content hashes stored
  with each set (``--incremental``) find exactly what changed.

A file stored as one huge row group becomes one shard: write corpora with row groups no
larger than ``rows_per_shard`` to get parallelism (pyarrow: ``row_group_size=``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from pipeline.config import stable_hash


class FileLayout(BaseModel):
    """What the planner needs to know about one corpus file: its row groups."""

    model_config = ConfigDict(frozen=True)

    name: str  # path relative to the corpus root: stable if the corpus moves
    url: str
    group_rows: tuple[int, ...]
    group_bytes: tuple[int, ...] = ()  # plain bytes per row group (the footer's total_byte_size)
    # per row group, a digest of what the footer says of its id and text columns' content
    # (``pipeline.corpus``): sizes and statistics (change detection)
    group_content: tuple[str, ...] = ()


class Shard(BaseModel):
    """Row groups ``[first_group, end_group)`` of one file; rows ``offset`` .. ``offset+rows``."""

    model_config = ConfigDict(frozen=True)

    id: str
    file: str  # FileLayout.name
    url: str
    first_group: int = Field(ge=0)
    end_group: int = Field(gt=0)
    offset: int = Field(ge=0)  # row number (within the file) of the first row
    rows: int = Field(ge=0)
    signature: str  # changes when the shard's row groups change size
    content: str = ""  # changes when the footer's sizes or statistics of its columns change

    @property
    def groups(self) -> range:
        return range(self.first_group, self.end_group)

    def overlaps(self, file: str, first_group: int, end_group: int) -> bool:
        return file == self.file and first_group < self.end_group and self.first_group < end_group


def shard_id(file: str, first_group: int, end_group: int) -> str:
    """``<readable file stem>-<8 hex of the file name>-g<first>-<end>``, safe as a file name."""
    stem = re.sub(r"\.parquet$", "", file.rsplit("/", 1)[-1])
    # a file name's first character is a letter, digit or "_" (names.FILE_NAME): "-2024.parquet"
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", stem).strip("._").lstrip("._-")[:40] or "file"
    return f"{slug}-{stable_hash(file, 8)}-g{first_group:05d}-{end_group:05d}"


def group_ranges(group_rows: Sequence[int], rows_per_shard: int) -> list[tuple[int, int]]:
    """Prefix-stable greedy cut: close a range once it holds ``rows_per_shard`` rows."""
    ranges, start, acc = [], 0, 0
    for i, n in enumerate(group_rows):
        acc += n
        if acc >= rows_per_shard:
            ranges.append((start, i + 1))
            start, acc = i + 1, 0
    if start < len(group_rows):
        ranges.append((start, len(group_rows)))
    return ranges


def plan_shards(files: Sequence[FileLayout], rows_per_shard: int) -> list[Shard]:
    """Every row group of every file in exactly one shard, in file then row order."""
    if rows_per_shard <= 0:
        raise ValueError("rows_per_shard must be positive")
    shards: list[Shard] = []
    for layout in sorted(files, key=lambda f: f.name):
        offsets = [0]
        for n in layout.group_rows:
            offsets.append(offsets[-1] + n)
        for first, end in group_ranges(layout.group_rows, rows_per_shard):
            sig = stable_hash(
                [layout.name, layout.group_rows[first:end], layout.group_bytes[first:end]]
            )
            content = (stable_hash(layout.group_content[first:end])
                       if layout.group_content else "")
            shards.append(
                Shard(
                    id=shard_id(layout.name, first, end),
                    file=layout.name,
                    url=layout.url,
                    first_group=first,
                    end_group=end,
                    offset=offsets[first],
                    rows=offsets[end] - offsets[first],
                    signature=sig,
                    content=content,
                )
            )
    ids = [s.id for s in shards]
    if len(set(ids)) != len(ids):  # two file names with the same slug and hash: astronomically rare
        raise ValueError("shard ids collide; rename one of the corpus files")
    return shards
