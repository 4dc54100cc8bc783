"""Prompt layouts: where the system prompt, spans and question go, and which markers lead them.

Notation below: ``S`` = SSEP with the span's sink after it (``SpanConfig.sink_ids``: a copy of the
model's opening that only that span attends to, docs/design.md §2), ``P`` = PDEP, ``_`` = PAD,
``|`` = block boundary, ``sys`` = the system span (BOS / chat-template header + system prompt + the
user-turn header), ``d_i`` = span i's tokens, ``q`` = the question with the template's tail (end of
the user turn and the assistant header). Reuse is stated for the minipic engine (span hashing, a
lookup that continues past misses and computes only the holes, span isolation in attention; never
the last token's block), once every span prefill of the prompt ran.
``BuiltPrompt.expected_cached_tokens`` (= ``reusable_tokens``) is that number;
``BuiltPrompt.leading_cached_tokens`` is what a prefix-only lookup would take (the engine without
its ``holes`` feature).

Attention (the engine's span isolation, docs/design.md §2): an SSEP-led segment attends only
within itself, whichever request computes it; everything else attends to all before it. So the
output of a prompt does not depend on which spans were warm: a span prefill only saves compute.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar

from minipic.prompt_builder.errors import InvalidInputError, coerce_choice
from minipic.prompt_builder.layout import LayoutWriter, padded
from minipic.prompt_builder.spans import PreparedSpan
from minipic.span_contract.span_config import SpanConfig


class Mode(StrEnum):
    BLOCK_ATTENTION = "block_attention"
    PREFIX = "prefix"
    BOUNDARY_RECOMPUTE = "boundary_recompute"
    SELECTIVE = "selective"


DEFAULT_SELECTIVE_SHARE = 0.25


@dataclass(frozen=True)
class ModeSpec:
    """A mode with its parameter, as users write it: ``block_attention``,
    ``boundary_recompute@40`` (head length in tokens), ``selective@0.15`` (the share of each
    span's own tokens recomputed in context, from its start)."""

    mode: Mode
    recompute_tokens: int | None = None  # boundary_recompute
    share: float | None = None  # selective

    def __str__(self) -> str:
        if self.recompute_tokens is not None:
            return f"{self.mode.value}@{self.recompute_tokens}"
        if self.share is not None:
            return f"{self.mode.value}@{self.share:g}"
        return self.mode.value


def parse_mode(value: object) -> ModeSpec:
    """``Mode``, ``ModeSpec`` or its text form, else an ``InvalidInputError`` that says what
    is accepted."""
    if isinstance(value, ModeSpec):
        return value
    if isinstance(value, Mode):
        return _spec(value, None)
    if not isinstance(value, str):
        raise InvalidInputError(f"mode must be a string such as 'block_attention' or "
                                f"'selective@0.15', got {type(value).__name__}")
    name, sep, param = value.partition("@")
    mode = coerce_choice(Mode, name, "mode")
    if sep and not param:
        raise InvalidInputError(f"mode {value!r}: nothing after '@'")
    return _spec(mode, param if sep else None)


def _spec(mode: Mode, param: str | None) -> ModeSpec:
    if mode is Mode.SELECTIVE:
        if param is None:
            return ModeSpec(mode, share=DEFAULT_SELECTIVE_SHARE)
        try:
            share = float(param)
        except ValueError:
            share = math.nan
        if not 0.0 <= share <= 1.0:
            raise InvalidInputError(f"selective@{param}: the budget is the share of each span's "
                                    f"tokens recomputed, a number from 0 to 1 (e.g. "
                                    f"selective@0.15)")
        return ModeSpec(mode, share=share)
    if mode is Mode.BOUNDARY_RECOMPUTE:
        if param is None:
            return ModeSpec(mode)
        if not param.isdigit() or int(param) < 1:
            raise InvalidInputError(f"boundary_recompute@{param}: the head length is a whole "
                                    f"number of tokens >= 1 (e.g. boundary_recompute@40)")
        return ModeSpec(mode, recompute_tokens=int(param))
    if param is not None:
        raise InvalidInputError(f"{mode.value}@{param}: only boundary_recompute@TOKENS and "
                                f"selective@SHARE take a parameter")
    return ModeSpec(mode)


def coerce_mode(mode: object) -> Mode:
    """The ``Mode`` of a mode or its text form (``selective@0.15`` -> ``Mode.SELECTIVE``)."""
    return parse_mode(mode).mode


@dataclass(frozen=True)
class PromptParts:
    """Everything a layout needs, already encoded."""

    system: Sequence[int]  # may be empty (no template, no system prompt, no BOS)
    system_id: str | None
    spans: Sequence[PreparedSpan]
    question: Sequence[int]  # template text before the question + question + template tail


class Layout(ABC):
    """One mode's token layout: how to write a prompt and what each piece costs."""

    mode: ClassVar[Mode]

    def __init__(self, config: SpanConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        # tokens before an SSEP-led segment's content: the SSEP and the span's sink
        self.span_lead = 1 + len(config.sink_ids)

    def writer(self) -> LayoutWriter:
        c = self.config
        return LayoutWriter(c.block_size, c.ssep_id, c.pdep_id, c.pad_id, c.sink_ids)

    @abstractmethod
    def system_cost(self, n: int) -> int: ...

    @abstractmethod
    def span_cost(self, n: int) -> int: ...

    @abstractmethod
    def question_cost(self, n: int) -> int: ...

    @abstractmethod
    def write(self, out: LayoutWriter, parts: PromptParts) -> None: ...

    # shared by the span-aware layouts
    def _write_system(self, out: LayoutWriter, parts: PromptParts) -> None:
        out.add("system", parts.system, reuse="prefix", span_id=parts.system_id)
        out.pad_to_block(reuse="prefix", span_id=parts.system_id)

    def _write_question(self, out: LayoutWriter, parts: PromptParts) -> None:
        out.add("question", parts.question, reuse="none", marker="pdep")


class BlockAttentionLayout(Layout):
    """Pure span reuse (Block-Attention / Prompt-Cache style).

    Layout::

        |sys _ _|S d1 ... _|S d2 ... _ _|P q ...|

    The system span starts at 0 and is padded; each span starts a block with SSEP and is padded
    to a block end; the question starts a block with PDEP. Span prefill i is ``[S d_i _...]``,
    exactly the tokens of span i in the final prompt.

    Reused: every block before the question — the system blocks by ordinary prefix hashing, each
    span's blocks because SSEP restarts the hash chain, so they hash as in the span's prefill
    whatever precedes them. ``expected_cached_tokens`` = the question's offset. Recomputed: the
    PDEP-led question blocks (their hash covers the whole prompt; they hit only when the same
    prompt was seen before), which attend to all spans at their new positions. Each span's KV was
    computed alone, so span tokens never attended to other spans: exact for Block-Attention-
    trained models, an approximation for others.
    """

    mode = Mode.BLOCK_ATTENTION

    def system_cost(self, n: int) -> int:
        return padded(n, self.block_size)

    def span_cost(self, n: int) -> int:
        return padded(n + self.span_lead, self.block_size) if n > 0 else 0

    def question_cost(self, n: int) -> int:
        return n + 1

    def write(self, out: LayoutWriter, parts: PromptParts) -> None:
        self._write_system(out, parts)
        for span in parts.spans:
            out.add("span", span.token_ids, reuse="span", marker="ssep", span_id=span.span_id,
                    span_index=span.index, part="whole")
            out.pad_to_block(reuse="span", span_id=span.span_id, span_index=span.index)
        self._write_question(out, parts)


class PrefixLayout(Layout):
    """The baseline: no position-independent caching, no special tokens.

    Layout::

        |sys d1 d2 ... q|   (plain concatenation, no markers, no padding)

    The engine's hasher sees no marker, so it behaves exactly like stock vLLM prefix caching.
    The only prefill is the system span alone, ``[sys]``. Reused: the full blocks inside the
    system span, ``floor(len(sys) / block_size)`` blocks (capped by the last-token rule).
    Recomputed: everything from the block holding the end of the system span. (Repeating an
    identical document sequence would also hit by plain prefix caching; that is not counted.)
    The segments still report where the system prompt, each span and the question are.
    """

    mode = Mode.PREFIX

    def system_cost(self, n: int) -> int:
        return n

    def span_cost(self, n: int) -> int:
        return n

    def question_cost(self, n: int) -> int:
        return n

    def write(self, out: LayoutWriter, parts: PromptParts) -> None:
        out.add("system", parts.system, reuse="prefix", span_id=parts.system_id)
        for span in parts.spans:
            out.add("span", span.token_ids, reuse="none", span_id=span.span_id,
                    span_index=span.index, part="whole")
        out.add("question", parts.question, reuse="none")


class BoundaryRecomputeLayout(Layout):
    """Span reuse with each span's opening recomputed in context (MEPIC / EPIC style).

    With ``k = recompute_tokens`` (default ``block_size - 1``: the opening fills one block)::

        |sys _|P d1[:k] _|S d1 ... _|P d2[:k] _|S d2 ... _|P q ...|
               ^ head: recomputed ^ the whole span: reused

    Why this layout: the head must be computed in the final prompt, so its hash must depend on
    what precedes it — a PDEP-led block. The span after it is the whole document, laid out as
    ``block_attention`` lays it out: it hashes as its prefill ``[S d_i _...]`` (the same prefill,
    and the same cached KV, as every other mode's), and its later tokens keep the KV they had
    there, computed over their own opening. The engine hides the span's copy of its head
    (docs/design.md §2): the head computed in context holds those positions and is what every
    other query sees, so the question reads each opening once, in context, and each body as
    cached. Why not a body-only span ``[S d_i[k:]]``, as before: its tokens then never saw
    their opening, and measured in transformers that costs more than the recompute buys
    (results/span_selection). ``k < block_size - 1`` recomputes only the first ``k`` tokens
    (EPIC), padding the rest of the head block; ``k >= block_size`` recomputes several blocks.
    A span with at most ``k`` tokens is all head: recomputed, no prefill.

    Reused: the system span and every whole span (they hash like their prefills, and the
    engine's lookup continues past the PDEP-led heads, computing only the holes):
    ``expected_cached_tokens`` = system + spans. Recomputed, in context: each head (attending to
    everything shown before it) and the question. A prefix-only lookup would stop at the first
    head (``leading_cached_tokens`` = the system span).
    """

    mode = Mode.BOUNDARY_RECOMPUTE

    def __init__(self, config: SpanConfig, recompute_tokens: int | None = None) -> None:
        super().__init__(config)
        k = config.block_size - 1 if recompute_tokens is None else recompute_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise InvalidInputError(f"recompute_tokens must be an int >= 1, got {k!r}")
        self.recompute_tokens = k

    def system_cost(self, n: int) -> int:
        return padded(n, self.block_size)

    def head_tokens(self, n: int) -> int:
        """How many of a span's ``n`` tokens are recomputed in context (0: none, the span is
        written whole, as in block_attention)."""
        return min(n, self.recompute_tokens)

    def span_cost(self, n: int) -> int:
        if n <= 0:
            return 0
        head = self.head_tokens(n)
        if head == 0:
            return padded(n + self.span_lead, self.block_size)
        cost = padded(head + 1, self.block_size)
        return cost + padded(n + self.span_lead, self.block_size) if head < n else cost

    def question_cost(self, n: int) -> int:
        return n + 1

    def write(self, out: LayoutWriter, parts: PromptParts) -> None:
        self._write_system(out, parts)
        for span in parts.spans:
            k = self.head_tokens(len(span.token_ids))
            if k == 0:
                out.add("span", span.token_ids, reuse="span", marker="ssep",
                        span_id=span.span_id, span_index=span.index, part="whole")
                out.pad_to_block(reuse="span", span_id=span.span_id, span_index=span.index)
                continue
            out.add("span", span.token_ids[:k], reuse="none", marker="pdep",
                    span_id=span.span_id, span_index=span.index, part="head")
            out.pad_to_block(reuse="none", span_id=span.span_id, span_index=span.index)
            if k < len(span.token_ids):  # the whole span, its head's copy hidden
                out.add("span", span.token_ids, reuse="span", marker="ssep",
                        span_id=span.span_id, span_index=span.index, part="whole")
                out.pad_to_block(reuse="span", span_id=span.span_id, span_index=span.index)
        self._write_question(out, parts)


class SelectiveLayout(BoundaryRecomputeLayout):
    """Budgeted recompute: a share ``B`` of each span's tokens recomputed in context, from its
    start (``selective@B``).

    A span of ``n`` tokens gets a head of ``k = round(B * n)`` of them (half up), recomputed in
    context, PDEP-led, before the whole span, reused (the boundary_recompute layout, with the
    head sized per span)::

        |sys _|P d1[:k1] _|S d1 ... _|S d2 ... _|P q ...|     (span 2 got k2 = 0)

    ``selective@0`` is block_attention's layout, token for token; ``selective@1`` recomputes
    every span in context (no span prefill).

    Why a share of the span's own tokens, not of its blocks: the budget must mean what it says.
    Counted in blocks of the span's block_attention layout, the share also counted the span's
    lead (its SSEP and the model's sink, 25 tokens for SmolLM2), which the head does not carry:
    at ``B = 0.25`` a span of 38 tokens was recomputed whole and one of 150 tokens at 42%, so a
    mode compared "with and without the sink" compared different budgets.

    Why the opening of each span and not blocks chosen per question: measured at equal budgets
    on today's layout (``results/span_selection/``, docs/design.md §8), heads beat random blocks
    by 0.12-0.16 KL, and tails, related spans and the KV deviation (CacheBlend-like) at B = 0.1
    and 0.25; only at B = 0.5 does the deviation win, and it needs a first layer computed in
    context per question. A question-independent choice also leaves the span's prefill as it
    is, one per document: the head depends only on the span's length and ``B``.
    """

    mode = Mode.SELECTIVE

    def __init__(self, config: SpanConfig, share: float) -> None:
        super().__init__(config, None)
        if isinstance(share, bool) or not 0.0 <= share <= 1.0:
            raise InvalidInputError(f"selective share must be in [0, 1], got {share!r}")
        self.share = share

    def head_tokens(self, n: int) -> int:
        return min(n, math.floor(self.share * n + 0.5))


def make_layout(mode: Mode | ModeSpec, config: SpanConfig,
                recompute_tokens: int | None = None) -> Layout:
    spec = parse_mode(mode)
    if recompute_tokens is not None:
        if spec.recompute_tokens is not None and spec.recompute_tokens != recompute_tokens:
            raise InvalidInputError(f"mode {spec} and recompute_tokens={recompute_tokens} "
                                    f"disagree")
        spec = ModeSpec(spec.mode, recompute_tokens=recompute_tokens, share=spec.share)
    mode = spec.mode
    if mode is Mode.SELECTIVE:
        if spec.recompute_tokens is not None:
            raise InvalidInputError("recompute_tokens applies to boundary_recompute; selective "
                                    "takes a share: selective@0.15")
        return SelectiveLayout(config, spec.share)
    if mode is Mode.BOUNDARY_RECOMPUTE:
        return BoundaryRecomputeLayout(config, spec.recompute_tokens)
    if spec.recompute_tokens is not None:
        raise InvalidInputError(f"recompute_tokens applies to boundary_recompute, not {mode}")
    if mode is Mode.BLOCK_ATTENTION:
        return BlockAttentionLayout(config)
    return PrefixLayout(config)
