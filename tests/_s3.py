"""A real S3 API server on loopback (moto in server mode) and helpers to drive it.

The code under test talks to it through s3fs/botocore over HTTP; nothing patches boto or s3fs.
Two server-side tools make failures real rather than mocked:

- ``iam_enforced()``: moto's own switch (``POST /moto-api/reset-auth``) that makes the server
  check signatures and IAM policies like AWS. Caveat (moto 5.2): under it, any request whose
  query string holds a ``/`` (every prefix listing) fails with SignatureDoesNotMatch, so use it
  for object reads and writes only.
- ``faults``: a WSGI layer in front of moto that, for uploads whose key matches a pattern,
  reads half of the request body and then answers ``500 InternalError`` — what S3 does when an
  upload dies on its side. The client's real retry logic then either absorbs the failure
  (a transient fault) or gives up (a persistent one). It also logs every upload and read it
  sees, and can hold reads as a distant store's latency would (``slow_reads``).

The layer also makes a conditional PUT (``If-Match`` / ``If-None-Match``) one step, as S3
does: moto 5.2 checks the condition and then writes, so two racing conditional PUTs could
both pass there; here they are serialised.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
from moto.server import ThreadedMotoServer
from werkzeug.serving import make_server

REGION = "us-east-1"
TEST_KEY = "testing"
TEST_SECRET = "testing"
_INTERNAL_ERROR = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
    b"<Message>We encountered an internal error. Please try again.</Message></Error>"
)


@dataclass(frozen=True)
class Credentials:
    key: str
    secret: str


@dataclass
class _Rule:
    pattern: re.Pattern
    remaining: int | None  # None: until the rule is removed
    let_through: int = 0  # matching uploads to let pass before failing
    hits: int = 0


@dataclass
class Faults:
    """Upload faults and a log of uploads (``bucket/key`` of every PUT that reached moto)."""

    uploads: list[str] = field(default_factory=list)
    # every GET and HEAD that reached moto, as (method, bucket/key); the most held at once
    reads: list[tuple[str, str]] = field(default_factory=list)
    reads_at_once: int = 0
    read_delay: float = 0.0
    _reading: int = 0
    _rules: list[_Rule] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _conditional: threading.Lock = field(default_factory=threading.Lock)

    @contextmanager
    def failing_uploads(self, pattern: str, times: int | None = None,
                        let_through: int = 0) -> Iterator[_Rule]:
        """Fail uploads whose ``bucket/key`` matches ``pattern`` (``times`` times, or all),
        after letting the first ``let_through`` matching ones pass."""
        rule = _Rule(re.compile(pattern), times, let_through)
        with self._lock:
            self._rules.append(rule)
        try:
            yield rule
        finally:
            with self._lock:
                self._rules.remove(rule)

    def _take(self, key: str) -> _Rule | None:
        with self._lock:
            for rule in self._rules:
                if rule.pattern.search(key) and rule.remaining != 0:
                    if rule.let_through > 0:
                        rule.let_through -= 1
                        return None
                    rule.hits += 1
                    if rule.remaining is not None:
                        rule.remaining -= 1
                    return rule
            return None

    @contextmanager
    def slow_reads(self, seconds: float) -> Iterator[None]:
        """Hold every GET and HEAD ``seconds`` before moto answers it (a store's latency):
        reads made one after another then take that long each, reads made at once overlap
        (``reads_at_once``)."""
        self.read_delay, self.reads_at_once = seconds, 0
        try:
            yield
        finally:
            self.read_delay = 0.0

    def _read(self, app, environ, start_response):
        key = unquote(environ.get("PATH_INFO", "")).lstrip("/")
        with self._lock:
            self.reads.append((environ["REQUEST_METHOD"], key))
            self._reading += 1
            self.reads_at_once = max(self.reads_at_once, self._reading)
        try:
            time.sleep(self.read_delay)
            return app(environ, start_response)
        finally:
            with self._lock:
                self._reading -= 1

    def wrap(self, app):
        def middleware(environ, start_response):
            if environ["REQUEST_METHOD"] in ("GET", "HEAD"):
                return self._read(app, environ, start_response)
            if environ["REQUEST_METHOD"] != "PUT":
                return app(environ, start_response)
            key = unquote(environ.get("PATH_INFO", "")).lstrip("/")
            if self._take(key) is None:
                with self._lock:
                    self.uploads.append(key)
                if "HTTP_IF_MATCH" in environ or "HTTP_IF_NONE_MATCH" in environ:
                    # moto checks a PUT's condition, then writes; S3 does both as one step
                    with self._conditional:
                        return app(environ, start_response)
                return app(environ, start_response)
            length = int(environ.get("CONTENT_LENGTH") or 0)
            environ["wsgi.input"].read(length // 2)  # the upload dies half-way
            start_response("500 Internal Server Error", [
                ("Content-Type", "application/xml"), ("Connection", "close"),
                ("Content-Length", str(len(_INTERNAL_ERROR))),
            ])
            return [_INTERNAL_ERROR]

        return middleware


class _FaultyMotoServer(ThreadedMotoServer):
    """moto's threaded server with the fault layer in front of its WSGI app."""

    def __init__(self, faults: Faults) -> None:
        super().__init__(ip_address="127.0.0.1", port=0, verbose=False)
        self._faults = faults

    def _server_entry(self) -> None:
        app = self._faults.wrap(DomainDispatcherApplication(create_backend_app))
        self._server = make_server(self._ip_address, self._port, app, True)
        self._server_ready_event.set()
        self._server.serve_forever()


class S3Server:
    """A moto S3 server in this process, on 127.0.0.1 and a port the OS picks."""

    def __init__(self) -> None:
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request
        self.faults = Faults()
        self._server = _FaultyMotoServer(self.faults)
        self._server.start()
        self.host, self.port = self._server.get_host_and_port()
        self.endpoint = f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self._server.stop()

    def client(self, service: str = "s3", creds: Credentials | None = None):
        """A boto3 client for the server (test set-up only; the code under test uses s3fs)."""
        import boto3

        creds = creds or Credentials(TEST_KEY, TEST_SECRET)
        return boto3.client(
            service, endpoint_url=self.endpoint, region_name=REGION,
            aws_access_key_id=creds.key, aws_secret_access_key=creds.secret,
        )

    def user_with_policy(self, name: str, statements: list[dict]) -> Credentials:
        """Create an IAM user (``name`` plus a unique suffix) with an inline policy; return
        its access key."""
        name = f"{name}-{uuid.uuid4().hex[:8]}"
        iam = self.client("iam")
        iam.create_user(UserName=name)
        iam.put_user_policy(
            UserName=name, PolicyName=f"{name}-policy",
            PolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": statements}),
        )
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return Credentials(key["AccessKeyId"], key["SecretAccessKey"])

    @contextmanager
    def iam_enforced(self) -> Iterator[None]:
        """Make the server check signatures and IAM policies on every request, like AWS."""
        previous = self._reset_auth("0")
        try:
            yield
        finally:
            self._reset_auth(previous)

    def _reset_auth(self, count: str) -> str:
        request = urllib.request.Request(
            f"{self.endpoint}/moto-api/reset-auth", data=count.encode(), method="POST",
            headers={"Content-Type": "text/plain"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())["PREVIOUS_INITIAL_NO_AUTH_ACTION_COUNT"]

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        s3 = self.client()
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def pending_multipart_uploads(self, bucket: str) -> list[str]:
        return [u["Key"] for u in self.client().list_multipart_uploads(Bucket=bucket)
                .get("Uploads", [])]

    def empty_bucket(self, bucket: str) -> None:
        """Delete every object and the bucket itself."""
        s3 = self.client()
        for key in self.keys(bucket):
            s3.delete_object(Bucket=bucket, Key=key)
        s3.delete_bucket(Bucket=bucket)


def allow_all_but(deny_actions: list[str], deny_resources: list[str]) -> list[dict]:
    """An IAM policy: everything allowed except ``deny_actions`` on ``deny_resources``."""
    statements: list[dict] = [{"Effect": "Allow", "Action": "*", "Resource": "*"}]
    if deny_actions:
        statements.append({"Effect": "Deny", "Action": deny_actions, "Resource": deny_resources})
    return statements


def upload_dir(local: Path, url: str) -> None:
    """Copy a local folder to ``url``, file by file, the ``_``-named markers last (as a run
    writes them: a reader that finds a marker finds what it names)."""
    from pipeline import storage

    fs, root = storage.filesystem(url)
    files = sorted((p for p in local.rglob("*") if p.is_file()),
                   key=lambda p: (p.name.startswith("_"), p.relative_to(local).as_posix()))
    for path in files:
        fs.put_file(str(path), f"{root}/{path.relative_to(local).as_posix()}")
