"""embedpipe's Python API: the entry points the ``embedpipe`` command line itself uses.

    import embedpipe

    embedpipe.embed("corpus/", "out/", poolers=["mean", "cls"], index=True)
    embedpipe.backfill("corpus/", "out/", poolers=["max"])      # same encoder as out/'s sets
    embedpipe.index("out/")                                     # catch up every set's index
    hits = embedpipe.search("out/", ["how do I parse dates?"], k=5, set_name="mean")
    scores = embedpipe.evaluate("out/", "queries.parquet", k=5)  # exact search by default
    frame = embedpipe.read_set("out/", "mean").collect()        # polars: id, embedding

Job options are the CLI's flags as keyword arguments (``model``, ``device``, ``dtype``,
``int8_kernel``, ``compile``, ``max_length``, ``window``, ``stride``, ``window_agg``,
``id_column``, ``text_column``, ``runner``, ``dask_address``, ``workers``, ``rows_per_shard``,
``quarantine``, ``dedupe``) plus ``config`` (a TOML file); see ``pipeline.assembly``. Every
failure in the input raises an ``EmbedpipeError`` (``embedpipe.EmbedpipeError``) whose message
is the one-line reason; what the CLI prints as a ``note:`` line is an ``EmbedpipeWarning``.

Importing this module is cheap: torch, FAISS and Prefect load inside the functions.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Mapping, Sequence, Set
from contextlib import AbstractContextManager
from functools import cache, partial
from typing import TYPE_CHECKING, Any

from pipeline.errors import ConfigError, EmbedpipeError, EmbedpipeWarning

if TYPE_CHECKING:
    import polars as pl
    from pydantic import BaseModel

    from pipeline.config import EmbedJob
    from pipeline.evaluate import SetScores
    from pipeline.index import IndexResult
    from pipeline.search import Hit

__all__ = ["EmbedpipeError", "EmbedpipeWarning", "backfill", "embed", "evaluate", "index",
           "read_set", "search"]


def embed(corpus: str, out: str, *, poolers: Sequence[str] | None = None,
          config: str | None = None, index: bool = False, incremental: bool = False,
          progress: bool = False, **options: Any) -> dict:
    """Embed ``corpus`` into pooler sets under ``out``; resumes where an earlier run stopped.

    ``poolers`` (or the ``config`` file's ``[[poolers]]``) names the sets; naming none, the run
    works on every set already in ``out`` (``pipeline.assembly.keep_sets_current``), or makes
    the model's default set in an ``out`` without sets. ``incremental`` re-reads every shard
    and embeds only new or changed rows (the nightly run); ``index`` then catches up each
    set's index in the same flow run. Returns the run summary (``line`` is the one-line
    summary; with ``index``, ``index`` holds each set's IndexResult as JSON).
    """
    _installation()
    from pipeline.assembly import job_params

    _check_arguments("embed", index=index, incremental=incremental, progress=progress)
    job = _checked_job(corpus, out, config, _names(poolers, "poolers"), options)
    if index:
        from flows.live import embed_and_index_flow

        run = partial(embed_and_index_flow, verify=incremental)
    else:
        from flows.embed import embed_flow, nightly_flow

        run = nightly_flow if incremental else embed_flow
    params = job_params(job)
    _load_model_while_the_api_starts(params)
    with _orchestration():
        return run(params, progress=progress)


def backfill(corpus: str, out: str, *, poolers: Sequence[str], config: str | None = None,
             progress: bool = False, **options: Any) -> dict:
    """Add pooler sets to an ``out`` that has sets; without ``model``, their encoder is used."""
    _installation()
    from pipeline.assembly import inherit_encoder, job_params

    _check_arguments("backfill", progress=progress)
    poolers = _names(poolers, "poolers")
    if not poolers:
        raise ConfigError("backfill needs at least one pooler to add")
    job = _checked_job(corpus, out, config, poolers, options)
    params = inherit_encoder(job_params(job))  # an OUT without sets: refused before Prefect
    from flows.embed import backfill_flow

    with _orchestration():
        summary = backfill_flow(params, progress=progress)
    return summary | {"line": summary["line"].replace("embedded", "backfilled", 1)}


def index(out: str, set_name: str | None = None, *, kind: str = "auto",
          memory_budget: str = "4GB", rebuild: bool = False, lease_wait: float = 0.0,
          progress: bool = False) -> list[IndexResult]:
    """Catch up (or build) the index of one set, or of every set under ``out``, holding OUT's
    writer lease (``lease_wait``: seconds to wait for another writer)."""
    _installation()
    from pipeline.index import IndexResult, index_targets

    out = _path(out, "out")
    _check_arguments("index", rebuild=rebuild, progress=progress)
    index_targets(out, set_name, kind, memory_budget, lease_wait)  # before any orchestration
    from flows.index import index_flow

    with _orchestration():
        results = index_flow(out, set_name, kind=kind, memory_budget=str(memory_budget),
                             rebuild=rebuild, lease_wait=float(lease_wait), progress=progress)
    return [IndexResult.model_validate(r) for r in results]


def search(out: str, queries: str | Sequence[str], k: int = 10, *, set_name: str | None = None,
           device: str | None = None, snippets: bool = True,
           trust_remote_code: bool = False) -> list[list[Hit]]:
    """The ``k`` best hits per query from a set's published index (no Prefect involved).
    What the CLI prints as notes (an index older than its set, hits without snippets) is
    warned as an ``EmbedpipeWarning``."""
    _installation()
    from pipeline.ranking import check_k
    from pipeline.search import Searcher, check_queries

    texts = check_queries(_names(queries, "queries", "texts", optional=False))
    k = check_k(k)
    _check_arguments("search", device=device, snippets=snippets,
                     trust_remote_code=trust_remote_code)
    searcher = Searcher(_path(out, "out"), set_name, device=device,
                        trust_remote_code=trust_remote_code, snippets=snippets)
    hits = searcher.search(texts, k, snippets=snippets)
    for note in searcher.notes():  # the CLI's note: lines
        warnings.warn(note, EmbedpipeWarning, stacklevel=2)
    return hits


def evaluate(out: str, queries: str, *, sets: Sequence[str] | None = None, k: int = 10,
             exact: bool | None = None, ranks_out: str | None = None,
             device: str | None = None, trust_remote_code: bool = False) -> list[SetScores]:
    """Recall@1, recall@k, MRR@k and nDCG@k of sets on a (query, doc_id) Parquet file.

    ``exact=None`` searches exactly over the set's vectors when they fit in memory (or the set
    has no index), else its index; each result says which in ``search``. ``ranks_out`` writes
    the per-query ranks (set, search, k, query, doc_id, rank) as Parquet.
    """
    _installation()
    from pipeline.evaluate import evaluate_sets

    _check_arguments("evaluate", exact=exact, device=device, trust_remote_code=trust_remote_code)
    return evaluate_sets(_path(out, "out"), _path(queries, "queries"), sets=_names(sets, "sets"),
                         k=k, exact=exact,
                         ranks_out=_path(ranks_out, "ranks_out", optional=True),
                         device=device, trust_remote_code=trust_remote_code)


def read_set(out: str, name: str) -> pl.LazyFrame:
    """A set's vectors as a polars LazyFrame (``id``, ``embedding``), local or ``s3://``."""
    _installation()
    from pipeline.sets import scan_set

    return scan_set(_path(out, "out"), name)


def _checked_job(corpus: object, out: object, config: object, poolers: list[str] | None,
                 options: dict) -> EmbedJob:
    """The job of an ``embed`` or ``backfill`` call, its input checked (no model, no Prefect)."""
    from pipeline.assembly import build_job, check_input

    job = build_job(_path(corpus, "corpus"), _path(out, "out"),
                    config=_path(config, "config", optional=True), poolers=poolers, **options)
    check_input(job)
    return job


def _path(value: object, name: str, optional: bool = False) -> Any:
    """A path argument as the library takes it: a str (a local path or a URL) from a str or a
    ``pathlib.Path``; None as None where ``optional``."""
    if value is None and optional:
        return None
    if isinstance(value, str | os.PathLike):
        return os.fspath(value)
    raise ConfigError(f"{name} must be a path or URL (str or pathlib.Path), not "
                      f"{type(value).__name__}")


def _names(value: object, name: str, what: str = "names", optional: bool = True
           ) -> list | None:
    """A str as one name (not its characters), any other iterable (a list, a polars Series)
    as a list, None as None where ``optional``."""
    if value is None and optional:
        return None
    if isinstance(value, str):
        return [value]
    if isinstance(value, Set):  # no order: results would come back in any
        raise ConfigError(f"{name} must be a str or a list of {what}, not a "
                          f"{type(value).__name__} (unordered)")
    if isinstance(value, Iterable) and not isinstance(value, bytes | Mapping):
        return list(value)
    raise ConfigError(f"{name} must be a str or a list of {what}, not {type(value).__name__}")


def _check_arguments(call: str, **given: object) -> None:
    """``call``'s keyword arguments checked strictly by their type (a bool is a bool, not a
    truthy string; ``device`` one of ``pipeline.config.Device``): one ConfigError line naming
    each that is not, before anything is read or loaded."""
    from pipeline.config import parse

    parse(_argument_types(), given, f"embedpipe.{call}() arguments")


@cache
def _argument_types() -> type[BaseModel]:
    """The API's keyword arguments that no ``pipeline.config`` model checks, typed by
    ``pipeline.config``'s own types (made on first use: importing embedpipe stays cheap)."""
    from pydantic import BaseModel, ConfigDict

    from pipeline.config import Device

    class Arguments(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)

        device: Device | None = None
        exact: bool | None = None
        snippets: bool = True
        trust_remote_code: bool = False
        index: bool = False
        incremental: bool = False
        rebuild: bool = False
        progress: bool = False

    return Arguments


def _installation() -> None:
    """This installation's settings (``EMBEDPIPE_*``, ``EMBEDPIPE_CONFIG``) exported as the
    command line exports them: the lease's TTL, the S3 endpoint and the cache dir that other
    modules read from the environment; and OpenMP's brief spinning, as the CLI sets it
    (``pipeline.torch_thread.spin_briefly``: before torch loads, if it has not)."""
    from pipeline.settings import load_settings, withdraw_exports
    from pipeline.torch_thread import spin_briefly

    spin_briefly()
    withdraw_exports()  # an earlier call's settings file, not this one's
    load_settings().export_env()
    # the Prefect API this process starts cannot reach the internet to send its telemetry
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def _load_model_while_the_api_starts(params: dict) -> None:
    """When the flow's start will wait for an API server to boot (the local one not running,
    or Prefect's temporary one) and the run will load the model anyway (a set to create or
    claim), load it meanwhile: the flow finds it loaded. A cold server start with 3,300
    texts to embed: 14.3-15.8 s instead of 16.6-17.4 s; with the server up this is skipped
    (it only competed with the flow's start: +0.4 s)."""
    from flows.runtime import api_is_up
    from pipeline.assembly import resolve_job
    from pipeline.run import needs_model

    if api_is_up():
        return
    spec = resolve_job(params)  # the job exactly as the flow will see it
    if needs_model(spec):
        from pipeline.embedder import preload

        preload(spec.encoder, spec.poolers)


def _orchestration() -> AbstractContextManager[str | None]:
    """Around a flow run (input already checked): the CLI's reused local Prefect API."""
    from flows.runtime import local_api

    return local_api()
