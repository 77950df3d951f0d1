"""``embedpipe train-pooler``: train a pooling head for the ``learned`` pooler."""

from __future__ import annotations

import argparse
import sys
import time
from typing import get_args

from pipeline.config import CacheDType, Device, DType, HeadKind, Int8Kernel, parse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train-pooler",
        help="train a pooling head on (query, text) pairs over the frozen encoder",
        description="Train a pooling head with in-batch negatives; the best epoch by held-out "
        "MRR@10 is saved as HEAD_OUT/head.json + head.safetensors for the 'learned' pooler.",
    )
    p.add_argument("pairs", metavar="PAIRS", help="Parquet file, folder or glob (local or s3://)")
    p.add_argument("out", metavar="HEAD_OUT", help="folder for the head (local or s3://)")
    p.add_argument("--kind", required=True, choices=get_args(HeadKind))
    p.add_argument("--adapter", action="store_true", help="add a linear adapter after pooling")
    p.add_argument("--out-dim", type=int, help="output size of the adapter")
    p.add_argument("--layers", help="comma-separated layers, e.g. --layers=-1,-2 (with the =: "
                   "a value starting with - is read as an option otherwise; default: by kind)")
    p.add_argument("--model", help="model folder or cached HF name (default: the "
                   "installation's EMBEDPIPE_MODEL, else the packaged MiniLM)")
    p.add_argument("--device", choices=get_args(Device),
                   help="default: the installation's EMBEDPIPE_DEVICE, else auto")
    p.add_argument("--dtype", choices=get_args(DType),
                   help="default: the installation's EMBEDPIPE_DTYPE, else auto")
    p.add_argument("--int8-kernel", choices=get_args(Int8Kernel),
                   help="with --dtype int8: the kernel whose states the head learns from "
                   "(a head serves sets made by that kernel; default: auto)")
    p.add_argument("--max-length", type=int)
    p.add_argument("--query-column", default="query")
    p.add_argument("--text-column", default="text")
    p.add_argument("--group-column", help="keep each group on one side of the held-out split "
                   "(default: the query, so all pairs of a query land on one side)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--patience", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--temperature", type=float, default=0.05)
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--max-pairs", type=int, help="train on at most this many pairs")
    p.add_argument("--memory-budget", default="2GB", help="for cached hidden states, e.g. 2GB")
    p.add_argument("--cache-dtype", default="auto", choices=get_args(CacheDType))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true", help="replace a head already in "
                   "HEAD_OUT (the sets made with it no longer match it)")
    p.set_defaults(func=run)


def to_config(args: argparse.Namespace):
    """The TrainConfig of the flags (validation errors name the flag's field)."""
    from pipeline.settings import load_settings
    from pipeline.training import TrainConfig

    given = {"model": args.model, "device": args.device, "dtype": args.dtype,
             "max_length": args.max_length}
    if args.int8_kernel is not None:
        given["int8_kernel"] = args.int8_kernel
    # what the flags leave out: the installation's settings, as for `embed`
    encoder = load_settings().apply_to_job({"encoder": given})["encoder"]
    raw = {
        "pairs": args.pairs, "out": args.out, "kind": args.kind, "adapter": args.adapter,
        "out_dim": args.out_dim, "layers": _layers(args.layers), "encoder": encoder,
        "query_column": args.query_column, "text_column": args.text_column,
        "group_column": args.group_column, "epochs": args.epochs, "patience": args.patience,
        "batch_size": args.batch_size, "lr": args.lr, "temperature": args.temperature,
        "val_fraction": args.val_fraction, "max_pairs": args.max_pairs,
        "memory_budget": args.memory_budget, "cache_dtype": args.cache_dtype, "seed": args.seed,
        "overwrite": args.overwrite,
    }
    return parse(TrainConfig, raw, "train-pooler options")


def _layers(text: str | None) -> list[int] | None:
    from pipeline.errors import ConfigError

    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(f"--layers must be comma-separated integers, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    from pipeline.training import train

    cfg = to_config(args)
    started = time.perf_counter()
    result = train(cfg, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    m, k = result.metrics, cfg.k
    print(
        f"trained {cfg.kind}{' + adapter' if cfg.adapter else ''} head on "
        f"{int(m['train_pairs'])} pairs: held-out MRR@{k} {m[f'val_mrr@{k}']:.4f} "
        f"(untrained {m[f'val_mrr@{k}_untrained']:.4f}), recall@{k} {m[f'val_recall@{k}']:.4f}, "
        f"best epoch {int(m['best_epoch'])} of {int(m['epochs_run'])}; saved {cfg.out} "
        f"in {time.perf_counter() - started:.0f}s"
    )
    return 0
