"""``python -m flows.cli`` is ``embedpipe``."""

from flows.cli import run

run()
