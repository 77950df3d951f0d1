"""The server's socket and connections: bound before anything loads, and no connection held
open by a client that never finishes its request headers.

- ``bound_socket``: the address checked and bound first, so a bad port, a host that does not
  resolve or a port in use is one line in a second, not a traceback after every model and
  index has loaded; uvicorn then serves on this socket.
- ``header_timeout_protocol``: uvicorn's h11 protocol with a timer on each request's headers.
  uvicorn's own keep-alive timer starts only after a first response and stops at the first
  byte, and ``BodyLimit`` sees a request only once its headers are complete: 64
  (``--max-connections``) connections that sent nothing, or half a request line, held every
  slot, and everyone else got 503 for as long as they stayed open.
"""

from __future__ import annotations

import asyncio
import socket

from uvicorn.protocols.http.h11_impl import H11Protocol

from pipeline.errors import ConfigError


def bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (not listening yet), or one line saying why not."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port must be between 0 and 65535, got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host!r} does not resolve: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


class _HeaderTimeout(H11Protocol):
    """Closes a connection whose request headers are not complete ``timeout_s`` after it
    opened or after its last response."""

    timeout_s = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not self._waiting_after:  # a new request's headers are complete
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._waiting_after = self.cycle
        self._late = self.loop.call_later(self.timeout_s, self._headers_late)

    def _disarm(self) -> None:
        late = getattr(self, "_late", None)
        if late is not None:
            late.cancel()
            self._late = None

    def _headers_late(self) -> None:
        self._late = None
        if not self.transport.is_closing():
            self.transport.close()


def header_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing connections whose headers take over ``timeout_s``."""
    return type("HeaderTimeoutProtocol", (_HeaderTimeout,), {"timeout_s": timeout_s})
