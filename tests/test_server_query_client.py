"""`embedpipe query --url` (``pipeline.client``) when the URL or the answer is wrong: one line
naming the URL, exit 1, never a traceback.

Answers that are not search results come from a stdlib HTTP server on loopback (``_http``:
what ``--url`` may point at by mistake, another service, a proxy's error page)."""

from __future__ import annotations

import pytest
from _http import answering

from flows.cli import main


def _one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert captured.out == ""
    return line


@pytest.mark.parametrize("url", ["myhost", "myhost:8000", "http://127.0.0.1:port", "http://[::1",
                                 "ftp://127.0.0.1:8000"])
def test_a_url_that_is_not_http_host_port_is_one_line_naming_it(url, capsys):
    assert main(["query", "--url", url, "hello"]) == 1
    assert _one_line_error(capsys) == (f"embedpipe query: error: {url!r} is not a server URL: "
                                       "give http://host:port")


@pytest.mark.parametrize(("body", "content_type"), [
    (b"<html><body>\n<h1>Welcome to nginx!</h1></body></html>", "text/html"),
    (b'{"status": "ok"}', "application/json"),
    (b'{"set": "mean", "results": [["not a hit"]]}', "application/json"),
    (b'{"set": 3, "results": [[]]}', "application/json"),
    (b'{"set": "mean", "results": []}', "application/json"),  # no row for the query
])
def test_a_200_that_is_not_search_results_is_one_line_naming_the_url(body, content_type,
                                                                     capsys):
    with answering(body, content_type) as base:
        assert main(["query", "--url", base, "hello"]) == 1
    line = _one_line_error(capsys)
    assert line.startswith(f"embedpipe query: error: {base}/search answered, but not with "
                           "search results: ")
    assert repr(body[:20].decode())[1:-1] in line  # what came, quoted


def test_a_key_no_header_can_carry_is_named_not_taken_for_an_unreachable_server(monkeypatch,
                                                                                 capsys):
    monkeypatch.setenv("EMBEDPIPE_API_KEY", "clé")
    assert main(["query", "--url", "http://127.0.0.1:9", "hello"]) == 1
    assert _one_line_error(capsys) == (
        "embedpipe query: error: EMBEDPIPE_API_KEY holds characters an HTTP header cannot "
        "carry (printable ASCII only)")
