"""Request and response bodies: ``/search`` (ours), ``/v1/embeddings`` (OpenAI), ``/embed`` (TEI).

Every text is a ``Text``: a constrained string, which pydantic refuses when it is not valid
Unicode (a lone surrogate such as ``"\\ud800"`` is valid JSON, but no tokenizer can read it), so
it gets 422 here instead of a 500 in the model; blank texts are refused too.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    StringConstraints,
    model_validator,
)

from pipeline.corpus import blank
from pipeline.ranking import MAX_K
from pipeline.search import Hit
from pipeline.server.config import MAX_BATCH, MAX_QUERY_CHARS


def _not_blank(text: str) -> str:
    if blank(text):
        raise ValueError("text is empty or whitespace (no visible character)")
    return text


Text = Annotated[str, StringConstraints(min_length=1), AfterValidator(_not_blank)]


def _text_list(value: object) -> object:
    """One text or a list of texts, as a list: a bad text then gets one error (where it
    lies), not one per alternative of a ``str | list`` union. Token-id input (a list of ints,
    or of lists) is refused with a clear reason."""
    if value == []:
        raise ValueError("no input: send a string or a non-empty list of strings")
    if isinstance(value, list) and any(isinstance(v, int | list) for v in value):
        raise ValueError("token-id input is not supported: send text (a string or strings)")
    return [value] if isinstance(value, str) else value


TextList = Annotated[list[Text], BeforeValidator(_text_list)]  # "a" and ["a"] alike


def _no_prompt(value: str | None) -> None:
    if value is not None:
        raise ValueError("prompt_name is not supported: the set's own pipeline applies")


class SearchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    query: Text | None = None
    queries: list[Text] | None = Field(default=None, min_length=1, max_length=MAX_BATCH)
    # not true, 5.0 or "5"; None: the server's default (10, or its max_k where that is less)
    k: StrictInt | None = Field(default=None, ge=1, le=MAX_K)
    set: str | None = Field(default=None, min_length=1, max_length=64)

    @model_validator(mode="after")
    def _one_of(self) -> SearchRequest:
        if (self.query is None) == (self.queries is None):
            raise ValueError("give exactly one of 'query' (a string) or 'queries' (a list)")
        for i, text in enumerate(self.texts()):
            if len(text) > MAX_QUERY_CHARS:
                raise ValueError(f"query {i} is longer than {MAX_QUERY_CHARS} characters")
        return self

    def texts(self) -> list[str]:
        return [self.query] if self.query is not None else list(self.queries)


class SearchResponse(BaseModel):
    set: str
    k: int
    results: list[list[Hit]]
    took_ms: float


class EmbeddingsRequest(BaseModel):
    """OpenAI's ``POST /v1/embeddings``; ``model`` names a set (default: the server's)."""

    model_config = ConfigDict(extra="forbid")

    input: TextList
    model: str | None = Field(default=None, min_length=1, max_length=64)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(default=None, gt=0)
    user: str | None = None


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: Usage


class TeiEmbedRequest(BaseModel):
    """TEI's ``POST /embed``. The set's own pipeline decides long-text handling and prompts;
    ``truncate`` false refuses a text longer than the model reads (413), as TEI does."""

    model_config = ConfigDict(extra="forbid")

    inputs: TextList
    normalize: bool = True
    truncate: bool | None = None
    truncation_direction: Literal["right", "Right"] | None = None
    prompt_name: Annotated[str | None, AfterValidator(_no_prompt)] = None
    dimensions: StrictInt | None = Field(default=None, gt=0)
