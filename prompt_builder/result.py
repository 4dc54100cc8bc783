"""What ``PromptBuilder.build`` returns: the prompt, its prefills, its layout, its cache outlook.

These are the fields the orchestrator relies on: ``prompt_token_ids`` to send,
``span_prefills`` to run first (``prefill_keys`` to de-duplicate them across prompts and to track
warmth), ``segments`` / ``spans`` to know where everything sits, ``expected_cached_tokens`` to
compare with the engine's reported cache hit.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from minipic.span_config import SpanConfig
from prompt_builder.budget import BudgetReport
from prompt_builder.layout import Segment
from prompt_builder.modes import Mode


class SpanInfo(BaseModel):
    """One occurrence of the system span or of a span in the final prompt."""

    model_config = ConfigDict(frozen=True)

    kind: Literal["system", "span"]
    span_id: str  # the user's id, or the content address
    content_id: str  # sha256 of the token ids + SpanConfig (same text -> same id, anywhere)
    index: int | None  # position in the caller's spans list (None for the system span)
    start: int  # first prompt token of the span (its marker, if any)
    end: int  # end of its last token or padding
    token_count: int  # the span's own tokens (no markers, no padding)
    block_count: int  # blocks' worth of prompt it occupies: ceil((end - start) / block_size)
    reused_block_count: int  # of those, blocks the engine can take from cache (holes allowed)
    prefill_index: int | None  # which entry of span_prefills warms it (None: nothing to warm)
    prefill_key: str | None  # content address of that prefill request
    truncated_from: int | None = None  # original token count when the budget shortened it


class BuiltPrompt(BaseModel):
    """A span-aware prompt: the ids to send, the prefills to run first, and the layout."""

    model_config = ConfigDict(frozen=True)

    mode: Mode
    span_config: SpanConfig
    prompt_token_ids: list[int]
    # one request per distinct prefill, in the order to warm them (system first, then spans in
    # prompt order); each is exactly the tokens of its region of prompt_token_ids
    span_prefills: list[list[int]]
    prefill_keys: list[str]  # parallel to span_prefills; stable across prompts
    segments: list[Segment]  # contiguous, covering [0, len(prompt_token_ids))
    spans: list[SpanInfo]  # system span (if any) first, then spans in prompt order
    # prompt tokens stock vLLM finds cached once all span_prefills ran (hit stops at first miss)
    expected_cached_tokens: int
    # prompt tokens in reusable blocks anywhere (a lookup that continued past misses)
    reusable_tokens: int
    budget: BudgetReport | None = None

    @property
    def block_size(self) -> int:
        return self.span_config.block_size

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def segment_token_ids(self, segment: Segment, *, content_only: bool = False) -> list[int]:
        start = segment.content_start if content_only else segment.start
        return self.prompt_token_ids[start : segment.end]
