"""``embedpipe demo``: the whole job on a real corpus that needs no download.

The corpus is the docstrings of this Python's standard library (parsed, never imported).
It is written as Parquet, embedded into two pooler sets by the embed flow, indexed by the
index flow, and queried; everything lands in one folder that the user can keep exploring
with the other commands.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

QUERIES = (
    "read a CSV file row by row",
    "parse command line arguments",
    "compute a cryptographic hash of bytes",
    "run a function in a pool of worker processes",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo", help="embed, index and query the stdlib's docstrings")
    p.add_argument("--out", help="folder for the corpus, sets and indexes (default: a new temp)")
    p.add_argument("--rows", type=int, default=2000, help="docstrings to embed (default 2000)")
    p.add_argument("--pooler", action="append", metavar="NAME",
                   help="pooler sets to make (default: mean and cls)")
    p.add_argument("-k", type=int, default=3, help="results shown per query")
    p.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    from pipeline import storage
    from pipeline.demo_corpus import stdlib_docstrings
    from pipeline.lease import check_free

    _check_flags(args)
    root = args.out or tempfile.mkdtemp(prefix="embedpipe-demo-")
    corpus, out = storage.join(root, "corpus", "stdlib.parquet"), storage.join(root, "out")
    names = args.pooler or ["mean", "cls"]
    try:
        _check_sets(corpus, out, names)
    except Exception:
        if not args.out:  # the empty folder made for this run goes with it
            os.rmdir(root)
        raise
    check_free(out)  # a demo running in this folder reads the corpus: not replaced under it
    started = time.perf_counter()
    table = stdlib_docstrings(limit=args.rows)
    storage.write_parquet(corpus, table, row_group_size=250)
    print(f"corpus: {table.num_rows} docstrings of the Python standard library -> {corpus}")
    _embed_and_index(corpus, out, names)
    titles = dict(zip(table.column("id").to_pylist(), table.column("name").to_pylist(),
                      strict=True))
    _show_queries(out, names, args.k, titles)
    print(f"demo finished in {time.perf_counter() - started:.0f} s; explore it with "
          f"`embedpipe query {out} \"your question\" --set {names[0]}`")
    return 0


def _check_flags(args: argparse.Namespace) -> None:
    """--rows, -k and --out, before the corpus is built (seconds) and embedded."""
    from pipeline import storage
    from pipeline.errors import ConfigError
    from pipeline.ranking import check_k

    if args.rows < 1:
        raise ConfigError(f"--rows must be at least 1, got {args.rows}")
    check_k(args.k)
    if args.out:
        storage.check_folder(args.out, "the demo's folders (--out)")


def _check_sets(corpus: str, out: str, names: list[str]) -> None:
    """The sets' names (valid, none twice) and what their model load would refuse (an
    unknown pooler), before the corpus is built: the job ``embed`` will run, less the
    corpus, which does not exist yet."""
    from pipeline.assembly import build_job, check_runs

    check_runs(build_job(corpus, out, poolers=names))


def _embed_and_index(corpus: str, out: str, names: list[str]) -> None:
    import embedpipe
    from pipeline.index import IndexResult

    summary = embedpipe.embed(corpus, out, poolers=names, rows_per_shard=500, index=True,
                              progress=True)
    print(summary["line"])
    for result in summary["index"]:
        print(IndexResult.model_validate(result).summary())


def _show_queries(out: str, names: list[str], k: int, titles: dict[int, str]) -> None:
    from pipeline.search import Searcher

    searchers = [Searcher(out, name) for name in names]
    for query in QUERIES:
        print(f"\nquery: {query}")
        for searcher in searchers:
            for hit in searcher.search([query], k)[0]:
                first_line = (hit.snippet or "").strip().splitlines()[:1]
                line = f"{titles.get(hit.id, hit.id)}: {''.join(first_line)}"
                print(f"  [{searcher.name}] {hit.rank}. {hit.score:.3f}  {line[:90]}")
