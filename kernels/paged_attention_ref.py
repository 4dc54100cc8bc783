"""Torch reference for paged attention with RoPE applied to keys inside attention.

This is the definition of what MiniPIC's attention computes (docs/design.md §1)::

    score(t, j) = (R_t q_t)^T (R_j k~_j) * scale

where ``k~_j`` is the *unrotated* key stored in the paged cache and ``j`` is the key's logical
position in the current request, i.e. its index in the request's token sequence: block-table
slot ``j // block_size``, offset ``j % block_size``. The physical block id plays no part, which is
why one physical block can serve two requests at two different offsets with no copy.

Queries arrive already rotated by the model (at their own positions), so only keys are rotated
here. Query ``t`` of request ``i`` sits at index ``seq_len_i - query_len_i + t`` and, when
causal, attends to keys ``0 ..= that index`` (prefill with existing context and decode are
the same formula).

**Layout keys (docs/design.md rule 1).** A prompt laid out for reuse carries tokens the model is
not meant to read: span markers (SSEP / PDEP) and the PADs that align spans to KV blocks. They
steer block hashing and span segments, and must not steer the answer. With ``key_positions``
(``[num_reqs, W]``, entry ``[i, j]`` for key ``j`` of request ``i``) the caller gives each key a
*logical* RoPE position, and marks layout keys with a negative entry:

* key ``j`` is rotated at ``key_positions[i, j]`` (a layout key's negative entry is clamped to
  row 0 of the table: that key is only ever read by its own query, where it is the single
  visible key and gets probability 1 whatever its score);
* a layout key is invisible to every query but the one at its own index, and that (layout)
  query sees only itself: its output is its own value vector.

A real query therefore sees exactly the real keys it would see without the layout tokens, at
the positions they would have had: attention equals attention over the compacted sequence
(layout keys removed, real keys at ``0 .. n_real - 1``). The causal mask and ``key_start`` stay in
*index* space (the key's index ``j`` in the request, not its logical position). Without
``key_positions`` key ``j`` is rotated at ``j`` and every key is visible (stock behaviour).

**Sink keys (docs/design.md §2).** Each span carries, right after its SSEP, a private copy of the
model's opening (the "sink", e.g. the chat template head): a span computed alone then sees the
opening the model always had, without the other spans or the prompt reading it. ``key_sink``
(``[num_reqs, W]`` bool, like ``key_positions``) marks those keys and ``query_isolated``
(``[num_tokens]`` bool, per query row) the queries allowed to read them (rows inside their own
span, which ``key_start`` keeps there):

* a sink key is rotated at its ``key_positions`` entry (``>= 0``, like a real key);
* it is visible to query ``t`` (within the causal range and ``key_start`` as usual) only when
  ``query_isolated[t]``, and always to the query at its own index, which is an ordinary query.

A non-isolated query therefore attends exactly as if the sink keys were not there. A
``key_sink`` entry on a layout key (negative position) changes nothing: it stays a layout key.

Two formulations live here on purpose:

* :func:`paged_attention_rope_ref` reads the paged layout the engine uses. It is the CPU
  attention path of the MiniPIC vLLM backend (called per layer per step), so it is vectorised
  per request and chunks long prefills to bound memory.
* :func:`dense_attention_ref` takes contiguous per-request keys/values and uses
  ``torch.nn.functional.scaled_dot_product_attention``; it shares nothing with the paged path
  except :func:`minipic.kernels.rope.rotate`, so agreement between the two validates the gather,
  positions, GQA mapping and masking of the paged path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .rope import rotate

__all__ = ["paged_attention_rope_ref", "dense_attention_ref"]

# Upper bound on fp32 score elements materialised at once per request (about 256 MiB);
# long prefills are processed in query chunks under this budget.
_MAX_SCORE_ELEMS = 1 << 26


def _check_common(
    query: torch.Tensor, num_kv_heads: int, query_start_loc: torch.Tensor, num_reqs: int
) -> int:
    """Validate shapes shared by both references; return the GQA group size."""
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_size], got {query.shape}")
    num_heads = query.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if query_start_loc.numel() != num_reqs + 1:
        raise ValueError(
            f"query_start_loc has {query_start_loc.numel()} entries for {num_reqs} requests"
        )
    return num_heads // num_kv_heads


def paged_attention_rope_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rotary_dim: int,
    is_neox: bool,
    scale: float,
    causal: bool = True,
    *,
    out: torch.Tensor | None = None,
    key_start: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
    key_sink: torch.Tensor | None = None,
    query_isolated: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over a ragged batch whose (unrotated) keys live in a paged cache.

    Args:
        query: ``[num_tokens, num_heads, head_size]``, already rotated at the query positions.
        key_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, keys *unrotated*.
        value_cache: same shape as ``key_cache``.
        block_table: ``[num_reqs, max_blocks]`` int; row i maps request i's logical block index
            to a physical block.
        seq_lens: ``[num_reqs]`` total tokens of each request (context + this step's queries).
        query_start_loc: ``[num_reqs + 1]`` cumulative query counts (request i owns query rows
            ``query_start_loc[i]:query_start_loc[i+1]``).
        cos_sin_cache: the model's rotary buffer ``[max_position, rotary_dim]`` = cat(cos, sin).
        rotary_dim: leading dims of each head that RoPE rotates.
        is_neox: neox (halves) vs gptj (interleaved) rotary layout.
        scale: softmax scale, usually ``head_size ** -0.5``.
        causal: if True, query at position p attends to keys ``0..=p``; else to all keys.
        out: optional output buffer ``[num_tokens, num_heads, head_size]``; rows past
            ``query_start_loc[-1]`` are left untouched.
        key_start: optional ``[num_tokens]`` int, the first key each query may attend to
            (span isolation, ``engine_ext/attention/span_segments.py``); keys before it are masked.
            In index space, like the causal mask.
        key_positions: optional ``[num_reqs, W]`` int32/int64, ``W >= max(seq_lens)``: the
            logical RoPE position of key ``j`` of request ``i`` (table slot ``j // block_size``,
            offset ``j % block_size``); a negative entry marks a layout key, visible only to the
            query at its own index, which in turn sees only itself (module docstring). None:
            key ``j`` is rotated at ``j`` and every key is visible.
        key_sink: optional ``[num_reqs, W]`` bool, the shape of ``key_positions`` (required
            with it, as is ``query_isolated``): marks sink keys, the span's private copy of the
            model's opening, seen only by isolated queries and their own (module docstring).
        query_isolated: optional ``[num_tokens]`` bool, indexed like the query rows: the
            queries that may attend to sink keys.

    Returns:
        ``[num_tokens, num_heads, head_size]`` in ``query.dtype`` (zeros in rows that belong
        to no request, when ``out`` is not given).

    Query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``, vLLM's GQA convention.
    Rotated keys are rounded once to the cache dtype (what a stock engine would have cached),
    then scores, softmax and the value sum are computed in fp32.
    """
    num_reqs = block_table.shape[0]
    _, block_size, num_kv_heads, head_size = key_cache.shape
    group = _check_common(query, num_kv_heads, query_start_loc, num_reqs)
    if out is None:
        out = torch.zeros_like(query)

    # One host transfer for the metadata, instead of one .item() per request.
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    _check_key_positions(key_positions, num_reqs, max(lens, default=0))
    _check_sink(key_sink, query_isolated, key_positions, query.shape[0])
    for i in range(num_reqs):
        q_begin, q_end, seq_len = qsl[i], qsl[i + 1], lens[i]
        q_len = q_end - q_begin
        if q_len == 0:
            continue
        if q_len > seq_len:
            raise ValueError(f"request {i}: query_len {q_len} > seq_len {seq_len}")
        num_blocks = -(-seq_len // block_size)
        blocks = block_table[i, :num_blocks].to(device=key_cache.device, dtype=torch.long)
        # Logical key j is at (slot j // block_size, offset j % block_size): flattening the
        # gathered blocks in table order puts key j at row j.
        keys = key_cache[blocks].reshape(-1, num_kv_heads, head_size)[:seq_len]
        values = value_cache[blocks].reshape(-1, num_kv_heads, head_size)[:seq_len]
        # Index space (causal mask, key_start) and RoPE positions are the same unless the
        # caller gives logical positions.
        key_idx = torch.arange(seq_len, device=key_cache.device)
        is_sink = None
        if key_positions is None:
            rope_pos, is_layout = key_idx, None
        else:
            logical = key_positions[i, :seq_len].to(device=key_cache.device, dtype=torch.long)
            rope_pos, is_layout = logical.clamp(min=0), logical < 0
            if key_sink is not None:
                is_sink = key_sink[i, :seq_len].to(key_cache.device) & ~is_layout
        # Rotate in fp32, round once to the cache dtype: the key a stock engine would have
        # cached (rotated by the model, then stored in that dtype), then do the math in fp32.
        keys = rotate(keys, rope_pos, cos_sin_cache, rotary_dim, is_neox).float()
        values = values.float()

        q = query[q_begin:q_end].float().view(q_len, num_kv_heads, group, head_size)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        chunk = max(1, _MAX_SCORE_ELEMS // (query.shape[1] * seq_len))
        for c0 in range(0, q_len, chunk):
            c1 = min(q_len, c0 + chunk)
            # scores[h, g, t, j] for query head h*group+g, query t, key j.
            scores = torch.einsum("thgd,jhd->hgtj", q[c0:c1], keys) * scale
            allowed = _visible(key_idx, q_pos[c0:c1], causal, key_start,
                               q_begin + c0, q_begin + c1, is_layout, is_sink, query_isolated)
            if allowed is not None:
                scores = scores.masked_fill(~allowed, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            o = torch.einsum("hgtj,jhd->thgd", probs, values)
            out[q_begin + c0 : q_begin + c1] = o.reshape(c1 - c0, -1, head_size).to(out.dtype)
    return out


def _visible(key_pos: torch.Tensor, q_pos: torch.Tensor, causal: bool,
             key_start: torch.Tensor | None, row_begin: int, row_end: int,
             is_layout: torch.Tensor | None = None, is_sink: torch.Tensor | None = None,
             query_isolated: torch.Tensor | None = None) -> torch.Tensor | None:
    """``[t, j]`` mask of keys each query sees (None: all): causal and/or from ``key_start``,
    and, given ``is_layout`` (``[seq_len]`` bool, per key index), layout keys hidden from every
    query but their own, layout queries seeing only themselves; given ``is_sink`` (per key
    index, never a layout key) and ``query_isolated`` (per query row), sink keys hidden from
    the queries that are not isolated, but for their own. Positions are indices."""
    allowed = key_pos[None, :] <= q_pos[:, None] if causal else None
    if key_start is not None:
        lower = key_start[row_begin:row_end].to(key_pos.device)
        after = key_pos[None, :] >= lower[:, None]
        allowed = after if allowed is None else allowed & after
    if is_layout is not None:
        real = ~is_layout
        own = key_pos[None, :] == q_pos[:, None]
        seen = real[None, :] & real[q_pos][:, None]
        if is_sink is not None:
            iso = query_isolated[row_begin:row_end].to(key_pos.device)
            seen = seen & (~is_sink[None, :] | iso[:, None])
        layout_ok = own | seen
        allowed = layout_ok if allowed is None else allowed & layout_ok
    return allowed


def _check_key_positions(key_positions: torch.Tensor | None, num_reqs: int, width: int) -> None:
    """``key_positions`` must be ``[num_reqs, >= width]`` integers (or None)."""
    if key_positions is None:
        return
    if key_positions.dim() != 2 or key_positions.shape[0] != num_reqs:
        raise ValueError(
            f"key_positions must be [num_reqs={num_reqs}, W], got {tuple(key_positions.shape)}"
        )
    if key_positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"key_positions must be int32 or int64, got {key_positions.dtype}")
    if key_positions.shape[1] < width:
        raise ValueError(
            f"key_positions has {key_positions.shape[1]} columns, fewer than a seq_len of {width}"
        )


def _check_sink(key_sink: torch.Tensor | None, query_isolated: torch.Tensor | None,
                key_positions: torch.Tensor | None, num_tokens: int) -> None:
    """``key_sink`` (bool, ``key_positions``' shape) and ``query_isolated`` (bool,
    ``[>= num_tokens]``) come together, and only with ``key_positions`` (or not at all)."""
    if key_sink is None and query_isolated is None:
        return
    if key_sink is None or query_isolated is None:
        raise ValueError("key_sink and query_isolated must be given together")
    if key_positions is None:
        raise ValueError("key_sink / query_isolated need key_positions (a sink key is rotated "
                         "at its key_positions entry)")
    if key_sink.dtype != torch.bool or key_sink.shape != key_positions.shape:
        raise ValueError(f"key_sink must be bool of key_positions' shape "
                         f"{tuple(key_positions.shape)}, got {key_sink.dtype} "
                         f"{tuple(key_sink.shape)}")
    if (query_isolated.dtype != torch.bool or query_isolated.dim() != 1
            or query_isolated.shape[0] < num_tokens):
        raise ValueError(f"query_isolated must be bool [num_tokens={num_tokens}], got "
                         f"{query_isolated.dtype} {tuple(query_isolated.shape)}")


def dense_attention_ref(
    query: torch.Tensor,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    query_start_loc: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rotary_dim: int,
    is_neox: bool,
    scale: float,
    causal: bool = True,
    key_start: torch.Tensor | None = None,
    *,
    key_positions: torch.Tensor | None = None,
    key_sink: torch.Tensor | None = None,
    query_isolated: torch.Tensor | None = None,
) -> torch.Tensor:
    """Independent formulation on contiguous tensors, for validating the paged path.

    Args:
        query: ``[num_tokens, num_heads, head_size]``, already rotated.
        keys: per request, ``[seq_len_i, num_kv_heads, head_size]`` unrotated keys in logical
            order (row j is the key at position j).
        values: per request, same shapes as ``keys``.
        query_start_loc, cos_sin_cache, rotary_dim, is_neox, scale, causal, key_start,
            key_positions, key_sink, query_isolated: as in :func:`paged_attention_rope_ref`;
            ``seq_len_i`` is ``len(keys[i])``.

    Returns ``[num_tokens, num_heads, head_size]`` in ``query.dtype``; rows belonging to no
    request are zero.
    """
    num_reqs = len(keys)
    num_kv_heads = keys[0].shape[1] if num_reqs else 1
    group = _check_common(query, num_kv_heads, query_start_loc, num_reqs)
    out = torch.zeros_like(query)
    qsl = query_start_loc.tolist()
    _check_key_positions(key_positions, num_reqs, max((len(k) for k in keys), default=0))
    _check_sink(key_sink, query_isolated, key_positions, query.shape[0])
    for i in range(num_reqs):
        q_begin, q_end = qsl[i], qsl[i + 1]
        q_len, seq_len = q_end - q_begin, keys[i].shape[0]
        if q_len == 0:
            continue
        dev = query.device
        k_pos = torch.arange(seq_len, device=dev)
        if key_positions is None:
            k = rotate(keys[i], k_pos, cos_sin_cache, rotary_dim, is_neox).float()
        else:
            logical = key_positions[i, :seq_len].to(dev)
            # Layout keys (negative) rotate at row 0; see the module docstring.
            rope_pos = torch.where(logical < 0, torch.zeros_like(logical), logical)
            k = rotate(keys[i], rope_pos, cos_sin_cache, rotary_dim, is_neox).float()
        # GQA by explicit head replication: [heads, seq, dim].
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)
        v = values[i].float().repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[q_begin:q_end].float().transpose(0, 1)
        # Bottom-right aligned causal mask: query t is at absolute position seq_len - q_len + t.
        q_abs = torch.arange(q_len, device=dev)[:, None] + (seq_len - q_len)
        mask = k_pos[None, :] <= q_abs if causal else None
        if key_start is not None:
            lower = key_start[q_begin:q_end].to(dev)[:, None]
            mask = (k_pos[None, :] >= lower) & (mask if mask is not None else True)
        if key_positions is not None:
            # Rule 1 as a block mask: real tokens form one class and every layout token a class
            # of its own; a query sees keys of its class only.
            cls = torch.where(logical >= 0, torch.full_like(k_pos, -1), k_pos)
            same = cls[None, :] == cls[q_abs[:, 0]][:, None]
            mask = same if mask is None else mask & same
        if key_sink is not None:
            # The sink: an extra mask on top, sink keys kept for isolated queries and their own.
            sink = key_sink[i, :seq_len].to(dev) & (logical >= 0)
            iso = query_isolated[q_begin:q_end].to(dev)
            keep = ~sink[None, :] | iso[:, None] | (k_pos[None, :] == q_abs)
            mask = mask & keep
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[q_begin:q_end] = o.transpose(0, 1).to(out.dtype)
    return out
