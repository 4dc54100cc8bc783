"""Fitting spans into a context window, by a stated policy, with a report of what changed.

Why spans are dropped from the bottom of the ranking: retrieval returns spans best first (or with
scores), and losing the least relevant document costs the least. Why costs are block-padded: in a
span-aware prompt every span starts a block with SSEP and is padded to the next block, so a 33-token
document costs two 32-token blocks; budgeting in raw tokens would overshoot.

Policies (ranks: by ``score``, highest first, when any span has one — unscored spans rank after
scored ones — else the order given):

- ``error``: never shrink; raise ``SpanTooLongError`` / ``PromptTooLongError``.
- ``drop``: keep spans in rank order while they fit; the first that does not, and every span
  ranked below it, are dropped. A kept span is never ranked below a dropped one.
- ``truncate``: as ``drop``, but the first span that does not fit keeps its leading tokens, as
  many as the remaining room allows (at least one), and counts as truncated.
- ``skip``: walk in rank order and keep every span that still fits; a short low-ranked span may
  fill room a long higher-ranked one could not use.

Kept spans stay in the order the caller gave them; only membership changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pydantic import BaseModel

from minipic.prompt_builder.counting import as_token_counter, truncate_text
from minipic.prompt_builder.errors import InvalidInputError, PromptTooLongError, coerce_choice


class BudgetPolicy(StrEnum):
    ERROR = "error"
    DROP = "drop"
    TRUNCATE = "truncate"
    SKIP = "skip"


def coerce_policy(policy: object) -> BudgetPolicy:
    return coerce_choice(BudgetPolicy, policy, "budget policy")


class DroppedSpan(BaseModel):
    index: int  # position in the caller's list
    span_id: str | None
    tokens: int  # its size in tokens (without markers and padding)
    reason: str


class TruncatedSpan(BaseModel):
    index: int
    span_id: str | None  # the original span's id
    new_span_id: str | None  # the truncated span's id (new content, new id)
    original_tokens: int
    kept_tokens: int


class BudgetReport(BaseModel):
    """What the budget did. ``used_tokens + reserved_for_generation <= limit`` always holds."""

    policy: BudgetPolicy
    limit: int  # max_model_len, or the token budget given to fit_texts
    reserved_for_generation: int  # max_tokens
    fixed_tokens: int  # system span + question (and template), which are never shrunk
    used_tokens: int  # final prompt length (fixed + kept spans with markers and padding)
    kept: list[int]  # caller indices of the spans in the prompt (truncated ones included)
    dropped: list[DroppedSpan] = []
    truncated: list[TruncatedSpan] = []

    @property
    def changed(self) -> bool:
        return bool(self.dropped or self.truncated)


def rank_order(count: int, scores: Sequence[float | None] | None) -> list[int]:
    if scores is None or all(s is None for s in scores):
        return list(range(count))
    return sorted(range(count), key=lambda i: (scores[i] is None, -(scores[i] or 0.0), i))


def largest_fitting(cost: Callable[[int], int], size: int, room: int) -> int:
    """Largest ``n <= size`` with ``cost(n) <= room`` (``cost`` non-decreasing, cost(0)=0)."""
    lo, hi = 0, size
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost(mid) <= room:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class Allocation:
    kept: dict[int, int]  # caller index -> tokens kept (== its size unless truncated)
    dropped: tuple[int, ...]
    truncated: tuple[int, ...]
    used: int  # total cost of the kept spans


def allocate(
    sizes: Sequence[int],
    room: int,
    cost: Callable[[int], int],
    policy: BudgetPolicy,
    scores: Sequence[float | None] | None = None,
) -> Allocation:
    """Choose spans (by size in tokens) whose total ``cost`` fits in ``room``, per ``policy``."""
    kept: dict[int, int] = {}
    dropped: list[int] = []
    truncated: list[int] = []
    used = 0
    closed = False  # drop / truncate: once one span missed, everything ranked below is dropped
    for i in rank_order(len(sizes), scores):
        need = cost(sizes[i])
        if not closed and used + need <= room:
            kept[i] = sizes[i]
            used += need
            continue
        if policy is BudgetPolicy.ERROR:
            total = sum(cost(s) for s in sizes)
            raise PromptTooLongError(f"spans need {total} tokens but only {room} are left")
        if policy is BudgetPolicy.TRUNCATE and not closed:
            keep = largest_fitting(cost, sizes[i], room - used)
            if keep >= 1:
                kept[i] = keep
                truncated.append(i)
                used += cost(keep)
            else:
                dropped.append(i)
        else:
            dropped.append(i)
        if policy is not BudgetPolicy.SKIP:
            closed = True
    return Allocation(kept=kept, dropped=tuple(dropped), truncated=tuple(truncated), used=used)


def padded_span_cost(block_size: int) -> Callable[[int], int]:
    """Cost of a span of n tokens laid out as SSEP + tokens + PAD up to the next block."""

    def cost(n: int) -> int:
        return 0 if n <= 0 else -(-(n + 1) // block_size) * block_size

    return cost


class TextSelection(BaseModel):
    """Result of :func:`fit_texts`: the kept texts (in the caller's order) and the report."""

    texts: list[str]
    indices: list[int]
    report: BudgetReport


def fit_texts(
    texts: Sequence[str],
    counter: Any,
    budget_tokens: int,
    *,
    block_size: int | None = None,
    policy: BudgetPolicy | str = BudgetPolicy.DROP,
    scores: Sequence[float | None] | None = None,
    builder: Any = None,
    mode: Any = "block_attention",
) -> TextSelection:
    """Choose (and maybe truncate) texts so their tokens fit ``budget_tokens``.

    ``counter`` is a tiktoken encoding or its name, an HF tokenizer, or any ``TokenCounter``.
    With ``builder`` (a ``PromptBuilder``) each text costs exactly what ``builder.build`` lays
    out for it as a span in ``mode``: its SSEP, the model's sink, its tokens and the pads (and a
    recomputed head's PDEP and pads). With only ``block_size``: SSEP + tokens + padding to a
    block, which is a builder's layout only when it has no sink (``without_sink()``): why
    ``builder`` is the one to pass, or a text accepted here may not fit ``build`` later.
    Otherwise each text costs its token count. Counts from another tokenizer than the model's
    are estimates: leave a margin, or budget exactly with
    ``PromptBuilder.build(max_model_len=...)``.
    """
    tc = as_token_counter(counter)
    policy = coerce_policy(policy)
    if builder is not None:
        from minipic.prompt_builder.modes import make_layout

        config = builder.span_config
        if block_size is not None and block_size != config.block_size:
            raise InvalidInputError(f"block_size={block_size} disagrees with the builder's "
                                    f"{config.block_size}; pass one of them")
        span_cost: Callable[[int], int] | None = make_layout(mode, config).span_cost
    else:
        span_cost = padded_span_cost(block_size) if block_size else None
    if isinstance(budget_tokens, bool) or not isinstance(budget_tokens, int) or budget_tokens < 0:
        raise InvalidInputError(f"budget_tokens must be a non-negative int, got {budget_tokens!r}")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise InvalidInputError(f"text {i} must be a str, got {type(text).__name__}")
    if scores is not None and len(scores) != len(texts):
        raise InvalidInputError(f"{len(scores)} scores for {len(texts)} texts")
    sizes = [len(tc.encode(t)) for t in texts]
    alloc = allocate(sizes, budget_tokens, span_cost or (lambda n: n), policy, scores)
    indices = sorted(alloc.kept)
    out = [
        truncate_text(tc, texts[i], alloc.kept[i]) if i in alloc.truncated else texts[i]
        for i in indices
    ]
    report = BudgetReport(
        policy=policy,
        limit=budget_tokens,
        reserved_for_generation=0,
        fixed_tokens=0,
        used_tokens=alloc.used,
        kept=indices,
        dropped=[
            DroppedSpan(index=i, span_id=None, tokens=sizes[i], reason="no room left")
            for i in alloc.dropped
        ],
        truncated=[
            TruncatedSpan(
                index=i, span_id=None, new_span_id=None,
                original_tokens=sizes[i], kept_tokens=alloc.kept[i],
            )
            for i in alloc.truncated
        ],
    )
    return TextSelection(texts=out, indices=indices, report=report)
