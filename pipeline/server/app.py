"""The query server: FastAPI over live Searchers, with bounded work and bounded input.

- Models and indexes load once, when the app is made (a bad OUT fails before serving); a
  new index generation is then swapped in while serving (``pipeline.live``).
- ``POST /search`` takes ``query`` or ``queries``, ``k`` and ``set``.
- ``POST /v1/embeddings`` (OpenAI) and ``POST /embed`` (TEI; also ``POST /``, where
  ``huggingface_hub.InferenceClient(model=URL)`` sends it) return a set's own vectors.
- ``GET /health`` (never needs a key), ``GET /metrics`` (Prometheus).
- Every bound is checked by pydantic or the handler: bad requests get 4xx with a reason,
  never a 500 (see ``guards`` and ``gate`` for keys, body limits and admission control).
"""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import logging
import time
from collections.abc import Callable

import numpy as np
from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from pipeline.errors import EmbedpipeError, TokenLimitError
from pipeline.live import LiveSets
from pipeline.ranking import DEFAULT_K
from pipeline.search import Searcher
from pipeline.server.config import ServerConfig, choose_default
from pipeline.server.gate import Busy, Gate
from pipeline.server.guards import ApiKeyGuard, BodyLimit, problem, validation_problem
from pipeline.server.metrics import CONTENT_TYPE, RequestMetrics, ServerMetrics
from pipeline.server.models import (
    EmbeddingsRequest,
    EmbeddingsResponse,
    SearchRequest,
    SearchResponse,
    TeiEmbedRequest,
)
from pipeline.vectors import unit_rows

log = logging.getLogger("embedpipe.server")


def create_app(config: ServerConfig) -> FastAPI:
    """The app, with every set's model and index loaded (fails here, not on the first query)."""
    import faiss

    faiss.omp_set_num_threads(config.faiss_threads)  # parallelism comes from requests
    metrics = ServerMetrics()
    live, default = _live_sets(config, metrics)
    gate = Gate(config.workers, config.queue, config.queue_timeout_s)
    metrics.queue_depth.set_function(lambda: gate.pending)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        live.start()
        try:
            yield
        finally:
            live.stop()

    app = FastAPI(title="embedpipe search", version="1", description=__doc__.splitlines()[0],
                  lifespan=lifespan)
    _handlers(app)
    _routes(app, config, live, gate, default, metrics)
    app.add_middleware(BodyLimit, limit=config.max_body_bytes, timeout_s=config.body_timeout_s)
    if config.api_key is not None:
        app.add_middleware(ApiKeyGuard, key=config.api_key.get_secret_value())
    paths = frozenset(getattr(r, "path", "") for r in app.routes)
    app.add_middleware(RequestMetrics, metrics=metrics, routes=paths)  # outermost
    app.state.live, app.state.gate, app.state.metrics = live, gate, metrics
    return app


def _live_sets(config: ServerConfig, metrics: ServerMetrics) -> tuple[LiveSets, str]:
    """The served sets (those named, else every indexed one, new ones found as they appear),
    loaded now and kept current; and the default set's name."""
    from pipeline.index import list_sets, read_meta

    def published(name: str) -> bool:
        try:
            return read_meta(config.out, name) is not None
        except EmbedpipeError:  # its load fails with the reason: logged, retried, others served
            return True

    def indexed() -> list[str]:
        return [s for s in list_sets(config.out) if published(s)]

    def load(name: str) -> Searcher:
        return Searcher(config.out, name, device=config.device,
                        trust_remote_code=config.trust_remote_code)

    names = list(config.sets) or indexed()
    if not names:
        raise EmbedpipeError(f"no indexed sets under {config.out}; run `embedpipe index "
                             f"{config.out}` first")
    default = choose_default(names, config.default_set)
    searchers = {n: load(n) for n in names}
    for searcher in searchers.values():  # served, without snippets for that set
        if searcher.snippet_note:
            log.warning("%s", searcher.snippet_note)
    live = LiveSets(searchers,
                    config.reload_interval_s, on_swap=_swapped(metrics, names),
                    on_failure=lambda n: metrics.reload_failures.labels(n).inc(),
                    discover=None if config.sets else indexed, load=load)  # named: those only
    for name in names:
        _first_served(metrics, live.get(name))
    return live, default


def serve(config: ServerConfig, host: str, port: int) -> None:
    """Run the app under uvicorn with the connection, keep-alive and header-time limits of
    ``config``, on a socket bound before the sets load (``listener.bound_socket``)."""
    import uvicorn
    from uvicorn.config import LOGGING_CONFIG

    from pipeline.server.listener import bound_socket, header_timeout_protocol

    sock = bound_socket(host, port)
    logs = copy.deepcopy(LOGGING_CONFIG)  # uvicorn's, plus embedpipe's own lines (reloads)
    logs["loggers"]["embedpipe"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    with sock:
        app = create_app(config)
        server = uvicorn.Server(uvicorn.Config(
            app, host=host, port=sock.getsockname()[1], log_level="info", log_config=logs,
            limit_concurrency=config.max_connections, timeout_keep_alive=config.keep_alive_s,
            http=header_timeout_protocol(config.body_timeout_s)))
        server.run(sockets=[sock])


def _swapped(metrics: ServerMetrics, names: list[str]) -> Callable[[Searcher], None]:
    """``LiveSets``' ``on_swap``: a new generation of a served set counts as a reload; a set
    indexed after the start, served for the first time, does not."""
    served = set(names)

    def on_swap(searcher: Searcher) -> None:
        if searcher.name in served:
            metrics.reloads.labels(searcher.name).inc()
            _served(metrics, searcher)
        else:
            served.add(searcher.name)
            _first_served(metrics, searcher)

    return on_swap


def _first_served(metrics: ServerMetrics, searcher: Searcher) -> None:
    """What a set's first generation shows: its gauges, and its reload counters at 0."""
    _served(metrics, searcher)
    metrics.reloads.labels(searcher.name)
    metrics.reload_failures.labels(searcher.name)


def _served(metrics: ServerMetrics, searcher: Searcher) -> None:
    metrics.generation.labels(searcher.name).set(searcher.meta.generation)
    metrics.rows.labels(searcher.name).set(searcher.meta.rows)


def _handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, validation_problem)

    @app.exception_handler(Busy)
    async def busy(_: Request, exc: Busy) -> JSONResponse:
        return problem(exc.status, exc.reason, **{"Retry-After": "1"})

    @app.exception_handler(EmbedpipeError)
    async def embedpipe_error(_: Request, exc: EmbedpipeError) -> JSONResponse:
        return problem(413 if isinstance(exc, TokenLimitError) else 400, str(exc))

    @app.exception_handler(json.JSONDecodeError)
    async def bad_json(_: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return problem(400, f"request body is not JSON: {exc}")


def _routes(app: FastAPI, config: ServerConfig, live: LiveSets, gate: Gate, default: str,
            metrics: ServerMetrics) -> None:
    def searcher(name: str | None) -> Searcher:
        if name is not None and name not in live.names:
            raise HTTPException(404, f"unknown set {name!r} (served: {', '.join(live.names)})")
        return live.get(name or default)

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' checks
    def health() -> dict:
        return {
            "status": "ok",
            "default_set": default,
            "auth": config.api_key is not None,
            "sets": {n: _describe(live.get(n)) | {"reload": live.status(n)} for n in live.names},
            "limits": {"max_k": config.max_k, "max_query_chars": config.max_query_chars,
                       "max_batch": config.max_batch, "max_inputs": config.max_inputs,
                       "max_input_chars": config.max_input_chars, "workers": config.workers,
                       "queue": config.queue},
        }

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(metrics.text(), media_type=CONTENT_TYPE)

    @app.post("/search", response_model=SearchResponse,
              responses={413: {}, 429: {}, 503: {}, 404: {}, 422: {}})
    async def search(req: SearchRequest):
        texts = req.texts()
        k = _check_search(req, texts, config)
        s = searcher(req.set)  # this generation serves the whole request
        started = time.perf_counter()
        hits = await gate.run(s.search, texts, k)
        took = round((time.perf_counter() - started) * 1000, 2)
        return SearchResponse(set=s.name, k=k, results=hits, took_ms=took)

    @app.post("/v1/embeddings", response_model=EmbeddingsResponse,
              responses={413: {}, 429: {}, 503: {}, 404: {}, 422: {}})
    async def embeddings(req: EmbeddingsRequest) -> JSONResponse:
        texts = _check_inputs(req.input, config)
        s = _check_dimensions(searcher(req.model), req.dimensions)
        vectors, tokens = await gate.run(_embed, s, texts, req.dimensions, False, True)
        data = [{"object": "embedding", "index": i, "embedding": _encoded(v, req.encoding_format)}
                for i, v in enumerate(vectors)]
        return JSONResponse({"object": "list", "data": data, "model": s.name,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def tei_embed(req: TeiEmbedRequest) -> JSONResponse:
        texts = _check_inputs(req.inputs, config)
        s = _check_dimensions(searcher(None), req.dimensions)
        vectors, _ = await gate.run(_embed, s, texts, req.dimensions, req.normalize,
                                    req.truncate is not False)
        return JSONResponse(vectors.tolist())

    app.post("/embed", response_model=list[list[float]],
             responses={413: {}, 429: {}, 503: {}, 422: {}})(tei_embed)
    app.post("/", include_in_schema=False)(tei_embed)


def _embed(s: Searcher, texts: list[str], dimensions: int | None, normalize: bool,
           truncate: bool) -> tuple[np.ndarray, int]:
    """The set's vectors for ``texts``; ``dimensions`` keeps the first N (re-normalised if the
    set's vectors are), ``normalize`` scales every vector to unit length, ``truncate`` False
    refuses a text longer than the model reads (413, as TEI answers)."""
    vectors, tokens = s.embed(texts, truncate)
    if dimensions is not None:
        vectors = vectors[:, :dimensions]
    if normalize or (dimensions is not None and s.set.normalize):
        vectors = unit_rows(vectors)
    return np.ascontiguousarray(vectors, dtype=np.float32), tokens


def _check_dimensions(s: Searcher, dimensions: int | None) -> Searcher:
    if dimensions is not None and dimensions > s.set.dim:
        raise HTTPException(422, f"dimensions must be <= {s.set.dim} (set {s.name!r})")
    return s


def _encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """OpenAI's ``base64``: the little-endian float32 bytes, base64; else a list of floats."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector.tolist()


def _describe(s: Searcher) -> dict:
    m = s.meta
    return {"kind": m.kind, "factory": m.factory, "rows": m.rows, "dim": m.dim,
            "metric": m.metric, "recall_at_10": m.recall_at_10, "params": m.params,
            "generation": m.generation, "set_generation": s.set.generation, "token": m.token,
            "model": s.set.model, "fingerprint": m.fingerprint}


def _check_search(req: SearchRequest, texts: list[str], config: ServerConfig) -> int:
    """The request's k (a k it leaves out: ``DEFAULT_K``, or max_k where that is less),
    once the request is checked against the server's limits."""
    if req.k is None:
        k = min(DEFAULT_K, config.max_k)
    elif req.k > config.max_k:
        raise HTTPException(422, f"k must be <= {config.max_k}")
    else:
        k = req.k
    if len(texts) > config.max_batch:
        raise HTTPException(422, f"at most {config.max_batch} queries per request")
    _check_chars(texts, config.max_query_chars, "query")
    return k


def _check_inputs(texts: list[str], config: ServerConfig) -> list[str]:
    if len(texts) > config.max_inputs:
        raise HTTPException(422, f"at most {config.max_inputs} inputs per request")
    _check_chars(texts, config.max_input_chars, "input")
    return texts


def _check_chars(texts: list[str], limit: int, what: str) -> None:
    long = [i for i, t in enumerate(texts) if len(t) > limit]
    if long:
        raise HTTPException(422, f"{what} {long[0]} is longer than {limit} characters")
