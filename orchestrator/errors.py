"""Errors an orchestrator user catches by kind: minipic's one tree, defined and drawn once in
``span_contract.errors`` and re-exported here, with the two helpers the SDK adds to it.

What the SDK adds is one rule, ``from_build_error``: a prompt-builder error met while laying a
question out (a ``PromptBuildError``: ``InvalidInputError``, ``EmptySpanError``, ...) reaches
the caller as a plain ``BadInputError`` named after it (the original as ``__cause__``); only
``SpanTooLongError`` keeps its kind. So a caller of ``build``, ``answer``, ``answer_many``,
``warm`` or ``stream_answer`` catches ``BadInputError`` and ``SpanTooLongError``
(``PromptBuildError`` itself is not re-exported here). ``answer_many`` returns these errors as
values, one per failed question, each with its own ``question_index`` (``with_index``).
"""

from __future__ import annotations

from minipic.span_contract import errors as _tree
from minipic.span_contract.errors import *  # noqa: F403  (the tree, re-exported: see __all__)
from minipic.span_contract.errors import (
    BadInputError,
    MinipicError,
    PromptBuildError,
    SpanTooLongError,
)

# The tree but PromptBuildError (it reaches SDK callers as BadInputError), and the SDK's helpers
__all__ = [
    *(name for name in _tree.__all__ if name != "PromptBuildError"),
    "from_build_error",
    "with_index",
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
