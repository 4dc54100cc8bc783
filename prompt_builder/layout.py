"""Where every token of a prompt sits, and what the engine can reuse from its cache.

The engine's block hashing (see DESIGN §2): full blocks are hashed in a chain,
``h_i = H(h_{i-1}, x_i)``; a block whose first token is SSEP restarts it, ``h_i = H(h_0, x_i)``;
a block whose first token is PDEP hashes the whole prompt so far, ``h_i = H(h_0, x_<=i)``. vLLM's
lookup walks blocks from the start, stops at the first miss, and never reuses the block that holds
the last prompt token (at most ``floor((len - 1) / block_size)`` blocks hit).

So a block can come from cache only if some earlier request produced a block with the same hash:

- ``reuse="prefix"``: the prompt's opening (system span) at offset 0 — any request with the same
  opening, e.g. its own prefill, computed and cached those blocks;
- ``reuse="span"``: blocks of a span that starts a block with SSEP — the span's prefill request
  ``[SSEP tokens PAD...]`` hashes them identically wherever the span sits;
- ``reuse="none"``: everything else (PDEP-led blocks, plain text after a span) is computed in the
  final prompt.

A prefill caches *all* its blocks, its last one included: the "last block is never reused" rule
limits lookups, not what a finished request leaves in the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict

SegmentKind = Literal["system", "span", "question", "pad"]
Reuse = Literal["prefix", "span", "none"]
Marker = Literal["ssep", "pdep"]
SpanPart = Literal["whole", "head", "body"]


def blocks_for(n_tokens: int, block_size: int) -> int:
    return -(-n_tokens // block_size)


def padded(n_tokens: int, block_size: int) -> int:
    """Tokens ``n_tokens`` occupy once padded to whole blocks."""
    return blocks_for(n_tokens, block_size) * block_size


class Segment(BaseModel):
    """A run of prompt tokens ``[start, end)`` with one role.

    ``marker`` says the segment's first token is SSEP or PDEP (placed at a block start); the
    segment's content starts ``lead`` tokens in: after the marker and, after an SSEP, the
    model's opening copied as the span's sink (``SpanConfig.sink_ids``). ``pad`` segments hold
    PAD ids only and belong to the span (or system) they follow. ``span_index`` is the span's
    position in the caller's list.
    """

    model_config = ConfigDict(frozen=True)

    kind: SegmentKind
    start: int
    end: int
    reuse: Reuse
    span_id: str | None = None
    span_index: int | None = None
    marker: Marker | None = None
    part: SpanPart | None = None  # for spans: whole span, or head/body in boundary_recompute
    lead: int = 0  # the marker and the sink before the content

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def content_start(self) -> int:
        return self.start + self.lead


class LayoutWriter:
    """Appends token pieces to a prompt, recording a ``Segment`` for each."""

    def __init__(self, block_size: int, ssep_id: int, pdep_id: int, pad_id: int,
                 sink_ids: Sequence[int] = ()) -> None:
        self.block_size = block_size
        self._leads = {"ssep": [ssep_id, *sink_ids], "pdep": [pdep_id]}
        self.pad_id = pad_id
        self.tokens: list[int] = []
        self.segments: list[Segment] = []

    def add(
        self,
        kind: SegmentKind,
        ids: Sequence[int],
        *,
        reuse: Reuse,
        marker: Marker | None = None,
        span_id: str | None = None,
        span_index: int | None = None,
        part: SpanPart | None = None,
    ) -> None:
        head: list[int] = []
        if marker is not None:
            if len(self.tokens) % self.block_size:
                raise AssertionError(f"{marker} placed at {len(self.tokens)}, not a block start")
            head = self._leads[marker]
        if not head and not ids:
            return
        start = len(self.tokens)
        self.tokens.extend(head)
        self.tokens.extend(ids)
        self.segments.append(
            Segment(kind=kind, start=start, end=len(self.tokens), reuse=reuse, marker=marker,
                    span_id=span_id, span_index=span_index, part=part, lead=len(head))
        )

    def pad_to_block(
        self, *, reuse: Reuse, span_id: str | None = None, span_index: int | None = None
    ) -> None:
        missing = -len(self.tokens) % self.block_size
        if missing:
            self.add("pad", [self.pad_id] * missing, reuse=reuse, span_id=span_id,
                     span_index=span_index)


def max_prefix_hit(n_tokens: int, block_size: int) -> int:
    """Most tokens vLLM can take from cache for a prompt: full blocks, never the last token's."""
    return max(n_tokens - 1, 0) // block_size * block_size


def reusable_block_mask(segments: Sequence[Segment], n_tokens: int, block_size: int) -> list[bool]:
    """Per full block (before the last token's block): can the engine take it from cache?

    A block is reusable when none of its tokens is in a ``reuse="none"`` segment. Layouts keep
    reusable runs block-aligned at their start (offset 0, or an SSEP at a block start), so a
    block made only of reusable tokens lies inside one run and hashes as in that run's prefill.
    """
    count = max_prefix_hit(n_tokens, block_size) // block_size
    mask = [True] * count
    for seg in segments:
        if seg.reuse != "none" or seg.end <= seg.start:
            continue
        first, last = seg.start // block_size, (seg.end - 1) // block_size
        for b in range(first, min(last + 1, count)):
            mask[b] = False
    return mask


def expected_cached_tokens(segments: Sequence[Segment], n_tokens: int, block_size: int) -> int:
    """Cache hit of a prefix-only lookup once every prefill ran: consecutive reusable blocks
    (``BuiltPrompt.leading_cached_tokens``; minipic's engine takes ``reusable_tokens``)."""
    hit = 0
    for ok in reusable_block_mask(segments, n_tokens, block_size):
        if not ok:
            break
        hit += block_size
    return hit


def reusable_tokens(segments: Sequence[Segment], n_tokens: int, block_size: int) -> int:
    """All reusable blocks, holes allowed: what a lookup that skips misses could take."""
    return sum(reusable_block_mask(segments, n_tokens, block_size)) * block_size


@dataclass(frozen=True)
class PrefillRegion:
    """Tokens ``[start, end)`` of the final prompt that one prefill request warms."""

    kind: Literal["system", "span"]
    start: int
    end: int
    span_id: str | None
    span_index: int | None


def prefill_regions(segments: Sequence[Segment], block_size: int) -> list[PrefillRegion]:
    """The runs of reusable segments, each warmed by its own prefill request.

    The opening (``reuse="prefix"``, from offset 0) is one region, kept only when it holds at
    least one full block. Each SSEP-led segment starts a new span region that extends over the
    segments of the same span that follow it (its padding).
    """
    regions: list[PrefillRegion] = []
    current: PrefillRegion | None = None
    for seg in segments:
        joins = (
            current is not None
            and seg.marker is None
            and seg.reuse == ("prefix" if current.kind == "system" else "span")
            and seg.start == current.end
            and (current.kind == "system" or seg.span_index == current.span_index)
        )
        if joins:
            current = PrefillRegion(current.kind, current.start, seg.end, current.span_id,
                                    current.span_index)
            continue
        if current is not None:
            regions.append(current)
            current = None
        if seg.reuse == "prefix" and seg.start == 0:
            current = PrefillRegion("system", 0, seg.end, seg.span_id, None)
        elif seg.reuse == "span" and seg.marker == "ssep":
            current = PrefillRegion("span", seg.start, seg.end, seg.span_id, seg.span_index)
    if current is not None:
        regions.append(current)
    return [r for r in regions if r.kind == "span" or r.end >= block_size]
