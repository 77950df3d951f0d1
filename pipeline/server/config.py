"""The server's options (one frozen model) and where its API key comes from."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, Field, SecretStr

from pipeline.client import API_KEY_ENV, key_problem
from pipeline.config import AS_LIST, DAY_S, STRICT
from pipeline.errors import ConfigError
from pipeline.ranking import MAX_K

MAX_QUERY_CHARS = 10_000
MAX_BATCH = 256
KEY_FILE_ENV = "EMBEDPIPE_API_KEY_FILE"




class ServerConfig(BaseModel):
    model_config = STRICT

    out: str
    sets: Annotated[tuple[str, ...], AS_LIST] = ()  # empty: every indexed set under OUT
    default_set: str | None = None  # None: the only set, else `model`, else `mean`
    device: str | None = None
    api_key: SecretStr | None = None  # every route but /health needs `Bearer <key>`
    max_k: int = Field(default=100, gt=0, le=MAX_K)
    max_query_chars: int = Field(default=2_000, gt=0, le=MAX_QUERY_CHARS)
    max_batch: int = Field(default=32, gt=0, le=MAX_BATCH)
    max_inputs: int = Field(default=MAX_BATCH, gt=0, le=MAX_BATCH)  # texts per embedding call
    max_input_chars: int = Field(default=MAX_QUERY_CHARS, gt=0, le=MAX_QUERY_CHARS)
    max_body_bytes: int = Field(default=1_000_000, gt=0)
    body_timeout_s: float = Field(default=10.0, gt=0, le=DAY_S)  # a slow body: 408 after it
    workers: int = Field(default=2, gt=0)
    queue: int = Field(default=16, ge=0)
    queue_timeout_s: float = Field(default=5.0, gt=0, le=DAY_S)
    faiss_threads: int = Field(default=1, gt=0)
    reload_interval_s: float = Field(default=2.0, ge=0, le=DAY_S)  # 0: never look for new ones
    max_connections: int = Field(default=64, gt=0)  # uvicorn answers 503 above this
    keep_alive_s: float = Field(default=5.0, gt=0, le=DAY_S)
    trust_remote_code: bool = False  # the operator's --trust-remote-code, never _SET.json's


def api_key(key_file: str | None = None, env: Mapping[str, str] = os.environ) -> str | None:
    """The key from ``key_file`` (or ``EMBEDPIPE_API_KEY_FILE``) or ``EMBEDPIPE_API_KEY``.

    A key given both ways is refused rather than one silently winning; an empty key or an
    unreadable file is an error, never "no authentication".
    """
    for given, where in ((key_file, "--api-key-file"), (env.get(KEY_FILE_ENV), KEY_FILE_ENV)):
        if given is not None and not given.strip():  # "$UNSET_VAR": never "no authentication"
            raise ConfigError(f"{where} is empty; name the key file, or leave it out to serve "
                              "without a key")
    key_file = key_file or env.get(KEY_FILE_ENV) or None
    if key_file and env.get(API_KEY_ENV):
        raise ConfigError(f"both {API_KEY_ENV} and an API key file ({key_file}) are set; use one")
    if key_file:
        try:
            key = Path(key_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read the API key file {key_file}: {exc}") from None
        where = f"API key file {key_file}"
    elif API_KEY_ENV in env:
        key, where = env[API_KEY_ENV].strip(), API_KEY_ENV
    else:
        return None
    if not key:
        raise ConfigError(f"{where} is empty; give a key or unset it to serve without one")
    problem = key_problem(key, where)  # no client could send it
    if problem:
        raise ConfigError(problem)
    return key


def choose_default(names: list[str], configured: str | None) -> str:
    """The set served when a request names none: the configured one, the only one, or the
    one named ``model`` or else ``mean``; with several others, refuse to guess."""
    if configured is not None:
        if configured not in names:
            raise ConfigError(f"--default-set {configured!r} is not served "
                              f"(served: {', '.join(names)})")
        return configured
    if len(names) == 1:
        return names[0]
    for preferred in ("model", "mean"):
        if preferred in names:
            return preferred
    raise ConfigError(f"several sets are served ({', '.join(names)}) and none is named 'model' "
                      "or 'mean': pass --default-set NAME")
