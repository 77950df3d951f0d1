"""``embedpipe embed | backfill | schedule``: flags and a TOML file into an EmbedJob, then a flow.

Config file (all keys optional; flags win)::

    rows_per_shard = 20000
    runner = "threads"
    [encoder]
    model = "/models/minilm"
    max_length = 256
    window = { size = 128, stride = 96, agg = "mean" }
    [[poolers]]
    name = "cls_last4"
    strategy = "cls"
    layers = [-1, -2, -3, -4]

``--pooler NAME`` picks sets: a name defined under ``[[poolers]]`` keeps its options, any
other name is the built-in pooler of that name with defaults.
"""

from __future__ import annotations

import argparse
import sys
from typing import get_args

from pipeline.config import DType, EmbedJob, load_toml, parse
from pipeline.errors import ConfigError

_ENCODER_FLAGS = ("model", "device", "dtype", "max_length")
_JOB_FLAGS = ("id_column", "text_column", "runner", "dask_address", "workers", "rows_per_shard")


def register(subparsers: argparse._SubParsersAction) -> None:
    embed = subparsers.add_parser("embed", help="embed a Parquet corpus into pooler sets")
    _job_args(embed)
    embed.set_defaults(func=run_embed)
    backfill = subparsers.add_parser("backfill", help="add pooler sets to an existing OUT")
    _job_args(backfill, pooler_required=True)
    backfill.set_defaults(func=run_backfill)
    schedule = subparsers.add_parser("schedule", help="serve a nightly incremental deployment")
    _job_args(schedule)
    schedule.add_argument("--cron", required=True, help='cron schedule, e.g. "0 2 * * *" (UTC)')
    schedule.add_argument("--name", default="nightly", help="deployment name")
    schedule.set_defaults(func=run_schedule)


def _job_args(p: argparse.ArgumentParser, pooler_required: bool = False) -> None:
    p.add_argument("corpus", help="Parquet file, folder or glob (local or s3://)")
    p.add_argument("out", help="output folder (local or s3://)")
    p.add_argument("--config", help="TOML file with [encoder], [[poolers]] and job options")
    p.add_argument("--pooler", action="append", required=pooler_required, metavar="NAME",
                   help="pooler set to make (repeatable; default mean)")
    p.add_argument("--model", help="model folder or Hugging Face name (default: packaged MiniLM)")
    p.add_argument("--id-column", help="id column (default id)")
    p.add_argument("--text-column", help="text column (default text)")
    p.add_argument("--max-length", type=int, help="tokens per text or window (default: model's)")
    p.add_argument("--window", type=int, help="split long texts into windows of N tokens")
    p.add_argument("--stride", type=int, help="tokens between window starts")
    p.add_argument("--window-agg", choices=["mean", "max", "weighted", "first"])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", choices=get_args(DType))
    p.add_argument("--runner", choices=["threads", "processes", "dask"])
    p.add_argument("--dask-address", help="scheduler address (default: a local Dask cluster)")
    p.add_argument("--workers", type=int, help="parallel shards (default 1)")
    p.add_argument("--rows-per-shard", type=int, help="rows per shard (default 20000)")
    p.add_argument("--quarantine", action="store_true", default=None,
                   help="write skipped rows to OUT/_quarantine/")
    p.add_argument("--dedupe", action="store_true", default=None,
                   help="keep the first row of each duplicated id instead of failing")


def build_job(args: argparse.Namespace) -> EmbedJob:
    """Config file first, flags over it, validated into one EmbedJob."""
    config = load_toml(args.config) if args.config else {}
    encoder = dict(config.pop("encoder", {}))
    for key in ("model", "device", "dtype", "max_length", "window"):
        if key in config:
            encoder[key] = config.pop(key)
    defined = {p.get("name"): p for p in config.pop("poolers", [])}
    for key in _ENCODER_FLAGS:
        if getattr(args, key) is not None:
            encoder[key] = getattr(args, key)
    if args.window is not None or args.stride is not None or args.window_agg is not None:
        window = dict(encoder.get("window") or {})
        window.update(
            {k: v for k, v in (("size", args.window), ("stride", args.stride),
                               ("agg", args.window_agg)) if v is not None}
        )
        encoder["window"] = window
    job = {**config, "corpus": args.corpus, "out": args.out, "encoder": encoder}
    for key in _JOB_FLAGS:
        if getattr(args, key) is not None:
            job[key] = getattr(args, key)
    for key in ("quarantine", "dedupe"):
        if getattr(args, key):
            job[key] = True
    names = args.pooler or list(defined) or ["mean"]
    job["poolers"] = [defined.get(n, {"name": n}) for n in names]
    return parse(EmbedJob, job, f"embedding job{' (' + args.config + ')' if args.config else ''}")


def run_embed(args: argparse.Namespace) -> int:
    job = build_job(args)
    from flows.embed import embed_flow

    summary = embed_flow(job.model_dump(mode="json", exclude_unset=True), progress=True)
    print(summary["line"])
    return 0


def run_backfill(args: argparse.Namespace) -> int:
    job = build_job(args)
    if args.model is None and not args.config:
        job = _inherit_encoder(job)
    from flows.embed import backfill_flow

    summary = backfill_flow(job.model_dump(mode="json", exclude_unset=True), progress=True)
    print(summary["line"].replace("embedded", "backfilled", 1))
    return 0


def _inherit_encoder(job: EmbedJob) -> EmbedJob:
    """Without --model, a backfill uses the encoder that made the sets already in OUT."""
    from pipeline import sets

    existing = sets.list_sets(job.out)
    if not existing:
        raise ConfigError(f"{job.out} has no sets to backfill next to; use `embedpipe embed`")
    encoder = sets.read_meta(job.out, existing[0]).encoder
    encoder |= job.encoder.model_dump(mode="json", exclude_unset=True)
    return parse(EmbedJob, job.model_dump(mode="json") | {"encoder": encoder}, "backfill job")


def run_schedule(args: argparse.Namespace) -> int:
    job = build_job(args)
    from flows.schedule import nightly_deployment, serve

    deployment = nightly_deployment(job, args.cron, args.name)
    print(f"serving deployment nightly/{args.name} on cron {args.cron!r}; Ctrl-C to stop",
          file=sys.stderr)
    serve(deployment)
    return 0
