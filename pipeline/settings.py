"""Deployment settings: ``EMBEDPIPE_*`` environment variables over an optional TOML file.

One image serves every deployment: the GPU pool sets ``EMBEDPIPE_DEVICE=cuda``, a laptop
leaves it ``auto``, the local stack points ``EMBEDPIPE_S3_ENDPOINT`` at MinIO. Settings are
*defaults*: a flag on the command line or a field in a job always wins over them.

Precedence (highest first): explicit job fields / flags > environment > the file named by
``EMBEDPIPE_CONFIG`` > built-in defaults. The file holds the same keys, lower-case, at top
level (``device = "cuda"``); an unknown key or a bad value fails with one line naming it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, ValidationInfo, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from pipeline.config import DAY_S, Device, DType, Runner, load_toml
from pipeline.errors import ConfigError

ENV_PREFIX = "EMBEDPIPE_"
CONFIG_ENV = "EMBEDPIPE_CONFIG"
# Settings that other modules (storage, hardware probe cache) and child processes read from the
# environment: a value that came from the file is exported so they all see the same one.
_EXPORTED = {"s3_endpoint": "EMBEDPIPE_S3_ENDPOINT", "cache": "EMBEDPIPE_CACHE",
             "lease_ttl": "EMBEDPIPE_LEASE_TTL"}


class Settings(BaseSettings):
    """Defaults for every job this installation runs."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True)

    model: str | None = None  # folder or HF name; None = the packaged all-MiniLM-L6-v2
    device: Device = "auto"
    dtype: DType = "auto"
    runner: Runner = "threads"
    dask_address: str | None = None
    s3_endpoint: str | None = None  # an S3-compatible store (MinIO); None = AWS
    cache: Path | None = None  # hardware probe cache; default ~/.cache/embedpipe
    lease_ttl: float | None = Field(default=None, ge=0.5, le=DAY_S)  # writer lease, s (60)
    # learned heads the operator keeps here may be taken from a set's _SET.json by a run that
    # names no pooler (the nightly); no other head path is ever read from OUT's files
    heads: str | None = None

    @field_validator("dask_address")
    @classmethod
    def _dask_address_with_dask(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("runner") != "dask":
            raise ValueError("a Dask scheduler address needs runner dask (EMBEDPIPE_RUNNER)")
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: tuple[PydanticBaseSettingsSource, ...] = (init_settings, env_settings)
        path = os.environ.get(CONFIG_ENV)
        if path:
            load_toml(path)  # a missing or malformed file fails here, with its path
            sources += (TomlConfigSettingsSource(settings_cls, toml_file=path),)
        return sources

    def job_defaults(self) -> dict[str, Any]:
        """The part of an EmbedJob (as a dict) these settings provide."""
        encoder = {"device": self.device, "dtype": self.dtype}
        if self.model is not None:
            encoder["model"] = self.model
        job: dict[str, Any] = {"encoder": encoder, "runner": self.runner}
        if self.dask_address is not None:
            job["dask_address"] = self.dask_address
        return job

    def apply_to_job(self, job: dict[str, Any]) -> dict[str, Any]:
        """``job`` with every field it leaves out (or sets to None) taken from these settings;
        their Dask address only where the job runs on Dask (a job that picks another runner
        leaves the installation's cluster alone)."""
        defaults = self.job_defaults()
        if job.get("runner") not in (None, "dask"):
            defaults.pop("dask_address", None)
        return _merge_missing(job, defaults)

    def export_env(self) -> None:
        """Put file-given values that other modules read from the environment into it."""
        for field, var in _EXPORTED.items():
            value = getattr(self, field)
            if value is not None and not os.environ.get(var):
                os.environ[var] = _exports[var] = str(value)


_exports: dict[str, str] = {}  # what export_env put into this process's environment


def withdraw_exports() -> None:
    """Take back what ``export_env`` put into the environment (a value since changed by
    someone else stays): a process that runs jobs under several settings files (the Python
    API called again with another ``EMBEDPIPE_CONFIG``) must not keep an earlier file's, which
    the environment's precedence would then make win over the new file's."""
    for var, value in list(_exports.items()):
        if os.environ.get(var) == value:
            del os.environ[var]
        del _exports[var]


def load_settings() -> Settings:
    """Read the settings; a bad value fails with one line naming the variable or file."""
    try:
        return Settings()
    except ValidationError as exc:
        source = os.environ.get(CONFIG_ENV)
        where = f"{ENV_PREFIX}* variables" + (f" or {source}" if source else "")
        problems = "; ".join(
            f"{_name(err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        raise ConfigError(f"invalid settings ({where}): {problems}") from None


def _name(loc: tuple) -> str:
    field = ".".join(str(p) for p in loc) or "settings"
    return f"{field} ({ENV_PREFIX}{field.upper()})"


def _merge_missing(job: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """Fill keys that ``job`` leaves out or sets to None (None = "no choice made")."""
    merged = dict(job)
    for key, value in defaults.items():
        current = merged.get(key)
        if current is None:
            merged[key] = value
        elif isinstance(value, dict) and isinstance(current, dict):
            merged[key] = _merge_missing(current, value)
    return merged


def cache_root() -> Path:
    """Where embedpipe caches what it measured or computed (CPU probe, model hashes, remote
    indexes, the CLI's Prefect server record): ``EMBEDPIPE_CACHE``, else ~/.cache/embedpipe."""
    return Path(os.environ.get("EMBEDPIPE_CACHE", Path.home() / ".cache" / "embedpipe"))


def write_cache(path: Path, payload: object) -> None:
    """``payload`` as JSON at ``path`` (under ``cache_root``), written then renamed: a reader
    (a parallel worker) never sees half a file. A cache that cannot be written is only a
    slower next start (measured or computed again), never an error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps(payload))
        os.replace(partial, path)
    except OSError:
        return
