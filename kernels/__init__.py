"""Attention math for MiniPIC: RoPE applied to cached (unrotated) keys inside attention.

* :func:`rotate` -- RoPE by explicit positions from a model's own ``cos_sin_cache``;
  :func:`rotate_by_offset` moves keys rotated at one position to another (rotations compose),
  :func:`unrotate` gives the position-free key back.
* :func:`paged_attention_rope_ref` -- torch reference over the paged KV cache (also the CPU path).
* :func:`dense_attention_ref` -- independent contiguous formulation, for tests.
* :func:`paged_attention_rope_triton` -- the GPU kernel; imported lazily so that CPU-only users of
  this package never import Triton.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .paged_attention_ref import dense_attention_ref, paged_attention_rope_ref
from .rope import offset_cos_sin_cache, rotate, rotate_by_offset, unrotate

if TYPE_CHECKING:
    from .triton_paged_attention import paged_attention_rope_triton

__all__ = [
    "dense_attention_ref",
    "offset_cos_sin_cache",
    "paged_attention_rope_ref",
    "paged_attention_rope_triton",
    "rotate",
    "rotate_by_offset",
    "unrotate",
]


def __getattr__(name: str) -> Any:
    if name == "paged_attention_rope_triton":
        from .triton_paged_attention import paged_attention_rope_triton

        return paged_attention_rope_triton
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
