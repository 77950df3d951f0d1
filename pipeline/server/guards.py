"""What stands before the routes: API key, body size and read time, safe 422 bodies.

- ``ApiKeyGuard``: every path but ``/health`` needs ``Authorization: Bearer <key>``; the key
  is compared as SHA-256 digests with ``hmac.compare_digest`` (constant time, whatever the
  length sent). Otherwise 401 with ``WWW-Authenticate: Bearer``.
- ``BodyLimit``: 413 for a body above the limit (declared or streamed, never more held), 408
  when the whole body has not arrived within ``timeout_s`` (a slow client cannot hold a worker).
- ``validation_problem``: FastAPI's 422 without the ``input`` it echoes by default (a megabyte
  of it, or a lone surrogate that cannot even be written as UTF-8): location, message and
  type only, each clipped; 415 for a body declared as another type than JSON.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

OPEN_PATHS = frozenset({"/health"})
MAX_ERRORS = 10
MAX_ERROR_CHARS = 200


def problem(status: int, reason: str, **headers: str) -> JSONResponse:
    return JSONResponse({"detail": reason}, status_code=status, headers=headers or None)


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class ApiKeyGuard:
    """ASGI middleware: 401 unless the request carries ``Bearer <key>``."""

    def __init__(self, app, key: str) -> None:
        self.app, self.want = app, _digest(key.encode("utf-8"))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        sent = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = sent.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(_digest(token.strip()), self.want):
            return await self.app(scope, receive, send)
        reason = "missing or wrong API key: send 'Authorization: Bearer <key>'"
        await problem(401, reason, **{"WWW-Authenticate": "Bearer"})(scope, receive, send)


class BodyLimit:
    """ASGI middleware: the body is read here, bounded in size and time, and replayed."""

    def __init__(self, app, limit: int, timeout_s: float) -> None:
        self.app, self.limit, self.timeout_s = app, limit, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and not declared.isdigit():
            return await problem(400, "invalid Content-Length header")(scope, receive, send)
        if declared is not None and int(declared) > self.limit:
            return await self._too_large(scope, receive, send)
        chunks, seen = [], 0
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), deadline - time.monotonic())
            except TimeoutError:
                reason = f"request body not received within {self.timeout_s:g}s"
                return await problem(408, reason, Connection="close")(scope, receive, send)
            if message["type"] != "http.request":
                return  # the client went away
            seen += len(message.get("body", b""))
            if seen > self.limit:
                return await self._too_large(scope, receive, send)
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send):
        reason = f"request body is larger than {self.limit:,} bytes"
        await problem(413, reason)(scope, receive, send)


def _json_body(content_type: str | None) -> bool:
    """Whether a body of this Content-Type is JSON: a JSON media type (``application/json``,
    ``application/problem+json``; parameters aside). FastAPI reads a body without one as
    bytes (``strict_content_type``)."""
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/")
                                            and media.endswith("+json"))


def _safe(value: object) -> str | int:
    """``value`` as JSON-safe text: lone surrogates escaped, at most MAX_ERROR_CHARS long."""
    if isinstance(value, int):
        return value
    text = str(value).encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 1] + "…"


async def validation_problem(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    content_type = request.headers.get("content-type")
    if not _json_body(content_type) and all(tuple(e.get("loc", ())) == ("body",) for e in errors):
        # FastAPI hands a body of another declared type (or of none) over as bytes, and its
        # 422 said "Input should be a valid dictionary": the type is what is wrong
        given = f"not {_safe(content_type)}" if content_type else "and none was given"
        return problem(415, "the request body must be JSON (Content-Type: application/json), "
                            f"{given}")
    detail = [{"loc": [_safe(part) for part in e.get("loc", ())], "msg": _safe(e.get("msg", "")),
               "type": _safe(e.get("type", ""))} for e in errors[:MAX_ERRORS]]
    if len(errors) > MAX_ERRORS:
        detail.append({"loc": [], "msg": f"and {len(errors) - MAX_ERRORS} more errors",
                       "type": "too_many_errors"})
    return JSONResponse({"detail": detail}, status_code=422)
