"""A client of a running ``embedpipe serve``: ``POST /search`` over HTTP (stdlib only).

``EMBEDPIPE_API_KEY``, when set, is sent as ``Authorization: Bearer <key>``. Every failure,
a bad URL and an answer that is not search results included, is one ``ServerError``.
"""

from __future__ import annotations

import http.client
import json
import os
import urllib.error
import urllib.parse
import urllib.request

from pipeline import names
from pipeline.errors import EmbedpipeError
from pipeline.search import Hit

API_KEY_ENV = "EMBEDPIPE_API_KEY"  # the key the client sends and the server takes
TIMEOUT_S = 60.0
EXCERPT_CHARS = 80  # of an answer that is not search results, quoted in the error


def key_problem(key: str, where: str) -> str | None:
    """Why ``key`` cannot be sent as ``Authorization: Bearer <key>`` (one line), else None."""
    if key.isascii() and key.isprintable():
        return None
    return f"{where} holds characters an HTTP header cannot carry (printable ASCII only)"


class ServerError(EmbedpipeError):
    """The URL is not a server's, the server could not be reached, refused the request (its
    reason is kept), or answered with something other than search results."""


def search_remote(url: str, queries: list[str], k: int | None = None,
                  set_name: str | None = None) -> tuple[str, list[list[Hit]]]:
    """(set name, hits per query) from the server at ``url`` (``http://host:port``); the
    server's default set where ``set_name`` is None (an empty name is refused, not dropped),
    and its default k where ``k`` is None."""
    chosen = {} if set_name is None else {"set": names.set_name(set_name)}
    body = {"queries": queries} | ({} if k is None else {"k": k}) | chosen
    endpoint = _endpoint(url)
    return _search_results(endpoint, _post(endpoint, body), len(queries))


def _endpoint(url: str) -> str:
    """``url``'s ``/search``; a ServerError when ``url`` is not ``http(s)://host[:port]``."""
    try:
        parts = urllib.parse.urlsplit(url)
        good = parts.scheme in ("http", "https") and bool(parts.hostname)
        parts.port  # noqa: B018  (raises ValueError for a port that is not a number)
    except ValueError:
        good = False
    if not good:
        raise ServerError(f"{url!r} is not a server URL: give http://host:port")
    return url.rstrip("/") + "/search"


def _post(endpoint: str, body: dict) -> bytes:
    """The body of a 2xx answer to ``body`` POSTed as JSON; anything else is a ServerError."""
    headers = {"Content-Type": "application/json"}
    key = os.environ.get(API_KEY_ENV)
    if key:
        problem = key_problem(key, API_KEY_ENV)
        if problem:
            raise ServerError(problem)
        headers["Authorization"] = f"Bearer {key}"
    try:
        request = urllib.request.Request(endpoint, data=json.dumps(body).encode(),
                                         headers=headers, method="POST")
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.read()
    except urllib.error.HTTPError as exc:
        raise ServerError(f"{endpoint} answered {exc.code}: {_detail(exc)}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", exc)
        raise ServerError(f"cannot reach {endpoint}: {reason}") from None
    except ValueError as exc:  # a URL urllib refuses that _endpoint let through
        raise ServerError(f"cannot reach {endpoint}: {exc}") from None


def _search_results(endpoint: str, raw: bytes, queries: int) -> tuple[str, list[list[Hit]]]:
    """(set, hits per query) of a ``/search`` answer for ``queries`` queries, or a ServerError
    quoting what came."""
    try:
        payload = json.loads(raw)
        name, rows = payload["set"], payload["results"]
        if not isinstance(name, str) or not isinstance(rows, list) or len(rows) != queries:
            raise TypeError(f"not a set name and {queries} rows of hits")
        return name, [[Hit.model_validate(h) for h in row] for row in rows]
    except (ValueError, KeyError, TypeError):  # not JSON, or not a search response
        excerpt = raw[:EXCERPT_CHARS].decode(errors="replace")
        raise ServerError(f"{endpoint} answered, but not with search results: "
                          f"{excerpt!r}") from None


def _detail(exc: urllib.error.HTTPError) -> str:
    try:
        detail = json.loads(exc.read()).get("detail")
    except (ValueError, AttributeError):
        return exc.reason
    return detail if isinstance(detail, str) else json.dumps(detail)
