"""Rule 1 on the CPU: attention for the requests that hold layout tokens.

docs/design.md §2: a span request's SSEP, PDEP and PAD are attended by no query but their own
and take no RoPE position; a span's sink only by its own span. vLLM's C++ CPU kernel attends
every key of a row's range and takes no mask, so these rows (``step_plan.MaskedBatch``) are
attended here. But every query of a span request sees a *causal prefix of a small ordered set of
keys*: the question and the answer see every real key before them; a span's own tokens (its
sink and its text, in a span prefill or computed in a final) see their span's sink and real
keys before them. So each such set is copied, moved to its logical positions, into pages of
vLLM's own layout, and the kernel attends it without a mask (:class:`Selection`):

* the **plain** queries (question, answer) over their request's real keys, kept from step to
  step in the group's pool of pages, all requests of a step in one kernel call per layer
  (``kept_pool``);
* a **span's** own tokens over a copy of its keys made for the step (:class:`StepCopy`);
* a **layout** query gets its own value (what attention over that one key gives, exactly);
* anything else (no query the layout rule makes today, or a windowed layer whose span keys do
  not sit on consecutive positions) with a boolean mask in torch, in chunks of queries whose
  scores fit ``MINIPIC_MASKED_CHUNK_KIB``.

Why: before this, a span's own tokens took the masked path, dense fp32 score matrices of
``queries x keys`` per layer: a span prefill cost 2-4x a plain prompt of the same tokens, and
~1 GiB more at 6k tokens. The kernel over a compact copy does the same arithmetic as a plain
prompt's prefill, plus O(keys) per layer to gather, move and write the copy.

Why the work is split the way it is: everything that depends only on the step — the blocks a row
reads in table order, the move of each key from its home position (where the cache holds it
rotated) to its logical one, each query's move from the physical position the model rotated it
at, the selections, the kernel's rows and indices — is the same in every layer, so
:func:`prepare` and the first layer build it once per step (``PreparedRow.derived``), and a
layer does only its own part: one gather of the keys and values its copies need (through the
page layout vLLM's writer uses, ``cpu_kv_layout``), one call of the model's rotary op on them
(moves by an offset table, as the key shadow does, ``cpu_backend.move_keys``), vLLM's writer and
its kernel. Measured on the 2-core box at one decoding query over 1,100 keys: 0.023 ms against
0.109 ms for the ``einsum`` path. The arithmetic is ``kernels.paged_attention_rope_ref`` with
``key_positions``, which the tests hold the engine to.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from minipic.engine_ext.attention.cpu_kv_layout import PageLayout
from minipic.engine_ext.attention.kept_pool import KeptStep
from minipic.engine_ext.attention.step_plan import MaskedBatch
from minipic.span_contract.env import MASKED_CHUNK_ENV, SPAN_ROWS_ENV

_PREPARED = "masked_rows"  # key of the per-step preparation in MaskedBatch.derived
_KEPT = "kept_pool"  # key of the step's plan of the kept copies

# rotate(x [n, heads, D] in place, moves [n]): the model's rotary op moving each row by its
# offset; ``moves`` are rows of the op's offset table (offset + the table's shift,
# ``cpu_backend._offset_table``), so that no layer adds the shift again
Rotate = Callable[[torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class RowSettings:
    """How the masked rows are attended (read once per layer, from the engine's environment).

    ``span_kernel``: a span's own tokens on vLLM's kernel over a copy of their keys (False: the
    masked torch path, kept as the benchmarks' comparison and as the path of queries no causal
    prefix describes); ``chunk_bytes``: score memory of one chunk of queries on the masked
    path, so that its memory is bounded by a constant, not by queries x keys.
    """

    span_kernel: bool = True
    chunk_bytes: int = 64 << 20

    @classmethod
    def from_env(cls) -> RowSettings:
        rows = os.environ.get(SPAN_ROWS_ENV, "kernel").strip().lower() or "kernel"
        if rows not in ("kernel", "masked"):
            raise ValueError(f"{SPAN_ROWS_ENV}={rows!r}: expected 'kernel' or 'masked'")
        raw = os.environ.get(MASKED_CHUNK_ENV, "").strip()
        kib = int(raw) if raw else cls.chunk_bytes >> 10
        if kib <= 0:
            raise ValueError(f"{MASKED_CHUNK_ENV}={raw!r}: expected a positive number of KiB")
        return cls(span_kernel=rows == "kernel", chunk_bytes=kib << 10)


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
class Selection:
    """Queries of a row that each see a causal prefix of one ordered list of the row's keys.

    That is what vLLM's kernel computes without a mask over a copy of those keys (in pages of
    its own layout, moved to their logical positions): rows of consecutive prefix ends, a row's
    ``seq_len`` the length of its last query's prefix. Two kinds: the **plain** queries (the
    question, the answer) over the request's real keys, kept from step to step
    (``kept_pool``); a **span's** own tokens over that span's sink and real keys, built for
    the step (docs/design.md §2: a causal prefix once the SSEP and pads are left out).
    """

    name: object  # what the row's derived entries of this selection are keyed by
    queries: torch.Tensor  # [q] int64: indices of the row's queries
    keys: torch.Tensor  # [m] int64: the keys they see, in order (row key indices)
    qsl: torch.Tensor  # [runs + 1] int32: the queries as the kernel's rows
    seq_lens: torch.Tensor  # [runs] int32
    # the keys sit on consecutive logical positions, so the kernel's sliding window over the
    # copy (by index) is the window in real tokens; else a windowed layer masks them instead
    consecutive: bool = True


@dataclass
class PreparedRow:
    """One kernel row of a masked request, ready for any layer of the group.

    Its queries split in three: the **plain** ones (real tokens outside any span: the question,
    the answer being generated) see exactly the request's real keys up to themselves; a span's
    own tokens (its sink's and its real tokens, in a span prefill or computed in a final) see
    exactly their span's sink and real keys up to themselves: both run vLLM's kernel over a
    compact copy of those keys (:class:`Selection`). A **layout** query sees only itself, so its
    output is its own value (what attention over that one key gives, exactly). Any other query
    (none that the layout rule makes today) attends with a mask, in chunks of bounded memory
    (:func:`_key_ranges`, :func:`_attend_rows`).
    """

    queries: torch.Tensor  # [q] int64: the row's query rows in the step
    blocks: torch.Tensor  # [ceil(n / bs)] int64: the physical blocks it reads, in table order
    keys: int  # n: its keys are tokens 0 .. n - 1 of those blocks
    key_moves: torch.Tensor  # [n] int64: logical minus home position of each key (+ shift)
    query_moves: torch.Tensor  # [q] int64: logical minus physical position of each (+ shift)
    plain: Selection  # the plain queries over the request's real keys (the kept copy)
    spans: list[Selection]  # each span's own tokens over its sink and real keys
    # the queries no causal prefix describes, by the first key they may see, each group with
    # the key range [lo, hi) it reads and its mask over that range
    other_groups: list[tuple[torch.Tensor, int, int, torch.Tensor]]
    layout: torch.Tensor  # [q_layout] int64: indices of the layout queries
    layout_keys: torch.Tensor  # [q_layout] int64: their own keys
    request: str | None  # the request (its kept copy is shared by all its rows of a step)
    home: torch.Tensor  # [ceil(n / bs)] int64: the home slot of each block
    positions: torch.Tensor  # [n] int64: each key's logical position (-1: a layout key)
    own: torch.Tensor  # [q] int64: each query's own key
    sink: torch.Tensor | None  # [n] bool: the keys of span sinks (None: none)
    isolated: torch.Tensor  # [q] bool: the queries inside an SSEP-led segment
    key_start: torch.Tensor | None  # [q] int64: each query's first visible key (None: 0)
    # what every layer's copies derive alike (indices, the kernel's metadata), built by the
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
        sink = None if batch.key_sink is None else batch.key_sink[r, :seq_len]
        starts = (torch.zeros(q1 - q0, dtype=torch.long) if batch.key_start is None
                  else batch.key_start[q0:q1])
        isolated = starts > 0 if batch.query_isolated is None else batch.query_isolated[q0:q1]
        shown = logical >= 0
        real = shown if sink is None else shown & ~sink
        is_plain = real[q_index] & ~isolated & (starts == 0)
        is_layout = ~shown[q_index]
        plain = is_plain.nonzero().flatten()
        real_keys = real.nonzero().flatten()
        plain_qsl, plain_lens = _runs(torch.cumsum(real.long(), 0)[q_index[plain]] - 1)
        spans, others = _span_selections((~is_plain & ~is_layout).nonzero().flatten(), q_index,
                                         starts, isolated, shown, sink, logical)
        rows.append(PreparedRow(
            queries=batch.rows[q0:q1], blocks=blocks, keys=seq_len,
            key_moves=logical.clamp(min=0) - home_pos - j % block_size + shift,
            query_moves=batch.query_shift[q0:q1] + shift,
            plain=Selection("plain", plain, real_keys, plain_qsl, plain_lens),
            spans=spans,
            other_groups=_key_ranges(
                others, q_index[others], None if batch.key_start is None else starts[others],
                _mask(q_index[others], logical, None if batch.key_start is None
                      else starts[others], sink, isolated[others]))
            if others.numel() else [],
            layout=is_layout.nonzero().flatten(), layout_keys=q_index[is_layout],
            request=batch.requests[r] if batch.requests else None, home=home,
            positions=logical, own=q_index, sink=sink, isolated=isolated,
            key_start=None if batch.key_start is None else starts))
    batch.derived[_PREPARED] = rows
    if batch.kept is not None:
        batch.derived[_KEPT] = batch.kept.plan(rows)
    return rows


def kept_step(batch: MaskedBatch) -> KeptStep | None:
    """The step's plan of the kept copies (after :func:`prepare`; None: no pool)."""
    return batch.derived.get(_KEPT)


def _span_selections(which: torch.Tensor, own: torch.Tensor, starts: torch.Tensor,
                     isolated: torch.Tensor, shown: torch.Tensor, sink: torch.Tensor | None,
                     logical: torch.Tensor) -> tuple[list[Selection], torch.Tensor]:
    """The queries ``which`` (neither plain nor layout) as :class:`Selection` s where they see a
    causal prefix of one key list, and those that do not (left to the mask).

    A group of queries with one first key ``lo`` and one isolation sees, of the keys from
    ``lo`` on, the shown ones (no layout key) that are no sink, or, inside a span, its sink
    too: the same list for every query of the group, each seeing it up to its own key. Why
    this matters: a span's own tokens were attended with dense fp32 score matrices in torch,
    ``queries x keys`` of memory and time per layer, 2-4x a plain prompt's prefill."""
    if not which.numel():
        return [], which
    groups: dict[tuple[int, bool], list[int]] = {}
    for i, lo, inside in zip(which.tolist(), starts[which].tolist(),
                             isolated[which].tolist(), strict=True):
        groups.setdefault((lo, inside), []).append(i)
    selections, left = [], []
    for (lo, inside), members in sorted(groups.items()):
        queries = torch.tensor(members, dtype=torch.long)
        ends = own[queries]
        seen = shown[lo:int(ends.max()) + 1]
        if sink is not None and not inside:
            seen = seen & ~sink[lo:lo + seen.numel()]
        index = torch.cumsum(seen.long(), 0) - 1  # each key's index in the list
        local = ends - lo
        if not bool(seen[local].all()):  # a query whose own key is not in the list
            left.extend(members)
            continue
        keys = seen.nonzero().flatten() + lo
        at = logical[keys]
        qsl, seq_lens = _runs(index[local])
        selections.append(Selection(
            ("span", lo, inside), queries, keys, qsl, seq_lens,
            consecutive=bool((at[1:] - at[:-1] == 1).all()) if keys.numel() > 1 else True))
    return selections, torch.tensor(left, dtype=torch.long)


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


class StepCopy:
    """A :class:`Selection`'s keys (moved to their logical positions) and values, in order, in
    pages of vLLM's layout, built for one step in one layer: what its queries attend over with
    vLLM's kernel. A span's own tokens always use one (their span is computed in this step); the
    plain queries use the kept copies of ``kept_pool`` and one of these only when their request
    holds no blocks reserved for its copy.

    Why it is exact: each key is read from the cache, moved by the model's rotary op by its
    offset, and written by vLLM's writer, as a kept copy's keys are, so a query's answer does
    not depend on which copy it read.
    """

    def __init__(self, row: PreparedRow, selection: Selection, kv_cache: torch.Tensor,
                 layout: PageLayout, rotate: Rotate, kernel: PagedKernel) -> None:
        bs = layout.block_size
        key = ("copy", selection.name)
        if key not in row.derived:  # the same in every layer
            keys = selection.keys
            row.derived[key] = (row.blocks[keys // bs], keys % bs, row.key_moves[keys],
                                torch.arange(keys.numel()), {})
        blocks, offsets, moves, slots, derived = row.derived[key]
        # zeros, as vLLM's own cache: the kernel reads a page's unwritten tail in whole tiles,
        # and a 0 weight times garbage (NaN) is NaN
        self.pages = torch.zeros(max(-(-slots.numel() // bs), 1), kv_cache.shape[1], 2 * bs,
                                 kv_cache.shape[3], dtype=kv_cache.dtype)
        if slots.numel():
            k, v = _tokens(layout, kv_cache, blocks, offsets, derived)
            rotate(k, moves)
            kernel.write(k, v, self.pages, slots)

    def attend(self, query: torch.Tensor, row: PreparedRow, selection: Selection,
               rotate: Rotate, kernel: PagedKernel, output: torch.Tensor) -> None:
        """``output`` of the selection's queries: vLLM's kernel over the copy's pages."""
        key = ("attend", selection.name, getattr(kernel, "window", -1))
        if key not in row.derived:
            table = torch.arange(self.pages.shape[0], dtype=torch.int32).expand(
                selection.seq_lens.numel(), -1)
            rows = row.queries[selection.queries]
            # consecutive rows (a decode step, a question, a span): read and written as slices
            first, last = int(rows[0]), int(rows[-1]) + 1
            span = (first, last) if last - first == rows.numel() and bool(
                (rows[1:] > rows[:-1]).all()) else None
            row.derived[key] = (rows, span, row.query_moves[selection.queries], table,
                                kernel.schedule(selection.qsl, selection.seq_lens))
        rows, span, moves, table, scheduler = row.derived[key]
        q = (query[rows] if span is None  # a fresh tensor either way
             else query[span[0]:span[1]].clone(memory_format=torch.contiguous_format))
        rotate(q, moves)
        out = None if span is None else output[span[0]:span[1]]
        direct = out is not None and out.dtype == q.dtype and out.is_contiguous()
        if not direct:
            out = torch.empty_like(q)
        kernel.attend(q, self.pages, selection.qsl, selection.seq_lens, table, scheduler, out)
        if not direct:
            output[rows] = out.to(output.dtype)


def attend(rows: list[PreparedRow], query: torch.Tensor, kv_cache: torch.Tensor,
           layout: PageLayout, rotate: Rotate, kernel: PagedKernel, scale: float,
           output: torch.Tensor, kept: KeptStep | None = None, window: int = 0,
           softcap: float = 0.0,
           sinks: torch.Tensor | None = None, settings: RowSettings = RowSettings()) -> None:
    """One layer: ``kv_cache`` ``[blocks, heads, 2 * bs, D]`` is its cache; writes the
    ``output`` rows of every prepared row. ``kept``: the step's plan of the kept copies
    (``kept_pool.KeptPool.plan``; they lie in ``kv_cache``, in blocks reserved for them; None:
    every row's plain queries over a copy built for the step). ``window``: the layer's sliding
    window in real tokens (0: none; a query at logical position ``p`` sees keys at
    ``p - window < position <= p``, docs/design.md §2); ``softcap``: its logit soft-cap (0:
    none); ``sinks``: its learned per-head sink logits (GPT-OSS; None: none), one more logit in
    every query's softmax that takes weight and gives no value. Queries on vLLM's kernel get
    all three from it, which ``kernel`` binds to the layer: a copy holds keys in logical order,
    so the kernel's window over it is the window in real tokens."""
    heads = query.shape[1]
    kv_heads = kv_cache.shape[1]
    bs = layout.block_size
    for row in rows:
        if row.layout.numel():  # a layout query sees only itself: its own value
            blocks, offsets = row.blocks[row.layout_keys // bs], row.layout_keys % bs
            k, v = _tokens(layout, kv_cache, blocks, offsets)
            own = v.repeat_interleave(heads // kv_heads, dim=1)
            if sinks is not None:
                own = _beside_sinks(query[row.queries[row.layout]], k, own, sinks, scale,
                                    softcap)
            output[row.queries[row.layout]] = own.to(output.dtype)
        groups = row.other_groups
        for span in row.spans:
            if not settings.span_kernel or (window and not span.consecutive):
                # (a windowed layer: the kernel's window would count copy slots, not positions)
                groups = [*groups, *_masked_group(row, span)]
                continue
            StepCopy(row, span, kv_cache, layout, rotate, kernel).attend(
                query, row, span, rotate, kernel, output)
        for which, lo, hi, mask in groups:
            if window:
                mask = _windowed(row, which, lo, hi, mask, window)
            first = lo // bs
            keys, values = token_rows(
                layout, kv_cache.index_select(0, row.blocks[first:-(-hi // bs)]))
            at = lo - first * bs
            k = keys[at:at + hi - lo].contiguous()
            rotate(k, row.key_moves[lo:hi])
            _attend_rows(query, row, which, k, values[at:at + hi - lo], mask, rotate, scale,
                         heads, output, softcap, sinks, settings.chunk_bytes)
    if kept is not None:
        _attend_kept(kept, query, kv_cache, layout, rotate, kernel, output)
    for index in (kept.transient if kept is not None else range(len(rows))):
        row = rows[index]
        if row.plain.queries.numel():  # no room in the pool: a copy for this step
            StepCopy(row, row.plain, kv_cache, layout, rotate, kernel).attend(
                query, row, row.plain, rotate, kernel, output)


def _attend_kept(step: KeptStep, query: torch.Tensor, kv_cache: torch.Tensor,
                 layout: PageLayout, rotate: Rotate, kernel: PagedKernel,
                 output: torch.Tensor) -> None:
    """The pooled rows' plain queries, all requests at once: their new keys into their copies'
    blocks of the same cache (one gather, one rotation, one write), then one call of vLLM's
    kernel."""
    if step.blocks.numel():
        k, v = _tokens(layout, kv_cache, step.blocks, step.offsets, step.derived)
        rotate(k, step.key_moves)
        kernel.write(k, v, kv_cache, step.slots)
    if not step.rows.numel():
        return
    key = ("schedule", getattr(kernel, "window", -1))
    if key not in step.derived:
        step.derived[key] = kernel.schedule(step.qsl, step.seq_lens)
    q = query[step.rows]  # a fresh tensor
    rotate(q, step.query_moves)
    out = torch.empty_like(q)
    kernel.attend(q, kv_cache, step.qsl, step.seq_lens, step.table, step.derived[key], out)
    output[step.rows] = out.to(output.dtype)


def _tokens(layout: PageLayout, kv_cache: torch.Tensor, blocks: torch.Tensor,
            offsets: torch.Tensor, derived: dict | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[n, heads, D]`` of the tokens ``(blocks[i], offsets[i])``: one gather
    each where the page layout allows, else whole pages brought to token order, then the rows
    (``derived``: where the step keeps the index of the latter, the same in every layer)."""
    picked = layout.tokens_at(kv_cache, blocks, offsets)
    if picked is not None:
        return picked
    derived = {} if derived is None else derived
    if "pages" not in derived:
        unique, inverse = torch.unique(blocks, return_inverse=True)
        derived["pages"] = (unique, inverse * layout.block_size + offsets)
    unique, local = derived["pages"]
    keys, values = token_rows(layout, kv_cache.index_select(0, unique))
    return keys.index_select(0, local), values.index_select(0, local)


def _masked_group(row: PreparedRow, span: Selection
                  ) -> list[tuple[torch.Tensor, int, int, torch.Tensor]]:
    """A span selection as masked groups (a windowed layer whose keys are not on consecutive
    positions: the window must count positions, not copy slots)."""
    key = ("masked", span.name)
    if key not in row.derived:
        own = row.own[span.queries]
        starts = None if row.key_start is None else row.key_start[span.queries]
        row.derived[key] = _key_ranges(span.queries, own, starts, _mask(
            own, row.positions, starts, row.sink, row.isolated[span.queries]))
    return row.derived[key]


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
                 sinks: torch.Tensor | None = None, chunk_bytes: int = 64 << 20) -> None:
    """``output`` of the row's queries ``which`` over keys ``k`` (moved) and values ``v``, in
    chunks of queries whose fp32 scores (and the probabilities made of them) fit
    ``chunk_bytes``; ``softcap``: the layer's logit soft-cap, ``c * tanh(s / c)`` of the scaled
    scores (0: none), as vLLM's kernel applies it."""
    kv_heads, d = k.shape[1], k.shape[2]
    per_query = 2 * heads * (k.shape[0] + 1) * 4  # scores and probabilities, fp32
    step = max(1, chunk_bytes // per_query)
    keys, values = k.float(), v.float()
    for lo in range(0, which.numel(), step):
        part = which[lo:lo + step]
        rows = row.queries[part]
        q = query[rows]  # a fresh tensor
        rotate(q, row.query_moves[part])
        q = q.float().view(-1, kv_heads, heads // kv_heads, d)
        scores = torch.einsum("thgd,jhd->hgtj", q, keys) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        if mask is not None:
            scores = scores.masked_fill(~mask[lo:lo + step], float("-inf"))
        if sinks is not None:  # one more logit per head, dropped after the softmax
            extra = sinks.float().view(kv_heads, heads // kv_heads, 1, 1).expand(
                *scores.shape[:-1], 1)
            probs = torch.softmax(torch.cat([scores, extra], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("hgtj,jhd->thgd", probs, values)
        output[rows] = out.reshape(-1, heads, d).to(output.dtype)
