"""Errors an orchestrator user catches by kind (httpx style: one tree, catch the branch you mean).

    MinipicError
    ├── BadInputError            the question, documents or options can never work as given
    │   └── SpanTooLongError     one document alone does not fit the engine's context
    ├── ConfigMismatchError      the server runs another block size / SSEP / PDEP / PAD
    ├── CacheMismatchError       the engine had spans cold that should be warm (on_cold="raise")
    └── EngineError              the engine failed a request
        ├── EngineUnreachableError   connection refused / reset: server down or restarting
        └── RequestTimeoutError      no complete answer within the per-request timeout

Why a tree and not flags: callers decide by kind whether to fix their input (``BadInputError``),
retry later (``EngineError`` with ``retryable``), or page someone (``ConfigMismatchError``).
``answer_many`` returns these as values, one per failed question, with ``question_index`` set.
"""

from __future__ import annotations

from prompt_builder import PromptBuildError
from prompt_builder import SpanTooLongError as _BuilderSpanTooLong


class MinipicError(Exception):
    """Base class. ``question_index``: position in an ``answer_many`` batch, when there is one."""

    retryable: bool = False

    def __init__(self, message: str, *, question_index: int | None = None) -> None:
        super().__init__(message)
        self.question_index = question_index


class BadInputError(MinipicError, ValueError):
    """The request cannot be served as given (empty question, no documents, bad option, ...)."""


class SpanTooLongError(BadInputError):
    """A document is longer than the engine's context leaves room for (with budget="error")."""


class ConfigMismatchError(MinipicError):
    """Client and engine disagree on the span configuration; spans would silently never hit."""


class CacheMismatchError(MinipicError):
    """The engine reported fewer cached prompt tokens than the layout promises (a span the
    registry believed warm was evicted or lost). Raised only with ``on_cold="raise"``; the
    default re-warms and resends once.

    ``expected`` and ``cached`` are the two token counts; ``cold_spans`` the span ids found cold.
    """

    def __init__(
        self, message: str, *, expected: int, cached: int, cold_spans: list[str],
        question_index: int | None = None,
    ) -> None:
        super().__init__(message, question_index=question_index)
        self.expected = expected
        self.cached = cached
        self.cold_spans = cold_spans


class EngineError(MinipicError):
    """The engine (in-process or behind HTTP) failed the request. ``retryable``: a later attempt
    may succeed (5xx, connection loss) as opposed to a request the engine rejects."""

    def __init__(
        self, message: str, *, retryable: bool = False, status_code: int | None = None,
        question_index: int | None = None,
    ) -> None:
        super().__init__(message, question_index=question_index)
        self.retryable = retryable
        self.status_code = status_code


class EngineUnreachableError(EngineError):
    """No connection to the engine (refused, reset, dropped mid-stream). Always retryable: a
    restarting server comes back, with an empty cache."""

    def __init__(self, message: str, *, question_index: int | None = None) -> None:
        super().__init__(message, retryable=True, question_index=question_index)


class RequestTimeoutError(EngineError):
    """The request did not finish within the configured timeout (it is aborted, not retried:
    an overloaded engine does not get faster by receiving the same work twice)."""


def from_build_error(exc: PromptBuildError) -> BadInputError:
    """The orchestrator's error for a prompt-builder error (the original stays as __cause__)."""
    kind = SpanTooLongError if isinstance(exc, _BuilderSpanTooLong) else BadInputError
    err = kind(f"{type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err


def with_index(exc: MinipicError, index: int) -> MinipicError:
    """The error tagged with its question's position in a batch.

    One failed span prefill fails every question waiting on it with the same exception object;
    each question gets its own copy so that each reports its own index.
    """
    if exc.question_index in (None, index):
        exc.question_index = index
        return exc
    twin = type(exc).__new__(type(exc), *exc.args)
    twin.__dict__.update(exc.__dict__)
    twin.question_index = index
    twin.__cause__ = exc.__cause__
    return twin.with_traceback(exc.__traceback__)
