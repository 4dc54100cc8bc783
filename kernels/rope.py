"""RoPE applied from a model's own cos/sin cache, by explicit positions.

MiniPIC keeps keys *unrotated* in the paged KV cache and rotates each key by its logical position
in the current request only when attention reads it (docs/design.md §1). For that rotation to
equal what the model would have done to the key, it must use exactly the model's rotary variant:
the neox ("rotate halves") or gptj ("rotate even/odd pairs") layout, partial rotary, and whatever
frequency scaling (llama3, linear, yarn, ...) went into the frequencies. We therefore never
re-derive frequencies here: every function takes vLLM's ``cos_sin_cache`` buffer, shape
``[max_position, rotary_dim]``, holding ``cat(cos, sin)`` along the last dimension (see
``vllm/model_executor/layers/rotary_embedding/base.py``). Any scaling variant that only changes
this table (default, llama3, linear, dynamic-ntk, yarn, ...) is then handled for free.

The arithmetic mirrors ``ApplyRotaryEmb.forward_static`` in vLLM:

* neox: ``x1, x2 = x[:rot/2], x[rot/2:rot]``; ``out = cat(x1*cos - x2*sin, x2*cos + x1*sin)``;
* gptj: ``x1, x2 = x[0:rot:2], x[1:rot:2]``; the two results are interleaved back;
* dims ``>= rotary_dim`` pass through unchanged.
"""

from __future__ import annotations

import torch

__all__ = [
    "offset_cos_sin_cache", "rotate", "rotate_by_offset", "split_cos_sin", "table_scale",
    "unrotate",
]


def split_cos_sin(
    cos_sin_cache: torch.Tensor, positions: torch.Tensor, rotary_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather ``(cos, sin)`` rows, each ``[len(positions), rotary_dim // 2]`` in fp32.

    Kept separate so that callers rotating many tensors at the same positions (e.g. a request's
    keys in every layer) can see exactly which table entries are used.
    """
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[-1] != rotary_dim:
        raise ValueError(
            f"cos_sin_cache must be [max_position, rotary_dim={rotary_dim}] (cat(cos, sin)), "
            f"got {tuple(cos_sin_cache.shape)}"
        )
    cos_sin = cos_sin_cache.index_select(0, positions.flatten().to(torch.long)).float()
    cos, sin = cos_sin.chunk(2, dim=-1)
    return cos, sin


def rotate(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rotary_dim: int,
    is_neox: bool,
) -> torch.Tensor:
    """Return ``x`` rotated by RoPE at ``positions``, out of place, in ``x.dtype``.

    Args:
        x: ``[num_tokens, num_heads, head_size]``; any float dtype.
        positions: ``[num_tokens]`` integer positions (row indices into ``cos_sin_cache``).
        cos_sin_cache: the model's rotary buffer ``[max_position, rotary_dim]`` = cat(cos, sin).
        rotary_dim: number of leading dims of each head that are rotated (even, <= head_size).
        is_neox: True for the neox (halves) layout, False for gptj (interleaved pairs).

    The rotation is computed in fp32 and cast back once, so bf16/fp16 keys lose no more
    precision than the single final rounding (vLLM's own native path rounds cos/sin and the
    products to the activation dtype; the difference is within one bf16 ulp).
    """
    if x.dim() != 3:
        raise ValueError(f"x must be [num_tokens, num_heads, head_size], got {tuple(x.shape)}")
    head_size = x.shape[-1]
    if rotary_dim % 2 != 0 or not 0 < rotary_dim <= head_size:
        raise ValueError(f"rotary_dim={rotary_dim} must be even and in (0, {head_size}]")
    if positions.numel() != x.shape[0]:
        raise ValueError(f"{positions.numel()} positions for {x.shape[0]} tokens")

    cos, sin = split_cos_sin(cos_sin_cache, positions, rotary_dim)
    return _apply(x.float(), cos, sin, rotary_dim, is_neox).to(x.dtype)


def table_scale(cos_sin_cache: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """The scale a table folds into its cos/sin (YaRN's ``mscale``; 1 for most variants).

    Row 0 of the table is ``cos(0) * scale = scale`` for every frequency, so the scale is read
    from the table itself rather than from the variant's parameters: ``[rotary_dim // 2]`` fp32.
    """
    cos0, _ = split_cos_sin(cos_sin_cache, torch.zeros(1, dtype=torch.long), rotary_dim)
    return cos0[0]


def rotate_by_offset(
    x: torch.Tensor,
    offsets: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rotary_dim: int,
    is_neox: bool,
) -> torch.Tensor:
    """Move already-rotated keys by ``offsets`` positions: ``R(p) k`` -> ``R(p + offset) k``.

    RoPE rotations compose (``R(a) R(b) = R(a + b)``), so a key cached rotated at its home
    position reaches any other position by one more rotation, by the difference. The table's
    rows are ``scale * (cos, sin)``; the key already carries ``scale`` once, so the extra
    rotation divides it out (``table_scale``) rather than applying it twice. A negative offset
    is the inverse rotation: ``cos`` of ``|offset|`` with ``sin`` negated. Same shapes and
    precision as :func:`rotate` (fp32 arithmetic, one final rounding).
    """
    if x.dim() != 3 or offsets.numel() != x.shape[0]:
        raise ValueError(f"x must be [num_tokens, num_heads, head_size] with one offset per "
                         f"token; got {tuple(x.shape)} and {offsets.numel()} offsets")
    cos, sin = _offset_cos_sin(cos_sin_cache, offsets.flatten().to(torch.long), rotary_dim)
    return _apply(x.float(), cos, sin, rotary_dim, is_neox).to(x.dtype)


def offset_cos_sin_cache(cos_sin_cache: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """A table in the model's format whose row ``offset + max_position - 1`` rotates by
    ``offset`` (any sign), the model's scale divided out: :func:`rotate_by_offset` as a table.

    For the model's own (C++) rotary op, which rotates by table rows: a key cached rotated at
    home is moved by one call of that op with this table and ``offset + max_position - 1`` as
    positions. ``[2 * max_position - 1, rotary_dim]`` fp32; cast it to the keys' dtype.
    """
    max_position = cos_sin_cache.shape[0]
    offsets = torch.arange(-(max_position - 1), max_position)
    return torch.cat(_offset_cos_sin(cos_sin_cache, offsets, rotary_dim), dim=-1)


def _offset_cos_sin(cos_sin_cache: torch.Tensor, offsets: torch.Tensor,
                    rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of rotations by ``offsets`` (int64, any sign), the table's scale divided
    out: rows of ``|offset|`` with ``sin`` negated for a negative one (the inverse rotation).
    The convention of :func:`rotate_by_offset` and :func:`offset_cos_sin_cache` alike."""
    cos, sin = split_cos_sin(cos_sin_cache, offsets.abs(), rotary_dim)
    scale = table_scale(cos_sin_cache, rotary_dim)
    sign = torch.where(offsets < 0, -1.0, 1.0).unsqueeze(1)
    return cos / scale, sign * sin / scale


def unrotate(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rotary_dim: int,
    is_neox: bool,
) -> torch.Tensor:
    """The position-free key ``k~`` back from ``x = rotate(k~, positions)``.

    The inverse rotation, and the table's scale divided out of the rotated dims: what an
    export of position-free keys (the torch reference path, a span store) reads from keys the
    cache holds rotated at their home positions.
    """
    moved = rotate_by_offset(x.float(), -positions.flatten().to(torch.long), cos_sin_cache,
                             rotary_dim, is_neox)
    scale = table_scale(cos_sin_cache, rotary_dim)
    per_dim = scale.repeat(2) if is_neox else scale.repeat_interleave(2)
    out = torch.cat((moved[..., :rotary_dim] / per_dim, moved[..., rotary_dim:]), dim=-1)
    return out.to(x.dtype)


def _apply(xf: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
           is_neox: bool) -> torch.Tensor:
    """``xf`` ([tokens, heads, D], fp32) rotated by per-token ``cos``/``sin`` [tokens, rot/2]."""
    head_size = xf.shape[-1]
    cos = cos.unsqueeze(1)  # [tokens, 1, rot/2]: broadcast over heads
    sin = sin.unsqueeze(1)
    x_rot = xf[..., :rotary_dim]
    if is_neox:
        x1, x2 = x_rot.chunk(2, dim=-1)
    else:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox:
        rotated = torch.cat((o1, o2), dim=-1)
    else:
        rotated = torch.stack((o1, o2), dim=-1).flatten(-2)
    if rotary_dim < head_size:
        rotated = torch.cat((rotated, xf[..., rotary_dim:]), dim=-1)
    return rotated
