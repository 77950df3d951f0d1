"""The server's socket and connections (``pipeline.server.listener``): a bad address is one
line before anything loads; connections that never finish their headers do not hold the
server's connection slots."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from _search_sets import embedded_set
from _serve import serving

from flows.cli import main
from pipeline.errors import ConfigError
from pipeline.index import IndexRequest, index_set
from pipeline.server.listener import bound_socket


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_a_port_out_of_range_is_one_line_before_any_set_loads(tmp_path, port, capsys):
    missing = tmp_path / "no-such-out"  # never read: the port is checked first
    assert main(["serve", str(missing), "--port", port]) == 1
    err = capsys.readouterr().err
    assert err == f"embedpipe serve: error: --port must be between 0 and 65535, got {port}\n"


def test_a_port_in_use_or_a_host_that_does_not_resolve_is_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"^cannot listen on 127.0.0.1:{port}: "):
            bound_socket("127.0.0.1", port)
    with pytest.raises(ConfigError, match=r"^--host 'no-such-host.invalid' does not resolve"):
        bound_socket("no-such-host.invalid", 8000)
    with bound_socket("127.0.0.1", 0) as sock:  # port 0: the system picks one
        assert sock.getsockname()[1] > 0


def _silent_until_closed(conn: socket.socket, deadline: float) -> bool:
    """Whether the server closed ``conn`` (recv gives b"") before ``deadline``."""
    conn.settimeout(max(0.1, deadline - time.monotonic()))
    try:
        return conn.recv(1) == b""
    except (TimeoutError, ConnectionResetError):
        return False


def test_connections_that_never_finish_their_headers_are_closed(tmp_path, tiny_model_dir):
    out = embedded_set(tmp_path, tiny_model_dir)
    index_set(IndexRequest(out=str(out), set_name="mean"), say=lambda _: None)
    with serving(out, "--max-connections", "4", "--body-timeout", "1") as (base, _, _):
        port = int(base.rsplit(":", 1)[1])
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        partial = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        for conn in partial:
            conn.sendall(b"POST /search HTTP/1.1\r\nHost: x\r\n")  # headers never end
        try:
            deadline = time.monotonic() + 60  # a hang guard: the timeout is 1 s
            assert all(_silent_until_closed(c, deadline) for c in idle + partial)
            assert httpx.get(f"{base}/health", timeout=10).status_code == 200
            with httpx.Client(base_url=base) as client:  # a kept-alive client is unaffected
                for _ in range(2):
                    assert client.post("/search", json={"query": "a", "k": 1}).status_code == 200
        finally:
            for conn in idle + partial:
                conn.close()
