"""Span-aware prompts: system prompt + documents + question as block-aligned token ids.

Start with ``PromptBuilder.from_pretrained(model_dir)`` and ``builder.build(...)``; the layouts
of the modes are documented in ``prompt_builder.modes``.
"""

from minipic.prompt_builder import errors
from minipic.prompt_builder.budget import (
    BudgetPolicy,
    BudgetReport,
    DroppedSpan,
    TextSelection,
    TruncatedSpan,
    fit_texts,
)
from minipic.prompt_builder.builder import PromptBuilder
from minipic.prompt_builder.counting import (
    HFTokenCounter,
    TiktokenCounter,
    TokenCounter,
    as_token_counter,
    count_tokens,
)
from minipic.prompt_builder.errors import *  # noqa: F403  (the errors users catch: errors.__all__)
from minipic.prompt_builder.layout import Segment
from minipic.prompt_builder.modes import Mode, ModeSpec, parse_mode
from minipic.prompt_builder.result import BuiltPrompt, SkippedSpan, SpanInfo
from minipic.prompt_builder.spans import PreparedSpan, Span, content_id
from minipic.span_contract.span_config import SpanConfig

__all__ = [
    "BudgetPolicy",
    "BudgetReport",
    "BuiltPrompt",
    "DroppedSpan",
    "HFTokenCounter",
    "Mode",
    "ModeSpec",
    "PreparedSpan",
    "PromptBuilder",
    "Segment",
    "SkippedSpan",
    "Span",
    "SpanConfig",
    "SpanInfo",
    "TextSelection",
    "TiktokenCounter",
    "TokenCounter",
    "TruncatedSpan",
    "as_token_counter",
    "content_id",
    "count_tokens",
    "fit_texts",
    "parse_mode",
    *errors.__all__,
]
