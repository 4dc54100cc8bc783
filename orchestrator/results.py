"""What ``answer`` returns: the text, and the evidence of what the cache did for it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from minipic.prompt_builder import BudgetReport, Mode, SkippedSpan


class SpanStatus(BaseModel):
    """One span of the final prompt (the system span first, then documents in prompt order).

    ``status``: ``warm`` — already in the cache (by the registry) so no prefill was sent for this
    question; ``cold`` — it had to be prefilled (by this question or another in flight that needed
    it too); ``uncached`` — the mode does not cache it separately (``prefix`` documents).
    ``hit``: whether the engine reused it in the final prompt (None: not expected to).
    """

    kind: Literal["system", "span"]
    span_id: str
    index: int | None  # position in the documents list (None: the system span)
    tokens: int
    prefill_key: str | None
    status: Literal["warm", "cold", "uncached"]
    hit: bool | None = None


def fallback_reason(backend: object) -> str | None:
    """``Answer.fallback`` for an answer from ``backend``'s engine."""
    support = getattr(getattr(backend, "info", None), "model_support", None)
    if support is None or support.position_free:
        return None
    return f"answered as the plain prompt: {support.reason}"


class Answer(BaseModel):
    """The answer to one question and what it cost.

    ``ttft_s``: the final prompt's time to first token, from its submission to the engine — the
    latency span caching reduces. ``warm_s``: from the call (for ``answer_many``: the batch's
    start) until the final prompt was sent — span prefills and waiting for a request slot; so
    ``warm_s + ttft_s`` is when this question's first token arrived. ``total_s``: from the call
    to the last token.
    ``cache_ok``: the engine reported at least ``expected_cached_tokens`` cached.
    """

    question: str
    text: str
    token_ids: list[int]
    mode: Mode
    ttft_s: float
    warm_s: float
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    expected_cached_tokens: int
    cache_ok: bool
    spans: list[SpanStatus]
    prefills_sent: int  # span prefills this question started (a shared one counts for its starter)
    attempts: int  # final-prompt submissions (more than 1 after a cold span or a retry)
    finish_reason: str | None = None
    budget: BudgetReport | None = None
    # documents left out because they have no content (empty, whitespace only, or text the
    # tokenizer drops): a retriever's empty hit is noted here instead of failing the question
    skipped_spans: list[SkippedSpan] = []
    # why the documents were answered as the plain prompt (the engine's model is not
    # position-free: span_contract.model_support); None when spans were served
    fallback: str | None = None

    @property
    def cold_spans(self) -> list[str]:
        return [s.span_id for s in self.spans if s.hit is False]
