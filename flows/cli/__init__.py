"""The ``embedpipe`` command line: one module per group of commands, each a thin layer.

Each module in ``COMMAND_MODULES`` exposes ``register(subparsers)``, adding its
sub-commands with ``set_defaults(func=...)``; ``func(args) -> int`` is the exit code.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from flows.runtime import prepare
from pipeline.errors import EmbedpipeError

COMMAND_MODULES = (
    "flows.cli.embed",
    "flows.cli.search",
    "flows.cli.train",
    "flows.cli.demo",
)


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line, as the commands' own (exit code 2 as before)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        """As argparse, but a command whose last positional takes words to the end
        (``trailing``: the dest) takes them between its options too (``query OUT --set NAME
        some words``): argparse alone gives its positionals the first run of words only.
        After a ``--`` that argparse left over, every word is one of them (``query OUT -k 3
        -- -fno-pic flag``)."""
        parsed, extra = self.parse_known_args(args, namespace)
        trailing = getattr(parsed, "trailing", None)
        cut = extra.index("--") if "--" in extra else len(extra)
        if extra and trailing and not any(word.startswith("-") for word in extra[:cut]):
            getattr(parsed, trailing).extend(extra[:cut] + extra[cut + 1:])
        elif extra:  # named by the command they were given to: its --help lists its options
            command = self.commands.get(getattr(parsed, "command", None), self)
            command.error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed

    @property
    def commands(self) -> dict[str, argparse.ArgumentParser]:
        """The sub-commands' parsers by name (none before ``build_parser`` adds them)."""
        found = [a for a in self._actions if isinstance(a, argparse._SubParsersAction)]
        return dict(found[0].choices) if found else {}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="embedpipe", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # that group of commands is not written yet
                continue
            raise
        module.register(subparsers)
    return parser


def quiet_prefect() -> None:
    """Prefect's INFO lines would fight the progress bar, and a failed run's traceback would
    bury the one-line reason the CLI prints; a busy machine needs longer to start the
    ephemeral API than Prefect's default 20 s.

    On a Prefect server (``PREFECT_API_URL`` set) only the terminal is quieted: the runs'
    INFO logs still reach the server's UI."""
    # "Still processing items: N items remaining..." when a run's last events are still
    # queued at exit: they are sent all the same (see flows.runtime._drain)
    for worker in ("EventsWorker", "APILogWorker"):
        logging.getLogger(worker).setLevel(logging.ERROR)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    # --runner dask: the local cluster's scheduler, nanny and worker processes log INFO lines
    # on stderr (~30 a run); read from the environment by each process as it imports dask
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")
    if os.environ.get("PREFECT_API_URL"):
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
        return
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    for name in ("FLOW_RUNS", "TASK_RUNS"):
        os.environ.setdefault(f"PREFECT_LOGGING_LOGGERS_PREFECT_{name}_LEVEL", "CRITICAL")


def run() -> NoReturn:
    """The ``embedpipe`` command (console script and ``python -m flows.cli``): ``main``, then
    the interpreter's usual shutdown (non-daemon threads joined, every exit hook run: queued
    Prefect logs and events sent) but not its teardown of modules and objects, which took
    about 1 s after each run once torch, transformers and a model were loaded. A ``main``
    that raised exits the usual way, traceback and all."""
    code = main()
    _exit_code.append(code)
    sys.exit(code)


_exit_code: list[int] = []  # set by run() once main() returned


@atexit.register  # registered when the CLI is first imported: it runs after later hooks
def _skip_teardown() -> None:
    if not _exit_code:
        return  # main() raised, or the CLI was called in-process (tests): the usual exit
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        # a closed pipe (`| head`): nothing left to say there
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(_exit_code[0])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_prefect()
    try:
        from pipeline.settings import load_settings

        load_settings().export_env()
        prepare(args.command)  # threads; one reused Prefect API instead of one per run
        return int(args.func(args) or 0)
    except EmbedpipeError as exc:
        print(f"embedpipe {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"embedpipe {args.command}: interrupted; rerun to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    run()
