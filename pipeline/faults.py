"""Failpoints: make a named step fail on purpose, to prove that reruns lose nothing.

Set ``EMBEDPIPE_FAILPOINT="<point>:<skip>:<times>:<state folder>[:kill]"``: the hits of
``point`` are numbered across threads and processes (by creating files in the state folder),
and hits ``skip`` .. ``skip + times - 1`` raise ``InjectedFault``, an OSError, which the flows
treat as transient (retried), or with ``:kill`` end the process at once with SIGKILL (a
crash: no cleanup, no exception handler runs). Unset, a failpoint costs one dictionary
lookup. Points: ``read_shard``, ``write_part`` (before each part of a shard is written),
``write_marker`` (after a part and its hashes, before the marker), ``retire_part`` (a shard
that left the plan: after its marker is removed, before its part).
"""

from __future__ import annotations

import os
import signal

ENV = "EMBEDPIPE_FAILPOINT"


class InjectedFault(OSError):
    """Raised at an armed failpoint."""


def hit(point: str, where: str = "") -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    name, skip, times, rest = spec.split(":", 3)
    if name != point:
        return
    folder, _, action = rest.partition(":")
    n = _count(folder, point)
    if int(skip) <= n < int(skip) + int(times):
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise InjectedFault(f"injected fault at {point} (hit {n}) {where}".strip())


def _count(folder: str, point: str) -> int:
    """This hit's number: the first ``<point>-<n>`` file that did not exist yet."""
    os.makedirs(folder, exist_ok=True)
    n = 0
    while True:
        try:
            os.close(os.open(os.path.join(folder, f"{point}-{n}"), os.O_CREAT | os.O_EXCL))
            return n
        except FileExistsError:
            n += 1


def hits(folder: str, point: str) -> int:
    """How many times ``point`` was reached (for tests and reports)."""
    if not os.path.isdir(folder):
        return 0
    return sum(1 for name in os.listdir(folder) if name.startswith(f"{point}-"))
