"""One exception tree for every package of minipic (httpx style: catch the branch you mean).

    MinipicError
    ├── BadInputError (ValueError)       the input or options can never work as given
    │   └── PromptBuildError             a span-aware prompt cannot be built (prompt_builder)
    │       ├── SpanTooLongError         one document alone does not fit the engine's context
    │       └── ...                      InvalidInputError, EmptySpanError, ReservedTokenError, ...
    ├── ConfigMismatchError              client and engine disagree on the span configuration
    ├── CacheMismatchError               spans were cold that should be warm (on_cold="raise")
    ├── EngineError                      the engine failed a request (``retryable`` says if a
    │   │                                later attempt may succeed)
    │   ├── EngineUnreachableError       connection refused / reset: server down or restarting
    │   ├── RequestTimeoutError          no complete answer within the per-request timeout
    │   └── EngineIntegrationError       this vLLM / engine configuration cannot run a minipic
    │                                    feature (engine_ext/vllm_surface/patches.py; start-up
    │                                    refuses)
    └── UnavailableError (RuntimeError)  an offline asset (model, corpus, tokenizer table) is
                                         missing; the message names the command that fixes it

Why a tree and not flags: callers decide by kind whether to fix their input (``BadInputError``),
retry later (``EngineError`` with ``retryable``), or page someone (``ConfigMismatchError``,
``EngineIntegrationError``). ``answer_many`` returns these as values, one per failed question,
with ``question_index`` set. It lives in the contract package because every layer raises it:
the prompt builder, the orchestrator, the engine plugin inside vLLM's processes, the app. The
tree is drawn here only: ``orchestrator.errors`` re-exports it and adds how the SDK hands
prompt-builder errors to its callers (``from_build_error``).
"""

from __future__ import annotations

__all__ = [
    "BadInputError",
    "CacheMismatchError",
    "ConfigMismatchError",
    "EngineError",
    "EngineIntegrationError",
    "EngineUnreachableError",
    "MinipicError",
    "PromptBuildError",
    "RequestTimeoutError",
    "SpanTooLongError",
    "UnavailableError",
]


class MinipicError(Exception):
    """Base class. ``question_index``: position in an ``answer_many`` batch, when there is one."""

    retryable: bool = False

    def __init__(self, message: str = "", *, question_index: int | None = None) -> None:
        super().__init__(message)
        self.question_index = question_index


class BadInputError(MinipicError, ValueError):
    """The request cannot be served as given (empty question, no documents, bad option, ...)."""


class PromptBuildError(BadInputError):
    """Bad input or configuration for a span-aware prompt (base of ``prompt_builder.errors``)."""


class SpanTooLongError(PromptBuildError):
    """One span alone does not fit in ``max_model_len`` (with the fixed parts and max_tokens)."""


class ConfigMismatchError(MinipicError):
    """Client and engine disagree on the span configuration; spans would silently never hit."""


class CacheMismatchError(MinipicError):
    """The engine reported fewer cached prompt tokens than the layout promises (a span the
    registry believed warm was evicted or lost). Raised only with ``on_cold="raise"``; the
    default reports it (the engine computed the cold spans in isolation, the answer is the same).

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
        self, message: str = "", *, retryable: bool = False, status_code: int | None = None,
        question_index: int | None = None,
    ) -> None:
        super().__init__(message, question_index=question_index)
        self.retryable = retryable
        self.status_code = status_code


class EngineUnreachableError(EngineError):
    """No connection to the engine (refused, reset, dropped mid-stream). Always retryable: a
    restarting server comes back, with an empty cache."""

    def __init__(self, message: str = "", *, question_index: int | None = None) -> None:
        super().__init__(message, retryable=True, question_index=question_index)


class RequestTimeoutError(EngineError):
    """The request did not finish within the configured timeout (it is aborted, not retried:
    an overloaded engine does not get faster by receiving the same work twice)."""


class EngineIntegrationError(EngineError, RuntimeError):
    """The installed vLLM, or this engine's configuration, cannot run a minipic feature; the
    engine refuses to start rather than fall back to stock behaviour silently."""


class UnavailableError(MinipicError, RuntimeError):
    """An offline asset (model, corpus, tokenizer table) is not installed; the message says
    which command provides it."""
