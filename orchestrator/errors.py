"""Errors an orchestrator user catches by kind: minipic's one tree (``span_contract.errors``),
re-exported here with the helpers the scheduler uses.

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

from span_contract.errors import (
    BadInputError,
    CacheMismatchError,
    ConfigMismatchError,
    EngineError,
    EngineIntegrationError,
    EngineUnreachableError,
    MinipicError,
    PromptBuildError,
    RequestTimeoutError,
    SpanTooLongError,
    UnavailableError,
)

__all__ = [
    "BadInputError", "CacheMismatchError", "ConfigMismatchError", "EngineError",
    "EngineIntegrationError", "EngineUnreachableError", "MinipicError", "RequestTimeoutError",
    "SpanTooLongError", "UnavailableError", "from_build_error", "with_index",
]


def from_build_error(exc: PromptBuildError) -> BadInputError:
    """The orchestrator's error for a prompt-builder error (the original stays as __cause__)."""
    kind = SpanTooLongError if isinstance(exc, SpanTooLongError) else BadInputError
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
