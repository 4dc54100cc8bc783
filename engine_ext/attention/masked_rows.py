"""Rule 1 on the CPU: attention for the requests that hold layout tokens, with a key mask.

docs/design.md §2: a span request's SSEP, PDEP and PAD are attended by no query but their own
and take no RoPE position. vLLM's C++ CPU kernel attends every key of a row's range and takes
no mask, so these rows (``step_plan.MaskedBatch``) are attended here, with
``torch.nn.functional.scaled_dot_product_attention`` and a boolean mask.

Why the work is split the way it is: everything that depends only on the step — the blocks a row
reads in table order, the move of each key from its home position (where the cache holds it
rotated) to its logical one, each query's move from the physical position the model rotated it
at, and the mask — is the same in every layer, so :func:`prepare` builds it once per step (the
first layer), and a layer does only its own part: one copy of the row's pages, keys and values
brought to token order through the page layout vLLM's writer uses (``cpu_kv_layout``), one call
of the model's rotary op on each (moves by an offset table, as the key shadow does,
``cpu_backend.move_keys``), and attention as two ``einsum`` and a softmax in fp32. Measured per
layer on the 2-core box (960 keys, SmolLM2 heads): gathering pages then reordering them 0.13 ms
against 4.0 ms for one element-wise gather; ``einsum`` 0.10 ms against 0.42 ms for
``scaled_dot_product_attention`` with a boolean mask and grouped heads at one query. The
arithmetic is ``kernels.paged_attention_rope_ref`` with ``key_positions``, which the tests hold
the engine to.

Why a request's keys are kept between steps (:class:`KeptKeys`): the queries that decode an
answer (and the question's) see every real key of their request and nothing else, so they attend
over a compact copy of those keys, moved to their logical positions, that each step extends by
its new keys instead of reading and moving the whole prompt again in every layer. The copy lives
in the memory configured for the key shadow (``MINIPIC_ROTATED_POOL_SHARE`` of a layer's KV
bytes), which rule 1 leaves idle; a request it cannot hold is built afresh each step, with the
same result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from minipic.engine_ext.attention.cpu_kv_layout import PageLayout
from minipic.engine_ext.attention.step_plan import MaskedBatch

_PREPARED = "masked_rows"  # key of the per-step preparation in MaskedBatch.derived

# rotate(x [n, heads, D] in place, offsets [n]): the model's rotary op moving each row by its
# offset (positions into an offset table)
Rotate = Callable[[torch.Tensor, torch.Tensor], None]


@dataclass
class PreparedRow:
    """One kernel row of a masked request, ready for any layer of the group.

    Its queries split in three: the **plain** ones (real tokens outside any span: the question,
    the answer being generated) see exactly the request's real keys up to themselves, so they
    attend over a compact copy of those keys (:class:`KeptKeys`, kept from one step to the next);
    a **layout** query sees only itself, so its output is its own value (what attention over
    that one key gives, exactly); the **others** (a span's tokens, its sink) attend over the
    row's whole key range with the mask.
    """

    queries: torch.Tensor  # [q] int64: the row's query rows in the step
    blocks: torch.Tensor  # [ceil(n / bs)] int64: the physical blocks it reads, in table order
    keys: int  # n: its keys are tokens 0 .. n - 1 of those blocks
    key_moves: torch.Tensor  # [n] int64: logical minus home position of each key
    query_moves: torch.Tensor  # [q] int64: logical minus physical position of each query
    mask: torch.Tensor | None  # [q_other, n] bool: what each other query sees
    other: torch.Tensor  # [q_other] int64: indices (into the row's queries) of the others
    plain: torch.Tensor  # [q_plain] int64: indices of the plain queries
    real_keys: torch.Tensor  # [m] int64: the real keys (not layout, not sink), in order
    plain_mask: torch.Tensor | None  # [q_plain, m] bool: the real keys each sees (None: all)
    layout: torch.Tensor  # [q_layout] int64: indices of the layout queries
    layout_keys: torch.Tensor  # [q_layout] int64: their own keys
    request: str | None  # the request, when it has this one row in the step (keys kept)
    home: torch.Tensor  # [ceil(n / bs)] int64: the home slot of each block


def prepare(batch: MaskedBatch, home_slots: torch.Tensor, block_size: int
            ) -> list[PreparedRow]:
    """The step's part of the masked rows' attention (cached on ``batch`` for every layer)."""
    cached = batch.derived.get(_PREPARED)
    if cached is not None:
        return cached
    lens = batch.seq_lens.tolist()
    qsl = batch.query_start_loc.tolist()
    rows = []
    for r, seq_len in enumerate(lens):
        blocks = batch.block_table[r, : -(-seq_len // block_size)].long()
        j = torch.arange(seq_len)
        # a block never written is never read (its keys are masked or absent)
        home = home_slots[blocks].long().clamp(min=0)
        home_pos = home[j // block_size] * block_size
        logical = batch.key_positions[r, :seq_len]
        q0, q1 = qsl[r], qsl[r + 1]
        q_index = torch.arange(seq_len - (q1 - q0), seq_len)  # each query's own key
        sink = (torch.zeros(seq_len, dtype=torch.bool) if batch.key_sink is None
                else batch.key_sink[r, :seq_len])
        starts = (torch.zeros(q1 - q0, dtype=torch.long) if batch.key_start is None
                  else batch.key_start[q0:q1])
        isolated = starts > 0 if batch.query_isolated is None else batch.query_isolated[q0:q1]
        real = (logical >= 0) & ~sink
        is_plain = real[q_index] & ~isolated & (starts == 0)
        is_layout = logical[q_index] < 0
        other = (~is_plain & ~is_layout).nonzero().flatten()
        sees = torch.cumsum(real.long(), 0)[q_index[is_plain]]
        real_keys = real.nonzero().flatten()
        every = bool((sees == real_keys.numel()).all())
        key_start = None if batch.key_start is None else starts[other]
        rows.append(PreparedRow(
            queries=batch.rows[q0:q1], blocks=blocks, keys=seq_len,
            key_moves=logical.clamp(min=0) - home_pos - j % block_size,
            query_moves=batch.query_shift[q0:q1],
            mask=_mask(q_index[other], logical, key_start, sink, isolated[other])
            if other.numel() else None,
            other=other, plain=is_plain.nonzero().flatten(), real_keys=real_keys,
            plain_mask=None if every else torch.arange(real_keys.numel())[None, :] < sees[:, None],
            layout=is_layout.nonzero().flatten(), layout_keys=q_index[is_layout],
            request=batch.requests[r] if batch.requests else None, home=home))
    batch.derived[_PREPARED] = rows
    return rows


def _mask(q_index: torch.Tensor, key_positions: torch.Tensor, key_start: torch.Tensor | None,
          sink: torch.Tensor | None = None, isolated: torch.Tensor | None = None
          ) -> torch.Tensor:
    """``[q, n]``: causal, from ``key_start``, and rule 1 — a layout key (negative position) is
    seen only by its own query, a layout query sees only itself; a sink key is seen only by
    the queries inside a span (``isolated``: ``key_start`` keeps them inside their own)."""
    j = torch.arange(key_positions.numel())
    shown = key_positions >= 0  # a query whose own key is shown is no layout query
    allowed = j[None, :] <= q_index[:, None]
    if key_start is not None:
        allowed &= j[None, :] >= key_start[:, None]
    if sink is None or isolated is None:
        allowed &= shown[None, :]
    else:
        allowed &= (shown & ~sink)[None, :] | (sink[None, :] & isolated[:, None])
    allowed &= shown[q_index][:, None]
    allowed |= j[None, :] == q_index[:, None]
    return allowed


def token_rows(layout: PageLayout, pages: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys, values)`` ``[blocks * bs, heads, D]`` in token order, from a layer's pages
    ``[blocks, heads, 2 * bs, D]`` (keys then values per page, in ``layout``)."""
    blocks, heads, _, d = pages.shape
    bs = layout.block_size
    key_pages, value_pages = pages[:, :, :bs], pages[:, :, bs:]
    if layout.column_major_keys():  # the vector kernels' [D, bs] pages: a transpose
        keys = key_pages.reshape(blocks, heads, d, bs).permute(0, 3, 1, 2)
    else:
        keys = layout.plain_keys(key_pages).transpose(1, 2)
    values = layout.plain_values(value_pages).transpose(1, 2)
    return keys.reshape(-1, heads, d), values.reshape(-1, heads, d)


class KeptKeys:
    """One request's real keys (moved to their logical positions) and values, in token order,
    in one layer: what its plain queries attend over, kept from one step to the next so that a
    decode step reads, moves and appends only its new keys.

    Why it is exact: each key is read from the cache and moved by the same op, with the same
    offset, whether it was appended now or steps ago (the op is row by row), so the copy equals
    the one a fresh build would make, and a plain query's answer does not depend on whether the
    copy was kept (evicted, preempted, over budget: it is built again). ``blocks`` and ``home``
    say which cache content it was built from; a request whose table or homes changed gets a
    new copy.
    """

    def __init__(self, heads: int, d: int, dtype: torch.dtype) -> None:
        self.k = torch.empty(0, heads, d, dtype=dtype)
        self.v = torch.empty(0, heads, d, dtype=dtype)
        self.count = 0  # real keys held
        self.covered = 0  # keys 0 .. covered - 1 of the request were looked at
        self.blocks = torch.empty(0, dtype=torch.long)
        self.home = torch.empty(0, dtype=torch.long)

    @property
    def nbytes(self) -> int:
        return (self.k.numel() + self.v.numel()) * self.k.element_size()

    def valid_for(self, row: PreparedRow, block_size: int) -> bool:
        full = self.covered // block_size + bool(self.covered % block_size)
        return (self.covered <= row.keys and self.blocks.numel() == full
                and torch.equal(self.blocks, row.blocks[:full])
                and torch.equal(self.home, row.home[:full]))

    def extend(self, row: PreparedRow, kv_cache: torch.Tensor, layout: PageLayout,
               rotate: Rotate, block_size: int) -> None:
        """Append the row's real keys from ``covered`` on."""
        first = self.covered // block_size  # the first block holding a key not looked at
        new = row.real_keys[row.real_keys >= self.covered]
        if new.numel():
            keys, values = token_rows(layout, kv_cache.index_select(0, row.blocks[first:]))
            local = new - first * block_size
            k = keys.index_select(0, local)
            rotate(k, row.key_moves[new])
            need = self.count + new.numel()
            if need > self.k.shape[0]:  # room for what follows: decode appends one a step
                grow = max(need, 2 * self.k.shape[0], 64)
                self.k = _grown(self.k, grow, self.count)
                self.v = _grown(self.v, grow, self.count)
            self.k[self.count:need] = k
            self.v[self.count:need] = values.index_select(0, local)
            self.count = need
        self.covered = row.keys
        full = -(-row.keys // block_size)
        self.blocks, self.home = row.blocks[:full].clone(), row.home[:full].clone()


def _grown(x: torch.Tensor, size: int, used: int) -> torch.Tensor:
    out = torch.empty(size, *x.shape[1:], dtype=x.dtype)
    out[:used] = x[:used]
    return out


def attend(rows: list[PreparedRow], query: torch.Tensor, kv_cache: torch.Tensor,
           layout: PageLayout, rotate: Rotate, scale: float, output: torch.Tensor,
           kept: dict[str, KeptKeys] | None = None, kept_cap_bytes: int = 0) -> None:
    """One layer: ``kv_cache`` ``[blocks, heads, 2 * bs, D]`` is its cache; writes the
    ``output`` rows of every prepared row. ``kept``: this layer's kept keys by request (entries
    of requests not in this step are dropped), at most ``kept_cap_bytes`` in all."""
    heads = query.shape[1]
    kv_heads, d = kv_cache.shape[1], kv_cache.shape[3]
    bs = layout.block_size
    if kept is not None:
        step = {row.request for row in rows}
        for gone in [r for r in kept if r not in step]:
            del kept[gone]
    for row in rows:
        if row.layout.numel():  # a layout query sees only itself: its own value
            pages = kv_cache.index_select(0, row.blocks[row.layout_keys // bs])
            own = token_rows(layout, pages)[1].view(-1, bs, kv_heads, d)
            own = own[torch.arange(row.layout.numel()), row.layout_keys % bs]
            output[row.queries[row.layout]] = own.repeat_interleave(
                heads // kv_heads, dim=1).to(output.dtype)
        if row.other.numel():
            keys, values = token_rows(layout, kv_cache.index_select(0, row.blocks))
            k = keys[: row.keys].contiguous()
            rotate(k, row.key_moves)
            _attend_rows(query, row, row.other, k, values[: row.keys], row.mask, rotate, scale,
                         heads, output)
        if not row.plain.numel():
            continue
        copy = None if kept is None or row.request is None else kept.get(row.request)
        if copy is None or not copy.valid_for(row, bs):
            copy = KeptKeys(kv_heads, d, kv_cache.dtype)
        copy.extend(row, kv_cache, layout, rotate, bs)
        if kept is not None and row.request is not None:
            kept.pop(row.request, None)
            if sum(c.nbytes for c in kept.values()) + copy.nbytes <= kept_cap_bytes:
                kept[row.request] = copy
        _attend_rows(query, row, row.plain, copy.k[:copy.count], copy.v[:copy.count],
                     row.plain_mask, rotate, scale, heads, output)


def _attend_rows(query: torch.Tensor, row: PreparedRow, which: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, mask: torch.Tensor | None, rotate: Rotate, scale: float,
                 heads: int, output: torch.Tensor) -> None:
    """``output`` of the row's queries ``which`` over keys ``k`` (moved) and values ``v``."""
    rows = row.queries[which]
    q = query[rows]  # a fresh tensor
    rotate(q, row.query_moves[which])
    kv_heads, d = k.shape[1], k.shape[2]
    q = q.float().view(-1, kv_heads, heads // kv_heads, d)
    scores = torch.einsum("thgd,jhd->hgtj", q, k.float()) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hgtj,jhd->thgd", probs, v.float())
    output[rows] = out.reshape(-1, heads, d).to(output.dtype)
