"""``embedpipe embed | backfill | schedule``: flags into an EmbedJob (``pipeline.assembly``),
checked before any orchestration starts, then a flow."""

from __future__ import annotations

import argparse
import json
import sys
from typing import get_args

from pipeline.config import Device, DType, Int8Kernel, Runner, WindowAgg


def register(subparsers: argparse._SubParsersAction) -> None:
    embed = subparsers.add_parser("embed", help="embed a Parquet corpus into pooler sets")
    _job_args(embed)
    embed.add_argument("--index", action="store_true",
                       help="then catch up each set's index, in the same flow run")
    embed.add_argument("--incremental", action="store_true",
                       help="re-read every shard, embed only new or changed rows (nightly)")
    _json_arg(embed)
    embed.set_defaults(func=run_embed)
    backfill = subparsers.add_parser("backfill", help="add pooler sets to an existing OUT")
    _job_args(backfill, pooler_required=True)
    _json_arg(backfill)
    backfill.set_defaults(func=run_backfill)
    schedule = subparsers.add_parser("schedule", help="serve a nightly incremental deployment")
    _job_args(schedule)
    schedule.add_argument("--cron", required=True, help='cron schedule, e.g. "0 2 * * *" (UTC)')
    schedule.add_argument("--name", default="nightly", help="deployment name")
    schedule.add_argument("--no-index", dest="index", action="store_false",
                          help="embed only; by default each run also catches up the indexes")
    schedule.set_defaults(func=run_schedule)


def _job_args(p: argparse.ArgumentParser, pooler_required: bool = False) -> None:
    p.add_argument("corpus", help="Parquet file, folder or glob (local or s3://)")
    p.add_argument("out", help="output folder (local or s3://)")
    p.add_argument("--config", help="TOML file with [encoder], [[poolers]] and job options")
    default = ("" if pooler_required else "; default: every set already in OUT, else model "
               "for a sentence-transformers folder, else mean")
    p.add_argument("--pooler", action="append", required=pooler_required, metavar="NAME",
                   help=f"pooler set to make (repeatable{default})")
    p.add_argument("--model", help="model folder or Hugging Face name (default: packaged MiniLM)")
    p.add_argument("--id-column", help="id column (default id)")
    p.add_argument("--text-column", help="text column (default text)")
    p.add_argument("--max-length", type=int, help="tokens per text or window (default: model's)")
    p.add_argument("--window", type=int, help="split long texts into windows of N tokens")
    p.add_argument("--stride", type=int, help="tokens between window starts")
    p.add_argument("--window-agg", choices=get_args(WindowAgg))
    p.add_argument("--device", choices=get_args(Device))
    p.add_argument("--dtype", choices=get_args(DType))
    p.add_argument("--int8-kernel", choices=get_args(Int8Kernel),
                   help="where --dtype int8 runs (default auto: oneDNN in the fused forward "
                   "where this model and CPU allow it, else ONNX Runtime)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="run the model through torch.compile (a compile on the first batch, "
                   "MiniLM on 2 cores: 14-25 s): for models the fused CPU forward does not "
                   "run, and GPUs")
    p.add_argument("--runner", choices=get_args(Runner))
    p.add_argument("--dask-address", help="scheduler address (default: a local Dask cluster)")
    p.add_argument("--workers", type=int,
                   help="parallel shards (default 1); with --dask-address, the Dask worker "
                        "processes each machine runs (torch threads = cores // N)")
    p.add_argument("--rows-per-shard", type=int, help="rows per shard (default 20000)")
    p.add_argument("--lease-wait", type=float, metavar="SECONDS",
                   help="wait for another writer of OUT to finish (default: fail at once)")
    p.add_argument("--quarantine", action=argparse.BooleanOptionalAction, default=None,
                   help="write skipped rows to OUT/_quarantine/")
    p.add_argument("--dedupe", action=argparse.BooleanOptionalAction, default=None,
                   help="keep the first row with a valid text of each duplicated id "
                        "instead of failing")


def _json_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true",
                   help="print the run's summary as one JSON object (counts, seconds per stage,"
                   " index results) instead of the summary line")


def _options(args: argparse.Namespace) -> dict:
    """The job options (``pipeline.assembly.OPTIONS``) as the flags give them."""
    from pipeline.assembly import OPTIONS

    return {key: getattr(args, key) for key in OPTIONS}


def run_embed(args: argparse.Namespace) -> int:
    import embedpipe

    summary = embedpipe.embed(args.corpus, args.out, poolers=args.pooler, config=args.config,
                              index=args.index, incremental=args.incremental, progress=True,
                              **_options(args))
    if args.json:
        print(json.dumps(summary))
        return 0
    print(summary["line"])
    if args.index:
        from pipeline.index import IndexResult

        for result in summary["index"]:
            print(IndexResult.model_validate(result).summary())
    return 0


def run_backfill(args: argparse.Namespace) -> int:
    import embedpipe

    summary = embedpipe.backfill(args.corpus, args.out, poolers=args.pooler, config=args.config,
                                 progress=True, **_options(args))
    print(json.dumps(summary) if args.json else summary["line"])
    return 0


def run_schedule(args: argparse.Namespace) -> int:
    from flows.runtime import check_scheduler
    from pipeline.assembly import build_job, check_input

    check_scheduler()
    job = build_job(args.corpus, args.out, config=args.config, poolers=args.pooler,
                    **_options(args))
    check_input(job)
    from flows.runtime import check_server
    from flows.schedule import nightly_deployment, serve
    from pipeline.assembly import check_runs

    deployment = nightly_deployment(job, args.cron, args.name, index=args.index)
    check_runs(job)
    check_server()
    print(f"serving deployment {args.name} on cron {args.cron!r}; Ctrl-C to stop",
          file=sys.stderr)
    serve(deployment)
    return 0
