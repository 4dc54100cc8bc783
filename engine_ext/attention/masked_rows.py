"""Rule 1 on the CPU: attention for the requests that hold layout tokens.

docs/design.md §2: a span request's SSEP, PDEP and PAD are attended by no query but their own
and take no RoPE position; a span's sink only by its own span. vLLM's C++ CPU kernel attends
every key of a row's range and takes no mask, so these rows (``step_plan.MaskedBatch``) are
attended here. A row's queries split three ways (:class:`PreparedRow`): the **plain** ones (the
question, the answer being decoded) through vLLM's kernel over a kept copy of the request's real
keys (:class:`KeptKeys`); a **layout** query gets its own value; the **others** (a span's own
tokens, computed in a final) with a boolean mask in torch.

Why the work is split the way it is: everything that depends only on the step — the blocks a row
reads in table order, the move of each key from its home position (where the cache holds it
rotated) to its logical one, each query's move from the physical position the model rotated it
at, the mask, the kernel's rows and indices — is the same in every layer, so :func:`prepare`
and the first layer build it once per step (``PreparedRow.derived``), and a layer does only its
own part: one copy of the row's pages, keys and values brought to token order through the page
layout vLLM's writer uses (``cpu_kv_layout``), one call of the model's rotary op on each (moves
by an offset table, as the key shadow does, ``cpu_backend.move_keys``), and, for the others,
attention as two ``einsum`` and a softmax in fp32. Measured per layer on the 2-core box (960
keys, SmolLM2 heads): gathering pages then reordering them 0.13 ms against 4.0 ms for one
element-wise gather (for one decoded key the element-wise gather is the cheaper: a few hundred
elements); ``einsum`` 0.10 ms against 0.42 ms for ``scaled_dot_product_attention`` with a
boolean mask and grouped heads at one query. The arithmetic is ``kernels.paged_attention_rope_ref``
with ``key_positions``, which the tests hold the engine to.

Why a request's keys are kept between steps (:class:`KeptKeys`): the queries that decode an
answer (and the question's) see every real key of their request and nothing else, so they attend
over a compact copy of those keys, moved to their logical positions, that each step extends by
its new keys instead of reading and moving the whole prompt again in every layer. The copy lives
in the memory configured for the key shadow (``MINIPIC_ROTATED_POOL_SHARE`` of a layer's KV
bytes), which rule 1 leaves idle; a request it cannot hold is built afresh each step, with the
same result.

Why the copy is kept in vLLM's own page layout: with layout keys and sinks left out, what a plain
query sees is a causal prefix of the copy, which is exactly what vLLM's C++ kernel computes
without a mask. So the copy is written by vLLM's writer into pages of its own and the plain
queries are attended by vLLM's kernel on them (:class:`PagedKernel`): one call per request and
layer instead of a dozen torch ops. Measured on the 2-core box at one decoding query over 1,100
keys: 0.023 ms against 0.109 ms for the ``einsum`` path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from minipic.engine_ext.attention.cpu_kv_layout import PageLayout
from minipic.engine_ext.attention.step_plan import MaskedBatch

_PREPARED = "masked_rows"  # key of the per-step preparation in MaskedBatch.derived

# rotate(x [n, heads, D] in place, moves [n]): the model's rotary op moving each row by its
# offset; ``moves`` are rows of the op's offset table (offset + the table's shift,
# ``cpu_backend._offset_table``), so that no layer adds the shift again
Rotate = Callable[[torch.Tensor, torch.Tensor], None]


class PagedKernel(Protocol):
    """vLLM's C++ CPU kernels, bound to a layer (its ISA, scale): what the kept copy is written
    and attended with (``cpu_backend`` provides them)."""

    def write(self, keys: torch.Tensor, values: torch.Tensor, pages: torch.Tensor,
              slots: torch.Tensor) -> None:
        """Tokens ``[n, kv_heads, D]`` into ``pages`` ``[P, kv_heads, 2 * bs, D]`` at
        ``slots`` (page * bs + offset)."""

    def attend(self, query: torch.Tensor, pages: torch.Tensor, query_start_loc: torch.Tensor,
               seq_lens: torch.Tensor, block_table: torch.Tensor, scheduler: torch.Tensor,
               out: torch.Tensor) -> None:
        """Causal attention of ``query`` rows over ``pages`` (no mask), into ``out``."""

    def schedule(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """The kernel's scheduler metadata for these rows (the same in every layer)."""


@dataclass
class PreparedRow:
    """One kernel row of a masked request, ready for any layer of the group.

    Its queries split in three: the **plain** ones (real tokens outside any span: the question,
    the answer being generated) see exactly the request's real keys up to themselves, so they
    attend over a compact copy of those keys (:class:`KeptKeys`, kept from one step to the next);
    a **layout** query sees only itself, so its output is its own value (what attention over
    that one key gives, exactly); the **others** (a span's tokens, its sink) attend with the mask
    over the keys from the first they may see to themselves (:func:`_key_ranges`).
    """

    queries: torch.Tensor  # [q] int64: the row's query rows in the step
    blocks: torch.Tensor  # [ceil(n / bs)] int64: the physical blocks it reads, in table order
    keys: int  # n: its keys are tokens 0 .. n - 1 of those blocks
    key_moves: torch.Tensor  # [n] int64: logical minus home position of each key (+ shift)
    query_moves: torch.Tensor  # [q] int64: logical minus physical position of each (+ shift)
    # the other queries by the first key they may see (a span's own tokens: its start), each
    # group with the key range [lo, hi) it reads and its mask over that range
    other_groups: list[tuple[torch.Tensor, int, int, torch.Tensor]]
    plain: torch.Tensor  # [q_plain] int64: indices of the plain queries
    real_keys: torch.Tensor  # [m] int64: the real keys (not layout, not sink), in order
    layout: torch.Tensor  # [q_layout] int64: indices of the layout queries
    layout_keys: torch.Tensor  # [q_layout] int64: their own keys
    request: str | None  # the request, when it has this one row in the step (keys kept)
    home: torch.Tensor  # [ceil(n / bs)] int64: the home slot of each block
    positions: torch.Tensor  # [n] int64: each key's logical position (-1: a layout key)
    own: torch.Tensor  # [q] int64: each query's own key
    # the plain queries as the C++ kernel's rows over the kept copy: runs of consecutive real
    # keys; a run's keys are the copy's first ``seq_len`` (its last query's own key included)
    plain_qsl: torch.Tensor = field(default_factory=lambda: torch.zeros(1, dtype=torch.int32))
    plain_seq_lens: torch.Tensor = field(
        default_factory=lambda: torch.zeros(0, dtype=torch.int32))
    # what every layer's kept copy derives alike (indices, the kernel's metadata), built by the
    # first: every layer's copy of a request holds the same keys, so the others find it here
    derived: dict = field(default_factory=dict)


def prepare(batch: MaskedBatch, home_slots: torch.Tensor, block_size: int, shift: int = 0
            ) -> list[PreparedRow]:
    """The step's part of the masked rows' attention (cached on ``batch`` for every layer);
    ``shift``: the row of the offset table that moves by 0 (moves are table rows)."""
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
        qsl_runs, seq_lens_runs = _runs(sees - 1)
        key_start = None if batch.key_start is None else starts[other]
        rows.append(PreparedRow(
            queries=batch.rows[q0:q1], blocks=blocks, keys=seq_len,
            key_moves=logical.clamp(min=0) - home_pos - j % block_size + shift,
            query_moves=batch.query_shift[q0:q1] + shift,
            other_groups=_key_ranges(
                other, q_index[other], key_start,
                _mask(q_index[other], logical, key_start, sink, isolated[other]))
            if other.numel() else [],
            plain=is_plain.nonzero().flatten(), real_keys=real_keys,
            layout=is_layout.nonzero().flatten(), layout_keys=q_index[is_layout],
            request=batch.requests[r] if batch.requests else None, home=home,
            positions=logical, own=q_index, plain_qsl=qsl_runs, plain_seq_lens=seq_lens_runs))
    batch.derived[_PREPARED] = rows
    return rows


def _key_ranges(other: torch.Tensor, own: torch.Tensor, key_start: torch.Tensor | None,
                mask: torch.Tensor) -> list[tuple[torch.Tensor, int, int, torch.Tensor]]:
    """``(queries, lo, hi, mask)`` per first key ``lo`` the other queries may see: ``queries``
    index the row's queries, keys ``lo .. hi - 1`` hold all that each sees (from its
    ``key_start`` to itself), ``mask`` ``[len(queries), hi - lo]``. Why: a span's tokens
    computed in a final (a cold final, a recomputed head's sink) see only their own span, so
    reading and moving the whole prompt for them, per layer, was most of their cost."""
    starts = (torch.zeros_like(own) if key_start is None else key_start).tolist()
    groups = []
    for lo in sorted(set(starts)):
        members = torch.tensor([i for i, s in enumerate(starts) if s == lo])
        hi = int(own[members].max()) + 1
        groups.append((other[members], lo, hi, mask[members, lo:hi]))
    return groups


def _runs(own: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(query_start_loc, seq_lens)`` int32 of the plain queries as kernel rows: ``own`` is
    each one's own key in the kept copy (increasing); a row is a run of consecutive keys, so the
    kernel's causal rule (query ``t`` of a row sees keys ``0 .. seq_len - len + t``) is exactly
    "every real key up to itself"."""
    if not own.numel():
        return torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    ends = torch.cat([(own[1:] != own[:-1] + 1).nonzero().flatten(),
                      torch.tensor([own.numel() - 1])])
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), ends + 1])
    return qsl.to(torch.int32), (own[ends] + 1).to(torch.int32)


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
    in pages of vLLM's layout, in one layer: what its plain queries attend over, kept from one
    step to the next so that a decode step reads, moves and appends only its new keys.

    Why it is exact: each key is read from the cache and moved by the same op, with the same
    offset, whether it was appended now or steps ago (the op is row by row), and written by the
    same writer, so the copy equals the one a fresh build would make, and a plain query's answer
    does not depend on whether the copy was kept (evicted, preempted, over budget: it is built
    again). ``blocks`` and ``home`` say which cache content it was built from; a request whose
    table or homes changed gets a new copy.
    """

    def __init__(self, heads: int, d: int, block_size: int, dtype: torch.dtype) -> None:
        self.pages = torch.empty(0, heads, 2 * block_size, d, dtype=dtype)
        self.count = 0  # real keys held
        self.covered = 0  # keys 0 .. covered - 1 of the request were looked at
        self.blocks = torch.empty(0, dtype=torch.long)
        self.home = torch.empty(0, dtype=torch.long)

    @property
    def nbytes(self) -> int:
        return self.pages.numel() * self.pages.element_size()

    def valid_for(self, row: PreparedRow, block_size: int) -> bool:
        # every layer's copy of the request shares one (blocks, home) pair: asked once a step
        key = ("valid", id(self.blocks), id(self.home), self.covered)
        if key not in row.derived:
            full = self.covered // block_size + bool(self.covered % block_size)
            row.derived[key] = (self.covered <= row.keys and self.blocks.numel() == full
                                and torch.equal(self.blocks, row.blocks[:full])
                                and torch.equal(self.home, row.home[:full]))
        return row.derived[key]

    def extend(self, row: PreparedRow, kv_cache: torch.Tensor, layout: PageLayout,
               rotate: Rotate, kernel: PagedKernel, block_size: int) -> None:
        """Append the row's real keys from ``covered`` on."""
        key = ("extend", self.covered, self.count)
        if key not in row.derived:
            row.derived[key] = _new_keys(row, self.covered, self.count, block_size)
        new, first, moves, slots, at = row.derived[key]
        if new.numel():
            picked = layout.tokens_at(kv_cache, *at)
            if picked is not None:
                k, v = picked
            else:  # whole pages, then the rows
                keys, values = token_rows(layout, kv_cache.index_select(0, row.blocks[first:]))
                local = new - first * block_size
                k, v = keys.index_select(0, local), values.index_select(0, local)
            rotate(k, moves)
            need = self.count + new.numel()
            pages = -(-need // block_size)
            if pages > self.pages.shape[0]:  # room for what follows: decode appends one a step
                # zeros, as vLLM's own cache: the kernel reads a page's unwritten tail in whole
                # tiles, and a 0 weight times garbage (NaN) is NaN
                grown = torch.zeros(max(pages, 2 * self.pages.shape[0], 2),
                                    *self.pages.shape[1:], dtype=self.pages.dtype)
                used = -(-self.count // block_size)
                grown[:used] = self.pages[:used]
                self.pages = grown
            kernel.write(k, v, self.pages, slots)
            self.count = need
        self.covered = row.keys
        if "state" not in row.derived:  # one pair for every layer's copy (never written to)
            full = -(-row.keys // block_size)
            row.derived["state"] = (row.blocks[:full].clone(), row.home[:full].clone())
        self.blocks, self.home = row.derived["state"]

    def attend(self, query: torch.Tensor, row: PreparedRow, rotate: Rotate, kernel: PagedKernel,
               output: torch.Tensor) -> None:
        """``output`` of the row's plain queries: vLLM's kernel over the copy's pages."""
        key = ("attend", self.pages.shape[0], getattr(kernel, "window", -1))
        if key not in row.derived:
            table = torch.arange(self.pages.shape[0], dtype=torch.int32).expand(
                row.plain_seq_lens.numel(), -1)
            rows = row.queries[row.plain]
            # consecutive rows (a decode step, a question): read and written as slices
            first, last = int(rows[0]), int(rows[-1]) + 1
            span = (first, last) if last - first == rows.numel() and bool(
                (rows[1:] > rows[:-1]).all()) else None
            row.derived[key] = (rows, span, row.query_moves[row.plain], table,
                                kernel.schedule(row.plain_qsl, row.plain_seq_lens))
        rows, span, moves, table, scheduler = row.derived[key]
        q = (query[rows] if span is None  # a fresh tensor either way
             else query[span[0]:span[1]].clone(memory_format=torch.contiguous_format))
        rotate(q, moves)
        out = None if span is None else output[span[0]:span[1]]
        direct = out is not None and out.dtype == q.dtype and out.is_contiguous()
        if not direct:
            out = torch.empty_like(q)
        kernel.attend(q, self.pages, row.plain_qsl, row.plain_seq_lens, table, scheduler, out)
        if not direct:
            output[rows] = out.to(output.dtype)


def _new_keys(row: PreparedRow, covered: int, count: int, block_size: int
              ) -> tuple:
    """What a copy that looked at keys ``0 .. covered - 1`` and holds ``count`` appends now:
    ``(new, first, moves, slots, (blocks, offsets))`` — the new real keys, the first block
    holding one, their moves, their slots in the copy, and where each sits in the cache (the
    same in every layer)."""
    new = row.real_keys[row.real_keys >= covered]
    return (new, covered // block_size, row.key_moves[new],
            torch.arange(count, count + new.numel()),
            (row.blocks[new // block_size], new % block_size))


def attend(rows: list[PreparedRow], query: torch.Tensor, kv_cache: torch.Tensor,
           layout: PageLayout, rotate: Rotate, kernel: PagedKernel, scale: float,
           output: torch.Tensor, kept: dict[str, KeptKeys] | None = None,
           kept_cap_bytes: int = 0, window: int = 0, softcap: float = 0.0,
           sinks: torch.Tensor | None = None) -> None:
    """One layer: ``kv_cache`` ``[blocks, heads, 2 * bs, D]`` is its cache; writes the
    ``output`` rows of every prepared row. ``kept``: this layer's kept keys by request (entries
    of requests not in this step are dropped), at most ``kept_cap_bytes`` in all. ``window``:
    the layer's sliding window in real tokens (0: none; a query at logical position ``p`` sees
    keys at ``p - window < position <= p``, docs/design.md §2); ``softcap``: its logit
    soft-cap (0: none); ``sinks``: its learned per-head sink logits (GPT-OSS; None: none), one
    more logit in every query's softmax that takes weight and gives no value. The kept copy's
    plain queries get all three from vLLM's kernel, which ``kernel`` binds to the layer: the
    copy holds real keys in logical order, so the kernel's window over it is the window in real
    tokens."""
    heads = query.shape[1]
    kv_heads, d = kv_cache.shape[1], kv_cache.shape[3]
    bs = layout.block_size
    if kept is not None:
        step = {row.request for row in rows}
        for gone in [r for r in kept if r not in step]:
            del kept[gone]
    for row in rows:
        if row.layout.numel():  # a layout query sees only itself: its own value
            blocks, offsets = row.blocks[row.layout_keys // bs], row.layout_keys % bs
            picked = layout.tokens_at(kv_cache, blocks, offsets)
            if picked is None:  # whole pages, then the rows
                keys, values = token_rows(layout, kv_cache.index_select(0, blocks))
                at = torch.arange(blocks.numel())
                picked = (keys.view(-1, bs, kv_heads, d)[at, offsets],
                          values.view(-1, bs, kv_heads, d)[at, offsets])
            own = picked[1].repeat_interleave(heads // kv_heads, dim=1)
            if sinks is not None:
                own = _beside_sinks(query[row.queries[row.layout]], picked[0], own, sinks,
                                    scale, softcap)
            output[row.queries[row.layout]] = own.to(output.dtype)
        for which, lo, hi, mask in row.other_groups:
            if window:
                mask = _windowed(row, which, lo, hi, mask, window)
            first = lo // bs
            keys, values = token_rows(
                layout, kv_cache.index_select(0, row.blocks[first:-(-hi // bs)]))
            at = lo - first * bs
            k = keys[at:at + hi - lo].contiguous()
            rotate(k, row.key_moves[lo:hi])
            _attend_rows(query, row, which, k, values[at:at + hi - lo], mask, rotate, scale,
                         heads, output, softcap, sinks)
        if not row.plain.numel():
            continue
        copy = None if kept is None or row.request is None else kept.get(row.request)
        if copy is None or not copy.valid_for(row, bs):
            copy = KeptKeys(kv_heads, d, bs, kv_cache.dtype)
        copy.extend(row, kv_cache, layout, rotate, kernel, bs)
        if kept is not None and row.request is not None:
            kept.pop(row.request, None)
            if sum(c.nbytes for c in kept.values()) + copy.nbytes <= kept_cap_bytes:
                kept[row.request] = copy
        copy.attend(query, row, rotate, kernel, output)


def _windowed(row: PreparedRow, which: torch.Tensor, lo: int, hi: int, mask: torch.Tensor,
              window: int) -> torch.Tensor:
    """``mask`` of a group of other queries narrowed to a sliding window in real tokens (one per
    window and group, shared by the layers of that window)."""
    key = ("window", window, lo, hi, id(which))
    if key not in row.derived:
        queries = row.positions[row.own[which]]
        near = row.positions[lo:hi][None, :] > queries[:, None] - window
        row.derived[key] = mask & near
    return row.derived[key]


def _beside_sinks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  sinks: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """A layout query's output where a sink logit shares its softmax: its own value weighted by
    ``sigmoid(score - sink)``, per head. ``query`` (rotated by the model at its physical
    position) and ``key`` (written this step at the same position) give the score directly:
    RoPE at one position cancels in the dot product."""
    heads, d = query.shape[1], query.shape[2]
    k = key.repeat_interleave(heads // key.shape[1], dim=1).float()
    score = (query.float().view(-1, heads, d) * k).sum(-1) * scale
    if softcap:
        score = torch.tanh(score / softcap) * softcap
    return value.float() * torch.sigmoid(score - sinks.float()[None, :])[..., None]


def _attend_rows(query: torch.Tensor, row: PreparedRow, which: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, mask: torch.Tensor | None, rotate: Rotate, scale: float,
                 heads: int, output: torch.Tensor, softcap: float = 0.0,
                 sinks: torch.Tensor | None = None) -> None:
    """``output`` of the row's queries ``which`` over keys ``k`` (moved) and values ``v``;
    ``softcap``: the layer's logit soft-cap, ``c * tanh(s / c)`` of the scaled scores (0:
    none), as vLLM's kernel applies it."""
    rows = row.queries[which]
    q = query[rows]  # a fresh tensor
    rotate(q, row.query_moves[which])
    kv_heads, d = k.shape[1], k.shape[2]
    q = q.float().view(-1, kv_heads, heads // kv_heads, d)
    scores = torch.einsum("thgd,jhd->hgtj", q, k.float()) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # one more logit per head, dropped after the softmax
        extra = sinks.float().view(kv_heads, heads // kv_heads, 1, 1).expand(
            *scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, extra], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hgtj,jhd->thgd", probs, v.float())
    output[rows] = out.reshape(-1, heads, d).to(output.dtype)
