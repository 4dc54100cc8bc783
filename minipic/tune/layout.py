"""The student's view of a prompt: the SDK's span layout as an attention mask, in transformers.

docs/design.md §2 defines what a span layout means, and this module is its executable form:

* **block attention**: a span's tokens, from its SSEP to the end of its padding, attend only
  within their span; every other token attends causally to everything before it;
* **rule 1, the layout is invisible**: the layout tokens (SSEP, PDEP, PAD) steer block hashing
  and segments, never attention. No query attends them but their own (a layout token sees only
  itself), and they take no RoPE position: a real token sits at the number of real tokens before
  it, the position it has in the plain prompt (up to one constant shift per request);
* **the sink**: a span that starts with the model's opening right after its SSEP (the SDK
  copies it there, ``SpanConfig.sink_ids``) sinks into that copy, as the plain prompt's tokens
  sink into its opening. Only the span's own tokens see it, at the positions just before the
  span's first real token (where the span would follow the opening); it is no token of the
  plain prompt, so the positions of real tokens do not count it. The constant shift is the
  sink's length in a prompt that holds one (so no sink position is negative), else 0.

That is what the engine computes for a warm final prompt, so it is what the student is trained
under and what the tests check the engine against (``tests/support/pic_reference.py`` imports
:func:`layout_view`). With every token computed in context, rule 1 makes a span layout equal the
plain prompt, which is why markers may cost hashing bytes but never fidelity.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch


def isolated_runs(built: Any) -> list[tuple[int, int, str]]:
    """``(start, end, part)`` of each span part (head / body / whole) of a ``PromptBuilder``
    build, the padding after it included (it is isolated with it)."""
    runs: list[list] = []
    for seg in built.segments:
        part = getattr(seg, "part", None)
        if seg.kind == "span" and part in ("head", "body", "whole"):
            runs.append([seg.start, seg.end, part])
        elif seg.kind == "pad" and runs and runs[-1][1] == seg.start:
            runs[-1][1] = seg.end
    return [(a, b, p) for a, b, p in runs]


def block_attention_allowed(length: int, spans: Sequence[tuple[int, ...]]) -> torch.Tensor:
    """``allowed[q, k]``: causal, except that a span's tokens see only their own span.

    ``spans`` holds ``(start, end, ...)``: anything after the first two fields is ignored, so
    ``isolated_runs`` output goes in as is."""
    allowed = torch.ones(length, length, dtype=torch.bool).tril()
    for start, end, *_ in spans:
        allowed[start:end, :start] = False
    return allowed


def layout_flags(token_ids: Sequence[int], layout_ids: Collection[int]) -> torch.Tensor:
    """Bool ``[len]``: which tokens are layout (SSEP, PDEP, PAD). The SDK never produces those
    ids from user text (``prompt_builder/encoding.py``), so the ids alone say it."""
    ids = torch.tensor(list(token_ids), dtype=torch.long)
    return torch.isin(ids, torch.tensor(sorted(layout_ids), dtype=torch.long))


def logical_positions(layout: torch.Tensor) -> torch.Tensor:
    """RoPE position of every token under rule 1: the number of real tokens before it (a layout
    token gets the position of the real token after it; it attends only itself, so its own
    position changes nothing)."""
    real = (~layout).long()
    return torch.cumsum(real, 0) - real


def sink_index(token_ids: Sequence[int], spans: Sequence[tuple[int, ...]],
               sink_ids: Sequence[int]) -> torch.Tensor:
    """int64 ``[len]``: each token's index within its span's sink, -1 outside any sink. A
    span's sink is ``sink_ids`` right after its first token (its SSEP), when there."""
    out = torch.full((len(token_ids),), -1, dtype=torch.long)
    size = len(sink_ids)
    if size:
        for start, end, *_ in spans:
            if end - start > size and list(token_ids[start + 1: start + 1 + size]) == list(
                    sink_ids):
                out[start + 1: start + 1 + size] = torch.arange(size)
    return out


def layout_view(token_ids: Sequence[int], spans: Sequence[tuple[int, ...]],
                layout_ids: Collection[int], sink_ids: Sequence[int] = ()
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(allowed [len, len], positions [len])`` of a span-opted-in prompt under block
    attention, rule 1 and each span's sink (``sink_ids``, ``()``: none). ``layout_ids=()``
    gives block attention at physical positions (the layout as the model saw it before rule
    1; a sink is then ordinary span content)."""
    length = len(token_ids)
    allowed = block_attention_allowed(length, spans)
    if not layout_ids:
        return allowed, torch.arange(length)
    layout = layout_flags(token_ids, layout_ids)
    in_sink = sink_index(token_ids, spans, sink_ids)
    sink = in_sink >= 0
    in_span = torch.zeros(length, dtype=torch.bool)
    for start, end, *_ in spans:
        in_span[start:end] = True
    allowed &= ~layout.unsqueeze(0)
    allowed &= ~(sink.unsqueeze(0) & ~in_span.unsqueeze(1))  # a sink: its span's rows only
    allowed[layout] = False
    allowed |= torch.eye(length, dtype=torch.bool)
    before = logical_positions(layout | sink)
    shift = len(sink_ids) if bool(sink.any()) else 0
    return allowed, torch.where(sink, before + in_sink, before + shift)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[1, 1, q, k]`` additive mask for a transformers model: 0 where allowed, the dtype's
    minimum elsewhere (transformers takes a 4-D float mask as given)."""
    mask = torch.zeros(1, 1, *allowed.shape, dtype=dtype)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)
