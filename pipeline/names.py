"""Names read from OUT or from users, validated before they become part of a path.

Nothing read from disk is trusted: a set or index name from ``_SET.json`` or ``_INDEX.json``,
a file name recorded in a marker or a changes file, must be a plain name that cannot leave
the folder it is joined to: the patterns allow no separator, no leading dot, no scheme and no
control character.
"""

from __future__ import annotations

import re

from pipeline.errors import StorageError

# where OUT's writers put a shard's files: OUT/sets/<set>/part-<shard>.parquet, its keys in
# OUT/sets/<set>/_hashes/<shard>.parquet, its skipped rows in OUT/_quarantine/<shard>.parquet
PART_PREFIX = "part-"
HASHES = "_hashes"
QUARANTINE = "_quarantine"

SET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.=-]{0,199}$")


def set_name(name: object, where: str = "") -> str:
    """``name`` if it is a valid set (or index) name, else a StorageError naming ``where``."""
    if isinstance(name, str) and SET_NAME.fullmatch(name):
        return name
    raise StorageError(f"invalid set name {name!r}{_at(where)}: expected {SET_NAME.pattern}")


def file_name(name: object, where: str = "") -> str:
    """``name`` if it is a plain file name inside one folder, else a StorageError."""
    if isinstance(name, str) and FILE_NAME.fullmatch(name):
        return name
    raise StorageError(f"invalid file name {name!r}{_at(where)}: must be a plain name")


def _at(where: str) -> str:
    return f" in {where}" if where else ""
