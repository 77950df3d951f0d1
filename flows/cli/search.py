"""``embedpipe index | query | serve | eval``: thin commands over the index flow and library."""

from __future__ import annotations

import argparse
import json
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("index", help="build or update the FAISS index of sets",
                              description="Build, or catch up incrementally, the index of a "
                              "set (every set when --set is not given).")
    p.add_argument("out", metavar="OUT")
    p.add_argument("--set", dest="set_name", metavar="NAME")
    p.add_argument("--kind", default="auto",
                   help="auto|flat|hnsw|ivf|ivfsq|ivfpq or a FAISS factory string")
    p.add_argument("--memory-budget", default="4GB", help="e.g. 4GB, 512MB")
    p.add_argument("--rebuild", action="store_true", help="full rebuild instead of catch-up")
    p.set_defaults(func=run_index)

    p = subparsers.add_parser("query", help="search a set's index with text")
    p.add_argument("out", metavar="OUT")
    p.add_argument("text", metavar="TEXT", nargs="+")
    p.add_argument("-k", type=int, default=10)
    p.add_argument("--set", dest="set_name", metavar="NAME")
    p.add_argument("--corpus", help="corpus for snippets (default: as recorded in _SET.json)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"])
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run_query)

    p = subparsers.add_parser("serve", help="HTTP search API (FastAPI)")
    p.add_argument("out", metavar="OUT")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--set", dest="sets", action="append", metavar="NAME", default=[])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"])
    p.add_argument("--workers", type=int, default=2, help="searches run at once")
    p.add_argument("--queue", type=int, default=16, help="requests that may wait")
    p.add_argument("--max-k", type=int, default=100)
    p.add_argument("--default-set", metavar="NAME",
                   help="set for requests that name none (default: the only set, else "
                   "'model', else 'mean')")
    p.add_argument("--api-key-file", metavar="FILE",
                   help="require 'Authorization: Bearer <key>' with the key in FILE (or set "
                   "EMBEDPIPE_API_KEY / EMBEDPIPE_API_KEY_FILE); /health stays open")
    p.add_argument("--reload-interval", type=float, metavar="SECONDS",
                   help="how often to look for a new index generation (default 2; 0: never)")
    p.add_argument("--max-connections", type=int,
                   help="open connections before new ones get 503 (default 64)")
    p.add_argument("--keep-alive", type=float, metavar="SECONDS",
                   help="idle keep-alive connections close after this (default 5)")
    p.add_argument("--body-timeout", type=float, metavar="SECONDS",
                   help="a request body not received within this gets 408 (default 10)")
    p.set_defaults(func=run_serve)

    p = subparsers.add_parser("eval", help="recall@1/10, MRR@10, nDCG@10 per set")
    p.add_argument("out", metavar="OUT")
    p.add_argument("queries", metavar="QUERIES.parquet", help="columns: query, doc_id")
    p.add_argument("--set", dest="sets", action="append", metavar="NAME", default=[])
    p.add_argument("-k", type=int, default=10)
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", metavar="PNG", help="bar chart comparing the sets")
    p.set_defaults(func=run_eval)


def run_index(args: argparse.Namespace) -> int:
    from flows.index import index_flow

    results = index_flow(args.out, args.set_name, args.kind, args.memory_budget, args.rebuild)
    from pipeline.index import IndexResult

    for result in results:
        print(IndexResult.model_validate(result).summary())
    return 0


def run_query(args: argparse.Namespace) -> int:
    from pipeline.errors import ConfigError
    from pipeline.search import Searcher

    if not 1 <= args.k <= 1000:
        raise ConfigError(f"-k must be between 1 and 1000, got {args.k}")
    text = " ".join(args.text)
    if not text.strip():
        raise ConfigError("the query text is empty")
    searcher = Searcher(args.out, args.set_name, device=args.device, corpus=args.corpus)
    hits = searcher.search([text], args.k)[0]
    if args.json:
        print(json.dumps({"set": searcher.name, "query": text,
                          "results": [h.model_dump() for h in hits]}, ensure_ascii=False))
        return 0
    for h in hits:
        snippet = f"  {h.snippet}" if h.snippet else ""
        print(f"{h.rank:>3}  {h.score:8.4f}  {h.id}{snippet}")
    if searcher.stale:
        print(f"note: set {searcher.name!r} changed since it was indexed; run "
              f"`embedpipe index {args.out} --set {searcher.name}`", file=sys.stderr)
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from pipeline.config import parse
    from pipeline.server import ServerConfig, api_key, serve

    options = {"out": args.out, "sets": tuple(args.sets), "device": args.device,
               "workers": args.workers, "queue": args.queue, "max_k": args.max_k,
               "default_set": args.default_set, "api_key": api_key(args.api_key_file),
               "reload_interval_s": args.reload_interval,
               "max_connections": args.max_connections, "keep_alive_s": args.keep_alive,
               "body_timeout_s": args.body_timeout}
    given = {k: v for k, v in options.items() if v is not None}  # the rest: ServerConfig's
    config = parse(ServerConfig, given, "server options")
    serve(config, args.host, args.port)
    return 0


def run_eval(args: argparse.Namespace) -> int:
    from pipeline import evaluate
    from pipeline.index import list_sets, read_meta
    from pipeline.search import Searcher

    relevant = evaluate.load_queries(args.queries)
    names = args.sets or [s for s in list_sets(args.out) if read_meta(args.out, s)]
    if not names:
        from pipeline.errors import StorageError

        raise StorageError(f"no indexed sets under {args.out}; run `embedpipe index` first")
    results = [evaluate.evaluate_set(Searcher(args.out, n), relevant, args.k) for n in names]
    if args.plot:
        evaluate.plot(results, args.plot)
    if args.json:
        print(json.dumps([r.model_dump() for r in results]))
    else:
        print(evaluate.table(results))
    return 0
