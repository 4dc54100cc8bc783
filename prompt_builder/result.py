"""What ``PromptBuilder.build`` returns: the prompt, its prefills, its layout, its cache outlook.

These are the fields the orchestrator relies on: ``prompt_token_ids`` to send,
``span_prefills`` to run first (``prefill_keys`` to de-duplicate them across prompts and to track
warmth), ``segments`` / ``spans`` to know where everything sits, ``expected_cached_tokens`` to
compare with the engine's reported cache hit.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from minipic.prompt_builder.budget import BudgetReport
from minipic.prompt_builder.layout import Segment
from minipic.prompt_builder.modes import Mode
from minipic.span_contract.span_config import SpanConfig


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


class SkippedSpan(BaseModel):
    """A span left out of the prompt because it has no content: empty text, whitespace only, or
    text the tokenizer drops entirely (e.g. a lone control character).

    Why skipped and not an error: such spans come from retrievers and tool lists, not from a
    caller's mistake, and a block of SSEP + PAD alone would carry nothing for the model. Failing
    the whole question for it would lose a good answer; dropping it silently would hide that the
    caller's document list was not used as given. So it is left out and named here.
    """

    model_config = ConfigDict(frozen=True)

    index: int  # position in the caller's spans list
    span_id: str | None  # the user's id, when it had one
    reason: Literal["empty", "whitespace only", "no tokens"]


class BuiltPrompt(BaseModel):
    """A span-aware prompt: the ids to send, the prefills to run first, and the layout."""

    model_config = ConfigDict(frozen=True)

    mode: Mode
    mode_spec: str = ""  # the mode as asked for, with its parameter: "selective@0.25"
    span_config: SpanConfig
    prompt_token_ids: list[int]
    # one request per distinct prefill, in the order to warm them (system first, then spans in
    # prompt order); each is exactly the tokens of its region of prompt_token_ids
    span_prefills: list[list[int]]
    prefill_keys: list[str]  # parallel to span_prefills; stable across prompts
    segments: list[Segment]  # contiguous, covering [0, len(prompt_token_ids))
    spans: list[SpanInfo]  # system span (if any) first, then spans in prompt order
    # prompt tokens the minipic engine finds cached once all span_prefills ran: every reusable
    # block, holes allowed (its lookup continues past misses, engine_ext/holes/scheduler_lookup.py)
    expected_cached_tokens: int
    # the same, counted as every reusable block anywhere (equal to expected_cached_tokens)
    reusable_tokens: int
    # what a stock, prefix-only lookup would find (stops at the first miss; engines started
    # without the ``holes`` feature): the baseline the benchmarks compare against
    leading_cached_tokens: int = 0
    budget: BudgetReport | None = None
    skipped_spans: list[SkippedSpan] = []  # spans with no content, left out (see SkippedSpan)

    @property
    def block_size(self) -> int:
        return self.span_config.block_size

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def segment_token_ids(self, segment: Segment, *, content_only: bool = False) -> list[int]:
        start = segment.content_start if content_only else segment.start
        return self.prompt_token_ids[start : segment.end]
