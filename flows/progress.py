"""What a person at a terminal sees of a run while it works (a log file gets the run logger's)."""

from __future__ import annotations

import sys
from collections.abc import Callable


def phase_printer(progress: bool) -> Callable[[str], None]:
    """Phases of a run on stderr, from the first second, when a terminal user is watching."""
    watching = progress and sys.stderr.isatty()  # a log file gets the run logger's lines

    def say(msg: str) -> None:
        if watching:  # not print(): a flow's log_prints would turn it into a log record
            sys.stderr.write(f"embedpipe: {msg}\n")
            sys.stderr.flush()

    return say
