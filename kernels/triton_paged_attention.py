"""Triton paged attention that applies RoPE to keys inside the attention loop (GPU path).

Same contract as :func:`kernels.paged_attention_ref.paged_attention_rope_ref`: keys in the paged
cache are *unrotated*; each key tile is rotated by its logical positions (``j`` for the ``j``-th
key of the request, whatever physical block holds it) right after it is loaded, using the model's
own ``cos_sin_cache``. Nothing is written back, so a physical block can be read by several
requests at several offsets in the same launch.

Layout keys (docs/design.md rule 1): span markers and the PADs that align spans to blocks steer
block hashing and span segments, but the model must never see them. Given ``key_positions``
(``[num_reqs, W]``), the logical position of key ``j`` is read from that row instead of being
``j``: keys are rotated at it (cos/sin gathered at ``max(pos, 0)``), and a key with a negative
position (a layout key) is masked for every query but the one at its own index, which in turn
sees only itself. Real queries then attend exactly as over the compacted sequence without layout
tokens. The causal mask and ``key_start`` stay in index space. The flag ``HAS_KEY_POSITIONS`` is
a constexpr, so launches without ``key_positions`` compile to the same code as before.

Sink keys (docs/design.md §2): each span carries a private copy of the model's opening after its
SSEP (and, after a head computed in context, its copy of that head), which only that span may
read. Given ``key_sink`` (``[num_reqs, W]`` bool) and
``query_isolated`` (``[num_tokens]`` bool), a sink key is rotated at its (non-negative) position
like a real key but masked for every query that is not isolated, except the one at its own
index. Same constexpr scheme (``HAS_SINK``): launches without sinks keep their code.

Kernel layout (one program per (query tile, KV head)):

* Ragged batch, prefill and decode mixed: the grid's first axis enumerates query tiles of all
  requests. Request ``i`` owns tiles starting at ``query_start_loc[i] // BLOCK_Q + i``, an upper
  bound that needs no host synchronisation (``sum_i ceil(len_i / B) <= total // B + num_reqs``);
  each program finds its request by a binary search over that monotone sequence, and programs
  past the end of a request exit.
* GQA: the ``QPK = num_heads // num_kv_heads`` query heads sharing a KV head are packed into the
  M dimension of one tile (row ``m`` = query token ``m // QPK``, head ``m % QPK``), so each K/V
  tile is loaded and rotated once for the whole group.
* RoPE in the tile: RoPE rotates pairs ``(x1[i], x2[i])`` of dims by frequency ``i`` (neox:
  ``(i, i + rot/2)``; gptj: ``(2i, 2i + 1)``); dims ``>= rotary_dim`` pass through. A dot
  product does not depend on the order of the contraction dim, so instead of rotating a whole
  ``[HEAD, BLOCK_N]`` tile (which needs each dim's partner, i.e. a second gather or a lane
  shuffle), K is loaded as three transposed sub-tiles -- the x1 dims, the x2 dims, the
  pass-through dims -- and three accumulating dots compute
  ``q . R k = q[x1] . (k1 cos - k2 sin) + q[x2] . (k2 cos + k1 sin) + q[pass] . k[pass]``.
  One ``[rot/2, BLOCK_N]`` cos tile and one sin tile, gathered from
  the table at the keys' logical positions, serve both halves.
  The rotation is done in fp32 and rounded once to the activation dtype before the dot, which is
  what a model that rotated the key and then cached it in that dtype would have stored.
* Online softmax (base-2 exponent, scale folded in), fp32 accumulators.

On a machine without a GPU the kernel runs under Triton's CPU interpreter when
``TRITON_INTERPRET=1`` is set before Triton is first imported in the process (Triton decides
between compiler and interpreter when ``@triton.jit`` wraps a function, its own ``tl.*`` helpers
included, i.e. at import).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from .paged_attention_ref import _check_sink

__all__ = ["paged_attention_rope_triton"]

_LOG2E = math.log2(math.e)


@triton.jit
def _paged_attention_rope_kernel(
    out_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    cos_sin_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    key_start_ptr,
    key_positions_ptr,
    key_sink_ptr,
    query_isolated_ptr,
    num_reqs,
    qk_scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_kb,
    stride_ko,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vo,
    stride_vh,
    stride_vd,
    stride_bt,
    stride_kpr,
    stride_ksr,
    stride_csp,
    stride_csd,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    ROT_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,
    PASS_PAD: tl.constexpr,
    IS_NEOX: tl.constexpr,
    QPK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KEY_START: tl.constexpr,
    HAS_KEY_POSITIONS: tl.constexpr,
    HAS_SINK: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """One (query tile, KV head) of the ragged batch; see the module docstring for the plan."""
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)

    # ---- which request does this program serve? (largest i with tile_start(i) <= pid)
    lo = tl.full([], 0, tl.int32)
    hi = (tl.full([], 0, tl.int32) + num_reqs).to(tl.int32)
    while lo < hi:
        mid = (lo + hi) // 2
        mid_start = tl.load(query_start_loc_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        go_right = mid_start <= pid
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(go_right, hi, mid)
    req = lo - 1
    q_begin = tl.load(query_start_loc_ptr + req).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + req + 1).to(tl.int32) - q_begin
    q_tile = pid - (q_begin // BLOCK_Q + req)
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
    context_len = seq_len - q_len

    # ---- rotation plan. RoPE pairs dim x1[i] with x2[i] (i < rot/2) and rotates the pair by
    # frequency i; the remaining dims pass through. A dot product does not care about the order
    # of the contraction dim, so q.k_rot = q[x1].k_rot[x1] + q[x2].k_rot[x2] + q[pass].k[pass]:
    # K is loaded as three sub-tiles that are rotated in place, with no lane shuffles and one
    # cos/sin tile of rot/2 entries shared by both halves.
    HALF: tl.constexpr = ROT_DIM // 2
    HAS_PASS: tl.constexpr = ROT_DIM < HEAD_SIZE
    offs_i = tl.arange(0, HALF_PAD)
    pair_ok = offs_i < HALF
    if IS_NEOX:
        dim1 = offs_i  # neox: rotate halves, (i, i + rot/2)
        dim2 = offs_i + HALF
    else:
        dim1 = 2 * offs_i  # gptj: rotate interleaved pairs, (2i, 2i + 1)
        dim2 = 2 * offs_i + 1
    offs_p = ROT_DIM + tl.arange(0, PASS_PAD)
    pass_ok = offs_p < HEAD_SIZE

    # ---- query tile: BLOCK_Q tokens x QPK heads packed in BLOCK_M rows
    offs_m = tl.arange(0, BLOCK_M)
    q_local = q_tile * BLOCK_Q + offs_m // QPK  # token index within the request
    head = kv_head * QPK + offs_m % QPK
    row_ok = (offs_m < BLOCK_Q * QPK) & (q_local < q_len)
    q_pos = context_len + q_local  # absolute position of each query row
    q_tok = (q_begin + q_local).to(tl.int64)
    q_rows = q_ptr + q_tok[:, None] * stride_qt + head[:, None] * stride_qh
    pq_mask = row_ok[:, None] & pair_ok[None, :]
    q1 = tl.load(q_rows + dim1[None, :] * stride_qd, mask=pq_mask, other=0.0)
    q2 = tl.load(q_rows + dim2[None, :] * stride_qd, mask=pq_mask, other=0.0)
    if HAS_PASS:
        qp = tl.load(
            q_rows + offs_p[None, :] * stride_qd, mask=row_ok[:, None] & pass_ok[None, :], other=0.0
        )
    k_dtype = q1.dtype  # rotated keys are rounded to the activation dtype, as if cached rotated
    if DOT_FP32:
        q1 = q1.to(tl.float32)
        q2 = q2.to(tl.float32)
        if HAS_PASS:
            qp = qp.to(tl.float32)
    offs_d = tl.arange(0, HEAD_PAD)
    dim_ok = offs_d < HEAD_SIZE

    # ---- keys this tile can see
    if CAUSAL:
        last_q = tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len) - 1
        kv_end = tl.minimum(seq_len, context_len + last_q + 1)
    else:
        kv_end = seq_len
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    # Span isolation: query row r sees keys key_start[r] ..; tiles before every row's start
    # are skipped, the rest masked per row (0 everywhere without key_start).
    q_key_start = tl.zeros([BLOCK_M], dtype=tl.int32)
    if HAS_KEY_START:
        q_key_start = tl.load(key_start_ptr + q_tok, mask=row_ok, other=0).to(tl.int32)
    first_tile = tl.min(tl.where(row_ok, q_key_start, 2147483647), 0) // BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    if HAS_KEY_POSITIONS:
        # Layout keys (rule 1): a query at a layout index sees only its own key.
        kp_row = key_positions_ptr + req.to(tl.int64) * stride_kpr
        q_is_layout = tl.load(kp_row + q_pos, mask=row_ok, other=0).to(tl.int32) < 0
        if HAS_SINK:
            # Sink keys: seen by isolated queries (and their own query) only.
            ks_row = key_sink_ptr + req.to(tl.int64) * stride_ksr
            q_isolated = tl.load(query_isolated_ptr + q_tok, mask=row_ok, other=0) != 0

    for tile in range(first_tile, num_tiles):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # key indices in the request
        key_ok = offs_n < kv_end
        phys = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        slot = (offs_n % BLOCK_SIZE).to(tl.int64)
        k_col = k_ptr + (phys * stride_kb + slot * stride_ko + kv_head * stride_kh)[None, :]
        v_row = v_ptr + (phys * stride_vb + slot * stride_vo + kv_head * stride_vh)[:, None]

        # Rotate the K tile, transposed [dims, BLOCK_N], by the keys' logical positions
        # (their indices, unless key_positions gives them).
        pk_mask = pair_ok[:, None] & key_ok[None, :]
        k1 = tl.load(k_col + dim1[:, None] * stride_kd, mask=pk_mask, other=0.0).to(tl.float32)
        k2 = tl.load(k_col + dim2[:, None] * stride_kd, mask=pk_mask, other=0.0).to(tl.float32)
        if HAS_KEY_POSITIONS:
            k_pos = tl.load(kp_row + offs_n, mask=key_ok, other=0).to(tl.int32)
            rope_pos = tl.maximum(k_pos, 0)  # a layout key's rotation never matters
        else:
            rope_pos = offs_n
        cs = cos_sin_ptr + rope_pos.to(tl.int64)[None, :] * stride_csp
        cos = tl.load(cs + offs_i[:, None] * stride_csd, mask=pk_mask, other=0.0).to(tl.float32)
        sin = tl.load(cs + (offs_i + HALF)[:, None] * stride_csd, mask=pk_mask, other=0.0).to(
            tl.float32
        )
        k1r = (k1 * cos - k2 * sin).to(k_dtype)
        k2r = (k2 * cos + k1 * sin).to(k_dtype)
        if DOT_FP32:
            s = tl.dot(q1, k1r.to(tl.float32), input_precision="ieee")
            s = tl.dot(q2, k2r.to(tl.float32), s, input_precision="ieee")
        else:
            s = tl.dot(q1, k1r)
            s = tl.dot(q2, k2r, s)
        if HAS_PASS:
            kp = tl.load(
                k_col + offs_p[:, None] * stride_kd,
                mask=pass_ok[:, None] & key_ok[None, :],
                other=0.0,
            )
            if DOT_FP32:
                s = tl.dot(qp, kp.to(tl.float32), s, input_precision="ieee")
            else:
                s = tl.dot(qp, kp, s)

        s = s * qk_scale
        ok = row_ok[:, None] & key_ok[None, :]
        if CAUSAL:
            ok = ok & (offs_n[None, :] <= q_pos[:, None])
        if HAS_KEY_START:
            ok = ok & (offs_n[None, :] >= q_key_start[:, None])
        if HAS_KEY_POSITIONS:
            own = offs_n[None, :] == q_pos[:, None]
            seen = (k_pos >= 0)[None, :] & ~q_is_layout[:, None]
            if HAS_SINK:
                k_sink = tl.load(ks_row + offs_n, mask=key_ok, other=0) != 0
                seen = seen & (~k_sink[None, :] | q_isolated[:, None])
            ok = ok & (own | seen)
        s = tl.where(ok, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows with nothing visible yet keep m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)

        v = tl.load(
            v_row + offs_d[None, :] * stride_vd, mask=key_ok[:, None] & dim_ok[None, :], other=0.0
        )
        acc = acc * alpha[:, None]
        if DOT_FP32:
            # P is rounded to the value dtype in both branches, so they agree numerically.
            p_op = p.to(v.dtype).to(tl.float32)
            acc = tl.dot(p_op, v.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    o_rows = out_ptr + q_tok[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(
        o_rows + offs_d[None, :] * stride_od,
        o.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


def _launch_config(
    group: int, head_pad: int, max_query_len: int, block_m: int | None, block_n: int | None
) -> tuple[int, int, int]:
    """Pick (BLOCK_M, BLOCK_N, num_warps).

    Decode-only batches get the smallest M tile that fits a GQA group (tl.dot needs >= 16), so
    few rows are wasted; batches with prefills get a taller tile to reuse each rotated K tile
    across more queries. The K tile stays at 32 keys: the rotation keeps two fp32 K half-tiles
    and a cos and a sin tile live, and wider tiles pushed sm_90 builds into register spills
    (checked with ptxas resource usage, head 64 and 128; not yet timed on a GPU).
    """
    if block_m is None:
        block_m = 16 if max_query_len <= 1 else 64
        block_m = max(block_m, triton.next_power_of_2(group))
    if block_n is None:
        block_n = 32
    if block_m < group:
        raise ValueError(f"block_m={block_m} must hold a whole GQA group of {group} heads")
    if block_m < 16 or block_n < 16 or block_m & (block_m - 1) or block_n & (block_n - 1):
        raise ValueError("block_m and block_n must be powers of two >= 16")
    num_warps = 8 if block_m * head_pad >= 64 * 128 else 4
    return block_m, block_n, num_warps


def paged_attention_rope_triton(
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
    max_query_len: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    key_start: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
    key_sink: torch.Tensor | None = None,
    query_isolated: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton version of :func:`minipic.kernels.paged_attention_ref.paged_attention_rope_ref`.

    Positional arguments, layouts and result are the reference's:
    query ``[num_tokens, num_heads, head_size]`` (rotated), key/value cache
    ``[num_blocks, block_size, num_kv_heads, head_size]`` (keys unrotated; any strides, so
    views of a packed vLLM KV tensor work), block_table ``[num_reqs, max_blocks]``, seq_lens
    ``[num_reqs]``, query_start_loc ``[num_reqs + 1]``, cos_sin_cache
    ``[max_position, rotary_dim]`` = cat(cos, sin).

    Keyword-only extras:
        out: output buffer (allocated if None); rows past ``query_start_loc[-1]`` untouched.
        max_query_len: longest query of the batch; only picks the tile shape. Pass it when known
            (vLLM's metadata has it) to avoid a device-to-host sync.
        block_m, block_n: override the tile shape (tests use this to cover tile/block-size
            combinations).
        key_start: ``[num_tokens]`` int, first key each query may attend to (span isolation);
            None: plain causal.
        key_positions: ``[num_reqs, W]`` int32/int64, ``W >= max(seq_lens)``: logical RoPE
            position of key ``j`` of request ``i``; negative marks a layout key, seen only by
            the query at its own index, which sees only itself (docs/design.md rule 1; see
            the reference). None: key ``j`` at position ``j``, every key visible.
        key_sink, query_isolated: ``[num_reqs, W]`` bool (``key_positions``' shape) and
            ``[num_tokens]`` bool, together and only with ``key_positions``: sink keys (a span's
            private copy of the model's opening) are seen only by isolated queries and by the
            query at their own index (see the reference). None: no sink key.

    Preconditions not checked here because checking needs a device-to-host sync:
    ``cos_sin_cache`` covers every position ``< max(seq_lens)`` (every entry of
    ``key_positions`` a request uses, when given), ``key_positions`` has at least
    ``max(seq_lens)`` columns, and every block-table entry
    a request uses (``< ceil(seq_len / block_size)``) is a valid block. The K/V cache must have
    the query's dtype (no fp8 KV cache).
    """
    num_tokens, num_heads, head_size = query.shape
    num_blocks, block_size, num_kv_heads, kv_head_size = key_cache.shape
    num_reqs = block_table.shape[0]
    if kv_head_size != head_size or value_cache.shape != key_cache.shape:
        raise ValueError("key/value cache must be [num_blocks, block_size, num_kv_heads, head]")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if key_cache.dtype != query.dtype or value_cache.dtype != query.dtype:
        raise ValueError(f"KV cache dtype {key_cache.dtype} differs from query {query.dtype}")
    if rotary_dim % 2 or not 0 < rotary_dim <= head_size:
        raise ValueError(f"rotary_dim={rotary_dim} must be even and in (0, {head_size}]")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != rotary_dim:
        raise ValueError(f"cos_sin_cache must be [max_position, {rotary_dim}]")
    if query_start_loc.numel() != num_reqs + 1 or seq_lens.numel() != num_reqs:
        raise ValueError("query_start_loc must have num_reqs + 1 entries, seq_lens num_reqs")
    if key_positions is not None:
        if key_positions.dim() != 2 or key_positions.shape[0] != num_reqs:
            raise ValueError(f"key_positions must be [num_reqs={num_reqs}, W], got "
                             f"{tuple(key_positions.shape)}")
        if key_positions.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"key_positions must be int32 or int64, got {key_positions.dtype}")
        if key_positions.stride(1) != 1:
            key_positions = key_positions.contiguous()
    _check_sink(key_sink, query_isolated, key_positions, num_tokens)
    if key_sink is not None and query_isolated is not None:
        # Read as bytes (a bool tensor's storage, 0 / 1), keys and rows at unit stride.
        key_sink = (key_sink if key_sink.stride(1) == 1 else key_sink.contiguous()).view(
            torch.uint8)
        query_isolated = query_isolated.contiguous().view(torch.uint8)
    if out is None:
        out = torch.empty_like(query)
    if num_reqs == 0 or num_tokens == 0:
        return out

    group = num_heads // num_kv_heads
    head_pad = max(16, triton.next_power_of_2(head_size))
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    bm, bn, num_warps = _launch_config(group, head_pad, max_query_len, block_m, block_n)
    # fp32 inputs need exact (IEEE) fp32 dots, not TF32. Triton 3.9's CPU interpreter computes
    # bf16 tl.dot wrongly (garbage products), so interpreted bf16 runs widen the already-rounded
    # bf16 operands to fp32 first: the same numbers, exact products.
    interpreted = not isinstance(_paged_attention_rope_kernel, JITFunction)
    block_q = bm // group
    grid = (num_tokens // block_q + num_reqs, num_kv_heads)
    _paged_attention_rope_kernel[grid](
        out,
        query,
        key_cache,
        value_cache,
        cos_sin_cache,
        block_table,
        seq_lens,
        query_start_loc,
        key_start if key_start is not None else seq_lens,
        key_positions if key_positions is not None else seq_lens,
        key_sink if key_sink is not None else seq_lens,
        query_isolated if query_isolated is not None else seq_lens,
        num_reqs,
        scale * _LOG2E,
        *query.stride(),
        *out.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        block_table.stride(0),
        key_positions.stride(0) if key_positions is not None else 0,
        key_sink.stride(0) if key_sink is not None else 0,
        *cos_sin_cache.stride(),
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        ROT_DIM=rotary_dim,
        HALF_PAD=max(16, triton.next_power_of_2(rotary_dim // 2)),
        PASS_PAD=max(16, triton.next_power_of_2(max(1, head_size - rotary_dim))),
        IS_NEOX=is_neox,
        QPK=group,
        BLOCK_M=bm,
        BLOCK_Q=block_q,
        BLOCK_N=bn,
        BLOCK_SIZE=block_size,
        CAUSAL=causal,
        HAS_KEY_START=key_start is not None,
        HAS_KEY_POSITIONS=key_positions is not None,
        HAS_SINK=key_sink is not None,
        DOT_FP32=query.dtype == torch.float32 or (interpreted and query.dtype == torch.bfloat16),
        num_warps=num_warps,
    )
    return out
