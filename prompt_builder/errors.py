"""Errors a prompt-builder user can catch by kind.

All derive from ``PromptBuildError``, itself a ``ValueError``: every one of them means "this input
or this configuration cannot make a correct span-aware prompt", never "try again later".
"""

from __future__ import annotations

from minipic.special_tokens import NoSpanTokensError


class PromptBuildError(ValueError):
    """Base class: bad input or configuration for a span-aware prompt."""


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


class EngineMismatchError(PromptBuildError):
    """The engine runs a different SpanConfig: spans would silently stop hitting the cache."""


class ChatTemplateError(PromptBuildError):
    """The chat template cannot be split around the system prompt, spans and question."""


class SpanTooLongError(PromptBuildError):
    """One span alone does not fit in ``max_model_len`` (with the fixed parts and max_tokens)."""


class PromptTooLongError(PromptBuildError):
    """The prompt does not fit in ``max_model_len`` and the budget policy may not shrink it."""
