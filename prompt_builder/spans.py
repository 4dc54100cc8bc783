"""Spans as users give them, and spans as the builder lays them out.

A span is a document (or tool description, memory, ...) that may be cached on its own. Users give
text or pre-tokenised ids, optionally with a stable id and a retrieval score. The builder turns it
into a ``PreparedSpan``: fixed token ids plus a *content address* — the sha256 of those ids and
of the ``SpanConfig`` — so the same text always gets the same ids and the same id wherever it
appears, and a registry of warm spans can key on it without trusting user-chosen names.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator
from pydantic import ValidationError as PydanticValidationError

from minipic.prompt_builder.errors import DuplicateSpanIdError, EmptySpanError, InvalidInputError
from minipic.span_contract.span_config import SpanConfig


class Span(BaseModel):
    """One cacheable piece of context: ``text`` or pre-tokenised ``token_ids`` (exactly one).

    ``id`` is an optional stable name (e.g. a document id); without it the span is named by its
    content address. ``score`` ranks spans for budgeting (higher is better); without scores the
    order given is the rank order.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    text: StrictStr | None = None
    token_ids: tuple[StrictInt, ...] | None = None
    id: StrictStr | None = Field(None, min_length=1)
    score: float | None = None

    @model_validator(mode="after")
    def _one_source(self) -> Span:
        if (self.text is None) == (self.token_ids is None):
            raise ValueError("a Span needs exactly one of text or token_ids")
        if self.score is not None and not math.isfinite(self.score):
            raise ValueError(f"span score must be finite, got {self.score}")
        return self


SpanInput = str | Span | Mapping[str, Any]


def coerce_span(value: object, index: int) -> Span:
    """A ``Span`` from what users pass (str, Span or a mapping of Span fields)."""
    if isinstance(value, Span):
        return value
    if isinstance(value, str):
        return Span(text=value)
    if isinstance(value, Mapping):
        try:
            return Span.model_validate(value)
        except PydanticValidationError as exc:
            raise InvalidInputError(f"span {index}: {exc}") from None
    raise InvalidInputError(
        f"span {index}: expected str, Span or a mapping of Span fields, got {type(value).__name__}"
    )


def coerce_spans(values: object) -> list[Span]:
    """Spans from a list; a bare string is refused (iterating it would make one span per char)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise InvalidInputError(
            f"spans must be a list of str or Span, got {type(values).__name__}"
        )
    return [coerce_span(v, i) for i, v in enumerate(values)]


def content_id(token_ids: Sequence[int], config: SpanConfig) -> str:
    """Content address of a span: sha256 over the config and the ids (first 128 bits, hex).

    The config is part of it because the same ids laid out with other markers or another block
    size are different cache entries.
    """
    digest = hashlib.sha256(
        f"minipic-span-v1:{config.block_size}:{config.ssep_id}:{config.pdep_id}:"
        f"{config.pad_id}:".encode()
    )
    digest.update(",".join(map(str, token_ids)).encode())
    return digest.hexdigest()[:32]


def prefill_key(token_ids: Sequence[int], block_size: int) -> str:
    """Key of a span prefill request: what the engine caches is exactly these ids in blocks."""
    digest = hashlib.sha256(f"minipic-prefill-v1:{block_size}:".encode())
    digest.update(",".join(map(str, token_ids)).encode())
    return digest.hexdigest()[:32]


@dataclass(frozen=True)
class PreparedSpan:
    """A span with its final token ids (no markers, no padding) and its ids."""

    index: int  # position in the caller's list
    token_ids: tuple[int, ...]
    span_id: str  # user id, or the content address
    content_id: str
    user_id: str | None
    score: float | None
    truncated_from: int | None = None  # original token count when shortened by the budget

    def truncated(self, keep: int, config: SpanConfig) -> PreparedSpan:
        """The span's first ``keep`` tokens: new content, so a new content address and id."""
        ids = self.token_ids[:keep]
        cid = content_id(ids, config)
        name = f"{self.user_id}[:{keep}]" if self.user_id is not None else cid
        return replace(
            self, token_ids=ids, span_id=name, content_id=cid,
            truncated_from=len(self.token_ids),
        )


def check_distinct_ids(spans: Sequence[PreparedSpan]) -> None:
    """A user id must name one content; two contents under one name would poison a registry."""
    seen: dict[str, PreparedSpan] = {}
    for span in spans:
        if span.user_id is None:
            continue
        first = seen.setdefault(span.user_id, span)
        if first.content_id != span.content_id:
            raise DuplicateSpanIdError(
                f"spans {first.index} and {span.index} share id {span.user_id!r} but differ in "
                "content"
            )


def require_tokens(ids: Sequence[int], index: int, user_id: str | None) -> None:
    if not ids:
        name = f" ({user_id!r})" if user_id else ""
        raise EmptySpanError(f"span {index}{name} is empty: a span needs at least one token")
