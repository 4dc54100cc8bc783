"""Errors a prompt-builder user can catch by kind.

All derive from ``PromptBuildError``, itself a ``ValueError``: every one of them means "this input
or this configuration cannot make a correct span-aware prompt", never "try again later".
"""

from __future__ import annotations

from enum import StrEnum
from typing import TypeVar

from minipic.span_contract.errors import ConfigMismatchError, PromptBuildError, SpanTooLongError
from minipic.span_contract.special_tokens import NoSpanTokensError

__all__ = [
    "BlockSizeError", "ChatTemplateError", "DuplicateSpanIdError", "EmptySpanError",
    "EngineMismatchError", "InvalidInputError", "MissingSpanTokensError", "PromptBuildError",
    "PromptTooLongError", "ReservedTokenError", "SpanTokenError", "SpanTooLongError",
]


class InvalidInputError(PromptBuildError):
    """An argument has the wrong type or an impossible value (the message names which)."""


class EmptySpanError(InvalidInputError):
    """A span has no tokens: it would be a block of SSEP + PAD and nothing else."""


class DuplicateSpanIdError(InvalidInputError):
    """Two spans carry the same user id but different content (a cache registry would mix them)."""


class ReservedTokenError(InvalidInputError):
    """User-supplied ids contain a special token, or text cannot be encoded without one.

    Special ids are placed by the builder only: an SSEP smuggled in through a document would
    restart the engine's hash chain in the middle of that document.
    """


class SpanTokenError(PromptBuildError):
    """The configured SSEP / PDEP / PAD ids cannot be used with this tokenizer."""


class MissingSpanTokensError(SpanTokenError, NoSpanTokensError):
    """No known unused special tokens in the tokenizer and no explicit ids were given."""


class BlockSizeError(PromptBuildError):
    """The block size is not one the engine can run (not positive, not the required multiple)."""


class EngineMismatchError(PromptBuildError, ConfigMismatchError):
    """The engine runs a different SpanConfig: spans would silently stop hitting the cache."""


class ChatTemplateError(PromptBuildError):
    """The chat template cannot be split around the system prompt, spans and question."""


class PromptTooLongError(PromptBuildError):
    """The prompt does not fit in ``max_model_len`` and the budget policy may not shrink it."""


Choice = TypeVar("Choice", bound=StrEnum)


def coerce_choice(choices: type[Choice], value: object, what: str) -> Choice:
    """``value`` as a member of ``choices`` (the member or its string), else an
    ``InvalidInputError`` naming ``what`` and the known values: the one check behind
    ``coerce_mode`` and ``coerce_policy``."""
    try:
        return choices(value)
    except ValueError:
        raise InvalidInputError(
            f"unknown {what} {value!r}; known: {', '.join(c.value for c in choices)}"
        ) from None
