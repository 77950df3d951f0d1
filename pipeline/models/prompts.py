"""Prompts from ``config_sentence_transformers.json``: which text goes before documents and queries.

Documents get the model's ``default_prompt_name`` prompt (what ``SentenceTransformer.encode``
does) unless ``EncoderConfig.prompt_name`` names another (``""``: none). Queries get the
``query`` prompt when the model has one (what ``encode_query`` does) unless
``EncoderConfig.query_prompt_name`` names another (``""``: none).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import ConfigError, ModelError
from pipeline.models.jsonfile import read_optional_json

CONFIG = "config_sentence_transformers.json"
QUERY = "query"


@dataclass(frozen=True)
class Prompts:
    prompts: dict[str, str] = field(default_factory=dict)
    default_name: str | None = None

    def document(self, name: str | None) -> str:
        return self._pick(self.default_name if name is None else name, "prompt_name")

    def query(self, name: str | None) -> str:
        if name is None:
            return self.prompts.get(QUERY, "")
        return self._pick(name, "query_prompt_name")

    def _pick(self, name: str | None, option: str) -> str:
        if not name:
            return ""
        if name not in self.prompts:
            known = ", ".join(sorted(self.prompts)) or "none"
            raise ConfigError(f"{option} {name!r} is not a prompt of this model (prompts: {known})")
        return self.prompts[name]


def read_prompts(folder: Path) -> Prompts:
    path = folder / CONFIG
    raw = read_optional_json(path)
    prompts = raw.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(
        isinstance(k, str) and isinstance(v, str | None) for k, v in prompts.items()
    ):
        raise ModelError(f"{path}: prompts must map names to texts")
    prompts = {k: v or "" for k, v in prompts.items()}
    default = raw.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise ModelError(f"{path}: default_prompt_name {default!r} is not one of its prompts")
    return Prompts(prompts, default)
