"""The student's view of a prompt: the SDK's span layout as an attention mask, in transformers.

docs/design.md §2 defines what a span layout means: a span's tokens, from its SSEP to the end of
its padding, attend only within their span; every other token attends causally to everything
before it; positions are the global ones. That is what the engine computes for a warm final
prompt, so it is what the student is trained under and what the tests check the engine against
(``tests/support/pic_reference.py`` imports these two functions).
"""

from __future__ import annotations

from collections.abc import Sequence
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


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[1, 1, q, k]`` additive mask for a transformers model: 0 where allowed, the dtype's
    minimum elsewhere (transformers takes a 4-D float mask as given)."""
    mask = torch.zeros(1, 1, *allowed.shape, dtype=dtype)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)
