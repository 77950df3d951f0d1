"""``embedpipe index | query | serve | eval``: thin commands over the index flow and library."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import get_args

from pipeline.config import Device
from pipeline.errors import ConfigError, StorageError
from pipeline.index.plan import NAMED_KINDS


def register(subparsers: argparse._SubParsersAction) -> None:
    for add in (_index_parser, _query_parser, _serve_parser, _eval_parser):
        add(subparsers)


def _index_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("index", help="build or update the FAISS index of sets",
                              description="Build, or catch up incrementally, the index of a "
                              "set (every set when --set is not given).")
    p.add_argument("out", metavar="OUT")
    p.add_argument("--set", dest="set_name", metavar="NAME")
    p.add_argument("--kind", default="auto",
                   help="|".join(("auto", *NAMED_KINDS)) + " or a FAISS factory string")
    p.add_argument("--memory-budget", default="4GB", help="e.g. 4GB, 512MB")
    p.add_argument("--rebuild", action="store_true", help="full rebuild instead of catch-up")
    p.add_argument("--lease-wait", type=float, default=0.0, metavar="SECONDS",
                   help="wait for another writer of OUT to finish (default: fail at once)")
    p.set_defaults(func=run_index)


def _query_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("query", help="search a set's index with text")
    p.add_argument("words", metavar="[OUT] TEXT", nargs="+",
                   help="the output folder (not with --url), then the query: its words are "
                   "joined into one query, options may come between them; words after -- "
                   "are all query words (a query that starts with '-': OUT -- -fno-pic flag)")
    p.add_argument("-k", type=int, help="hits to show (default 10; with --url, the server's: "
                   "10 or its --max-k)")
    p.add_argument("--set", dest="set_name", metavar="NAME")
    p.add_argument("--url", help="ask a running `embedpipe serve` (http://host:port) instead; "
                   "EMBEDPIPE_API_KEY is sent as a Bearer token when set")
    p.add_argument("--corpus", help="corpus for snippets (default: as recorded in _SET.json); "
                   "used only if it holds the set's ids; not with --url")
    p.add_argument("--device", choices=get_args(Device),
                   help="where the set's model runs (not with --url: the server's)")
    p.add_argument("--json", action="store_true", help="print JSON")
    _trust_flag(p)
    p.set_defaults(func=run_query, trailing="words")


def _serve_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="HTTP search API (FastAPI)")
    p.add_argument("out", metavar="OUT")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--set", dest="sets", action="append", metavar="NAME", default=[])
    p.add_argument("--device", choices=get_args(Device))
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
                   help="a request body not received within this gets 408, a connection "
                   "whose request headers are not is closed (default 10)")
    _trust_flag(p)
    p.set_defaults(func=run_serve)


def _eval_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("eval", help="recall@1, recall@k, MRR@k, nDCG@k per set")
    p.add_argument("out", metavar="OUT")
    p.add_argument("queries", metavar="QUERIES.parquet", help="columns: query, doc_id")
    p.add_argument("--set", dest="sets", action="append", metavar="NAME", default=[])
    p.add_argument("-k", type=int, default=10, help="cut-off of every metric (default 10)")
    p.add_argument("--exact", action=argparse.BooleanOptionalAction, default=None,
                   help="exact search over the set's vectors (--no-exact: its index); default: "
                   "exact when the set fits in memory")
    p.add_argument("--out", dest="ranks_out", metavar="FILE.parquet",
                   help="write per-query ranks (set, search, k, query, doc_id, rank)")
    p.add_argument("--device", choices=get_args(Device))
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", metavar="PNG", help="bar chart comparing the sets")
    _trust_flag(p)
    p.set_defaults(func=run_eval)


def _trust_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let a set's model run code from its folder (auto_map); never taken "
                   "from _SET.json")


def run_index(args: argparse.Namespace) -> int:
    import embedpipe

    results = embedpipe.index(args.out, args.set_name, kind=args.kind,
                              memory_budget=args.memory_budget, rebuild=args.rebuild,
                              lease_wait=args.lease_wait,
                              progress=True)
    for result in results:
        print(result.summary())
    return 0


def run_query(args: argparse.Namespace) -> int:
    from pipeline.ranking import DEFAULT_K, check_k

    if args.k is not None:
        check_k(args.k)
    if args.url is not None:
        return _query_server(args)
    args.k = DEFAULT_K if args.k is None else args.k
    from pipeline.search import Searcher, check_queries

    out, text = args.words[0], _query_text(args.words[1:])
    check_queries([text])  # before the model loads (the server checks its own)
    searcher = Searcher(out, args.set_name, device=args.device, corpus=args.corpus,
                        trust_remote_code=args.trust_remote_code)
    _print_hits(searcher.name, text, searcher.search([text], args.k)[0], args.json)
    for note in searcher.notes():
        print(f"note: {note}", file=sys.stderr)
    return 0


_LOCAL_ONLY = {"corpus": "--corpus", "device": "--device",
               "trust_remote_code": "--trust-remote-code"}  # dest: option; unset: None or False


def _query_server(args: argparse.Namespace) -> int:
    """``query --url``: the server loads the set, so the options that choose how a local OUT
    is loaded are refused rather than ignored, and so is an OUT before the words."""
    from pipeline.client import search_remote

    for dest, option in _LOCAL_ONLY.items():
        if getattr(args, dest) not in (None, False):
            where = ("the server reads snippets from the corpus each set's _SET.json records"
                     if dest == "corpus" else "give it to `embedpipe serve`")
            raise ConfigError(f"{option} is not taken with --url: the server decides it "
                              f"({where})")
    if _holds_sets(args.words[0]):
        raise ConfigError(f"{args.words[0]!r} is an output folder with sets: give OUT or "
                          "--url, not both")
    text = _query_text(args.words)
    name, results = search_remote(args.url, [text], args.k, args.set_name)
    _print_hits(name, text, results[0], args.json)
    return 0


def _holds_sets(word: str) -> bool:
    """``word`` names a local folder holding embedpipe sets (a query word that happens to name
    some other folder, or nothing, stays a query word)."""
    from pipeline.sets import list_sets

    if not os.path.isdir(word):
        return False
    try:
        return bool(list_sets(word))
    except StorageError:  # a sets/ folder embedpipe did not write: not an OUT
        return False


def _query_text(words: list[str]) -> str:
    """The query's words as one text; none (or only blanks) is one line saying what to give."""
    text = " ".join(words)
    if not text.strip():
        raise ConfigError("the query text is empty (give OUT, or --url of a running "
                          "`embedpipe serve`, then the query)")
    return text


def _print_hits(name: str, text: str, hits: list, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"set": name, "query": text, "results": [h.model_dump() for h in hits]},
                         ensure_ascii=False))
        return
    for h in hits:
        snippet = f"  {h.snippet}" if h.snippet else ""
        print(f"{h.rank:>3}  {h.score:8.4f}  {h.id}{snippet}")


def run_serve(args: argparse.Namespace) -> int:
    from pipeline.config import parse
    from pipeline.server import ServerConfig, api_key, serve

    options = {"out": args.out, "sets": tuple(args.sets), "device": args.device,
               "workers": args.workers, "queue": args.queue, "max_k": args.max_k,
               "default_set": args.default_set, "api_key": api_key(args.api_key_file),
               "reload_interval_s": args.reload_interval,
               "max_connections": args.max_connections, "keep_alive_s": args.keep_alive,
               "body_timeout_s": args.body_timeout, "trust_remote_code": args.trust_remote_code}
    given = {k: v for k, v in options.items() if v is not None}  # the rest: ServerConfig's
    config = parse(ServerConfig, given, "server options")
    serve(config, args.host, args.port)
    return 0


def run_eval(args: argparse.Namespace) -> int:
    import embedpipe
    from pipeline import evaluate

    for path, option in ((args.ranks_out, "--out"), (args.plot, "--plot")):
        evaluate.check_report_path(args.out, path, option)  # named as the user gave them
    results = embedpipe.evaluate(args.out, args.queries, sets=args.sets, k=args.k,
                                 exact=args.exact, ranks_out=args.ranks_out, device=args.device,
                                 trust_remote_code=args.trust_remote_code)
    if args.plot:
        evaluate.plot(results, args.plot)
    if args.json:
        print(json.dumps([r.model_dump() for r in results]))
    else:
        print(evaluate.table(results))
    return 0
