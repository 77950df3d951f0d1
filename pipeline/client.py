"""A client of a running ``embedpipe serve``: ``POST /search`` over HTTP (stdlib only).

``EMBEDPIPE_API_KEY``, when set, is sent as ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

from pipeline.errors import EmbedpipeError
from pipeline.search import Hit

API_KEY_ENV = "EMBEDPIPE_API_KEY"
TIMEOUT_S = 60.0


class ServerError(EmbedpipeError):
    """The server could not be reached, or refused the request (its reason is kept)."""


def search_remote(url: str, queries: list[str], k: int = 10,
                  set_name: str | None = None) -> tuple[str, list[list[Hit]]]:
    """(set name, hits per query) from the server at ``url`` (``http://host:port``)."""
    body = {"queries": queries, "k": k} | ({"set": set_name} if set_name else {})
    headers = {"Content-Type": "application/json"}
    key = os.environ.get(API_KEY_ENV)
    if key:
        headers["Authorization"] = f"Bearer {key}"
    endpoint = url.rstrip("/") + "/search"
    request = urllib.request.Request(endpoint, data=json.dumps(body).encode(), headers=headers,
                                     method="POST")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            payload = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise ServerError(f"{endpoint} answered {exc.code}: {_detail(exc)}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ServerError(f"cannot reach {endpoint}: {reason}") from None
    results = [[Hit.model_validate(h) for h in row] for row in payload["results"]]
    return payload["set"], results


def _detail(exc: urllib.error.HTTPError) -> str:
    try:
        detail = json.loads(exc.read()).get("detail")
    except (ValueError, AttributeError):
        return exc.reason
    return detail if isinstance(detail, str) else json.dumps(detail)
