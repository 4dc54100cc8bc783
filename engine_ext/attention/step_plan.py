"""One step of the position-free CPU backend, planned once and shared by every layer.

What a step needs beyond vLLM's CPU attention metadata (``engine_ext/attention/cpu_backend.py``
runs it):

* the logical position of every new token (``seq_len - query_len + t``) and where it is written;
* which physical block sits at which *home* slot (the table slot whose positions its cached
  keys were rotated at, ``HomeSlots``): a request reading every block at home runs vLLM's own
  kernel on the stock page unchanged, and a block read elsewhere is rotated by the slot
  difference;
* the requests that read some block off home, with the key-shadow pages to (re)build this step
  (``engine_ext/attention/key_shadow/pool.py`` indexes them), in chunks that read each block at one
  slot and fit the pool's cap;
* span isolation (``engine_ext/attention/span_isolation.py``): each run of a request's queries with
  one ``key_start`` becomes its own kernel row whose table starts at that key's block;
* rule 1 (docs/design.md §2): the requests that hold layout tokens need a key mask, which vLLM's
  kernel lacks, so they leave the kernel batches for :class:`MaskedBatch`
  (``engine_ext/attention/masked_rows.py`` attends them).

Invariants: a block is written by one request at one table slot per step (only full blocks are
shared), so one home slot per block describes the keys of every layer of the group; a shadow
page depends only on (slot, block content), so it is valid until its block is written; a kernel
call reads each block at one slot (its chunk's shadow page) or from private scratch; kernel
rows keep the step's token order, so query rows need no permutation. Pure torch: no vLLM import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from minipic.engine_ext.attention.key_shadow.pool import KeyShadowIndex

if TYPE_CHECKING:
    from minipic.engine_ext.attention.kept_pool import KeptPool
    from minipic.engine_ext.attention.span_isolation import SpanView


@dataclass
class SubBatch:
    """Some of the step's requests, re-indexed for one call of the C++ kernel."""

    rows: torch.Tensor  # [T] int64: query rows of these requests in the step's batch
    query_start_loc: torch.Tensor  # [S + 1] int32, local
    seq_lens: torch.Tensor  # [S] int32
    block_table: torch.Tensor  # [S, max_blocks] int32 (physical, or a private chunk's scratch)
    scheduler_metadata: torch.Tensor | None  # C++ kernel work split for this sub-batch


@dataclass
class OffHomeBatch(SubBatch):
    """The requests of one step that read some block away from its home slot.

    Their keys come from the layer's key shadow (``engine_ext/attention/key_shadow/pages.py``),
    where each block read sits at its own index moved to the slot it is read at, and their values
    from the KV cache in place, so ``block_table`` is the physical one. A *private* chunk (a request
    reading one block at two slots) instead attends a scratch copy of its ``scratch_pages`` pages,
    keys and values, and ``block_table`` indexes that copy.
    """

    fill: RotatedFill | None  # key pages to (re)build before attending, after the writes
    release: list[int]  # shadow pages to give back before the fill (evicted blocks)
    scratch_pages: int  # 0: keys from the shadow; else a private chunk's page count
    global_block_table: torch.Tensor  # [S, max_blocks] int32, physical (torch path)


@dataclass
class MaskedBatch:
    """The requests of one step that hold layout tokens (rule 1, docs/design.md §2), attended
    with a key mask: vLLM's C++ kernel reads every key of a row's range and has none.

    One row per run of a request's consecutive positions (a hole; usually the whole step of the
    request), in token order. Keys are read from the cache at their home slots; the row's
    ``key_positions`` say where RoPE puts each key (-1: a layout key, seen by no other query)
    and ``query_shift`` where each query moves (logical minus physical position); ``key_sink``
    marks the keys of span sinks, seen only by the ``query_isolated`` rows (None: no sink).
    """

    rows: torch.Tensor  # [T] int64: query rows of these requests in the step's batch
    query_start_loc: torch.Tensor  # [R + 1] int32, local
    seq_lens: torch.Tensor  # [R] int32: a row's keys are 0 .. its last position
    block_table: torch.Tensor  # [R, max_blocks] int32, physical
    key_positions: torch.Tensor  # [R, W] int64
    query_shift: torch.Tensor  # [T] int64
    key_start: torch.Tensor | None  # [T] int64 (None: 0)
    key_sink: torch.Tensor | None = None  # [R, W] bool
    query_isolated: torch.Tensor | None = None  # [T] bool
    # the request of each row (None: unknown, nothing kept); a request's rows share one copy
    requests: list[str | None] = dataclasses.field(default_factory=list)
    kept: KeptPool | None = None  # the group's pool of kept copies (None: a copy per step)
    # what every layer of the step shares, built by the first (``attention/masked_rows.py``)
    derived: dict = dataclasses.field(default_factory=dict)


class HomeSlots:
    """Block-table slot at which each physical block's cached keys were rotated (-1: never).

    One instance per KV-cache group: all layers of a group share block ids, and every layer
    writes the same tokens in the same step, so one table describes the keys of all of them.
    With the page's keys stored once, rotated at home, this table is what makes them
    position-free: a block's keys at any slot are its home keys moved by the difference.
    """

    def __init__(self, num_blocks: int) -> None:
        self.slot = torch.full((max(num_blocks, 1),), -1, dtype=torch.int32)

    def _ensure(self, max_block: int) -> None:
        if max_block >= self.slot.numel():
            grown = torch.full((max(max_block + 1, 2 * self.slot.numel()),), -1,
                               dtype=torch.int32)
            grown[: self.slot.numel()] = self.slot
            self.slot = grown

    def record_writes(self, blocks: torch.Tensor, positions: torch.Tensor,
                      block_size: int) -> None:
        """A token at logical ``pos`` written into ``block`` puts it at table slot ``pos // bs``.

        All tokens of a block are written by one request at one table slot (only full blocks
        are shared), so the last write of a step describes the whole block.
        """
        if blocks.numel() == 0:
            return
        self._ensure(int(blocks.max()))
        self.slot[blocks] = torch.div(positions, block_size, rounding_mode="floor").to(
            torch.int32
        )

    def slots_of(self, blocks: torch.Tensor) -> torch.Tensor:
        """Home slot of each of ``blocks`` (-1: never written)."""
        if blocks.numel():
            self._ensure(int(blocks.max()))
        return self.slot[blocks]

    def requests_off_home(self, block_table: torch.Tensor, seq_lens: torch.Tensor,
                          block_size: int, slot_offset: torch.Tensor | None = None
                          ) -> torch.Tensor:
        """Bool ``[num_reqs]``: request reads at least one block away from its home slot.

        ``slot_offset[i]``: the table slot that column 0 of row ``i`` stands for (a row of an
        isolated segment starts at its SSEP block; None: every row starts at slot 0).
        """
        num_blocks = torch.div(seq_lens + block_size - 1, block_size, rounding_mode="floor")
        width = int(num_blocks.max()) if num_blocks.numel() else 0
        if width == 0:
            return torch.zeros(seq_lens.shape, dtype=torch.bool)
        table = block_table[:, :width].long()
        self._ensure(int(table.max()))
        col = torch.arange(width, dtype=torch.int32).unsqueeze(0)
        if slot_offset is not None:
            col = col + slot_offset.to(torch.int32).unsqueeze(1)
        at_home = self.slot[table] == col
        used = torch.arange(width).unsqueeze(0) < num_blocks.unsqueeze(1)
        return (used & ~at_home).any(dim=1)


@dataclass
class RotatedFill:
    """Key pages a chunk (re)builds: ``target[dest] = keys of block`` moved to the read slot.

    The target is the key shadow (``dest`` = the blocks themselves) or a private chunk's scratch
    pages (``dest`` = table columns). Blocks read at their home slot are copied (their keys are
    already rotated there); the others get their home keys rotated by ``offsets``, the slot
    difference in tokens (``(slot - home) * block_size``, the same for every key of a block).
    """

    copy_blocks: torch.Tensor  # [H] int64 blocks whose keys are copied
    copy_dest: torch.Tensor  # [H] int64 where
    blocks: torch.Tensor  # [F] int64 blocks whose home keys are rotated
    offsets: torch.Tensor  # [F] int64 positions to move each block's keys by
    dest: torch.Tensor  # [F] int64 where
    # per (dtype, block size): tables the layers derive from ``offsets`` once per step
    derived: dict = dataclasses.field(default_factory=dict)


@dataclass
class StepPlan:
    """What the position-free layers need per step, beyond vLLM's CPU metadata."""

    positions: torch.Tensor  # [num_tokens] int64 logical positions of the new tokens
    write_rows: torch.Tensor | None  # rows that have a cache slot (None: all rows)
    write_slots: torch.Tensor  # [W] int64 cache slots of those rows
    write_blocks: torch.Tensor  # [W] int64 physical block of each slot
    write_offsets: torch.Tensor  # [W] int64 offset in block
    write_positions: torch.Tensor  # [W] int64 logical positions of those rows
    # requests that read some block off its home slot, in chunks that each read a block at one
    # slot and fit the pool's cap (one chunk unless the step's requests disagree or exceed it)
    off_home_chunks: list[OffHomeBatch]
    home: SubBatch | None  # with off_home: the other requests (None: every request is home)
    key_start: torch.Tensor | None = None  # [num_tokens] first visible key (None: causal)
    masked: MaskedBatch | None = None  # requests with layout tokens (rule 1)
    release_pool: bool = False  # the pool was released (idle): layers free their pages
    home_slots: torch.Tensor | None = None  # HomeSlots.slot after this step's writes

    @property
    def off_home(self) -> OffHomeBatch | None:
        """The first (usually only) off-home chunk."""
        return self.off_home_chunks[0] if self.off_home_chunks else None


ScheduleFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def plan_step(home: HomeSlots, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
              block_table: torch.Tensor, slot_mapping: torch.Tensor, block_size: int,
              path: str, scheduler_metadata: ScheduleFn | None,
              rotated: KeyShadowIndex | None = None,
              key_start: torch.Tensor | None = None,
              positions: torch.Tensor | None = None,
              view: SpanView | None = None, kept: KeptPool | None = None) -> StepPlan:
    """Positions, home-slot bookkeeping and the off-home sub-batch of one step.

    ``query_start_loc`` / ``seq_lens`` / ``block_table`` cover exactly the step's requests and
    ``slot_mapping`` its tokens. ``scheduler_metadata(qsl, seq_lens)`` builds the C++ kernel's
    work split for a sub-batch (None for the pure-torch path). ``rotated`` is the group's
    key shadow (kept across steps; a fresh one when None). ``key_start[t]`` is the first
    key token ``t`` may attend to (span isolation, ``engine_ext/attention/span_isolation.py``; None:
    all causal): the C++ kernel has no such mask, so each run of a request's queries with one
    ``key_start`` becomes its own kernel row whose table starts at that key's block
    (:func:`_isolated_rows`); RoPE is relative and keys are rotated by their true slot, so
    the shifted row computes exactly the masked attention.

    ``positions``: the logical position of every token when some request's step computes
    several holes (``engine_ext/holes/worker_positions.py``; None: each request is one window ending
    at its ``seq_len``). Rows are then also split where positions jump, one per hole, each reading
    keys up to its own last token.

    ``view``: the step's span view (``span_isolation.step_span_view``). Its ``masked`` requests
    (layout tokens among their keys) go to :class:`MaskedBatch`, attended with a key mask; the
    plan above covers the others, whose ``key_start`` is then 0 (a nonzero one needs an SSEP).
    """
    num_reqs = seq_lens.numel()
    num_tokens = slot_mapping.numel()
    qsl = query_start_loc.long()
    lens = seq_lens.long()
    q_lens = qsl[1:] - qsl[:-1]
    # Logical position of each new token: seq_len - query_len + t (docs/design.md §1).
    gapped = positions is not None
    if positions is None:
        req_of_token = torch.repeat_interleave(torch.arange(num_reqs), q_lens,
                                               output_size=num_tokens)
        positions = (lens - q_lens - qsl[:-1])[req_of_token] + torch.arange(num_tokens)
    else:
        positions = positions.long()
    slots = slot_mapping.long()
    write_rows, write_positions = None, positions
    if bool((slots < 0).any()):  # tokens without a cache slot are not stored
        write_rows = (slots >= 0).nonzero().flatten()
        slots, write_positions = slots[write_rows], positions[write_rows]
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    home.record_writes(blocks, write_positions, block_size)
    rotated = rotated if rotated is not None else KeyShadowIndex()
    if rotated.held:  # an empty pool has nothing to invalidate (every PIC-off step)
        rotated.invalidate(blocks.unique().tolist())
    masked = None
    if view is not None and view.any_masked:
        masked = _masked_batch(view, qsl, lens, block_table, positions)
        masked.kept = kept
        keep = (~view.masked).nonzero().flatten()
        kept_rows = torch.cat([torch.arange(int(qsl[r]), int(qsl[r + 1])) for r in keep.tolist()]
                              + [torch.zeros(0, dtype=torch.long)])
        sub_qsl = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(q_lens[keep], 0)])
        chunks, home_batch, released = _plan_attention(
            home, sub_qsl, lens[keep], block_table[keep], block_size, path, scheduler_metadata,
            rotated, None, positions[kept_rows], gapped)
        for batch in [*chunks, home_batch]:
            if batch is not None:
                batch.rows = kept_rows[batch.rows]
        if home_batch is None:  # the C++ kernel must not see the masked requests
            home_batch = _sub_batch(keep.tolist(), qsl, lens, block_table, scheduler_metadata)
    else:
        chunks, home_batch, released = _plan_attention(
            home, qsl, lens, block_table, block_size, path, scheduler_metadata, rotated,
            key_start, positions, gapped)
        if kept is not None:  # no span request in the step: none keeps a copy
            kept.keep_only(set())
    return StepPlan(positions=positions, write_rows=write_rows, write_slots=slots,
                    write_blocks=blocks, write_offsets=slots - blocks * block_size,
                    write_positions=write_positions, off_home_chunks=chunks, home=home_batch,
                    key_start=key_start, masked=masked, release_pool=released,
                    home_slots=home.slot)


def _plan_attention(home: HomeSlots, qsl: torch.Tensor, lens: torch.Tensor,
                    block_table: torch.Tensor, block_size: int, path: str,
                    scheduler_metadata: ScheduleFn | None, rotated: KeyShadowIndex,
                    key_start: torch.Tensor | None, positions: torch.Tensor, gapped: bool
                    ) -> tuple[list[OffHomeBatch], SubBatch | None, bool]:
    """The kernel calls of requests without a key mask: ``(off-home chunks, home batch,
    pool released)``; ``gapped``: some request computes several holes."""
    if lens.numel() == 0:  # every request of the step is masked
        return [], None, rotated.note_step(False)
    offset = None
    if (key_start is not None or gapped) and path != "torch":
        starts = key_start if key_start is not None else torch.zeros(positions.numel(),
                                                                     dtype=torch.int64)
        qsl, lens, block_table, offset = _isolated_rows(qsl, lens, block_table, positions,
                                                        starts, block_size)
    elif gapped:  # the torch reference masks key_start itself: rows split at gaps only
        qsl, lens, rows_of = gap_rows(qsl, positions)
        lens, block_table = lens.long(), block_table[rows_of]
    if path == "auto":
        off = home.requests_off_home(block_table, lens, block_size, offset)
    else:
        off = torch.ones(lens.numel(), dtype=torch.bool)
    chunks: list[OffHomeBatch] = []
    home_batch = None
    any_off = bool(off.any())
    released = rotated.note_step(any_off)
    if any_off or offset is not None:
        if any_off:
            chunks = _off_home_chunks(off.nonzero().flatten().tolist(), qsl, lens,
                                      block_table, block_size, home, rotated,
                                      None if path == "torch" else scheduler_metadata,
                                      None if offset is None else offset.tolist())
        home_batch = _sub_batch((~off).nonzero().flatten().tolist(), qsl, lens, block_table,
                                scheduler_metadata)
    return chunks, home_batch, released


def _off_home_chunks(reqs: list[int], qsl: torch.Tensor, seq_lens: torch.Tensor,
                     block_table: torch.Tensor, block_size: int, home: HomeSlots,
                     rotated: KeyShadowIndex, scheduler_metadata: ScheduleFn | None,
                     slot_offset: list[int] | None) -> list[OffHomeBatch]:
    """The off-home requests in chunks that each read every block at one slot and hold at most
    the pool's cap of blocks (``engine_ext/attention/key_shadow/pool.py``); one chunk in the usual
    case. A request that reads one block at two slots gets a private chunk."""
    lens = seq_lens.tolist()
    groups: list[list[int]] = []
    private: list[int] = []
    claimed: dict[int, int] = {}  # block -> slot read at, in the chunk being built
    for i in reqs:
        n = -(-lens[i] // block_size)
        shift = slot_offset[i] if slot_offset is not None else 0
        need: dict[int, int] = {}
        for col, block in enumerate(block_table[i, :n].tolist()):
            if need.setdefault(block, shift + col) != shift + col:
                private.append(i)  # the same block at two slots of one row
                break
        else:
            if groups and (any(claimed.get(b, s) != s for b, s in need.items())
                           or (rotated.cap is not None
                               and len(claimed.keys() | need.keys()) > rotated.cap)):
                groups.append([])
                claimed = {}
            if not groups:
                groups.append([])
            groups[-1].append(i)
            claimed.update(need)
    if len(groups) + len(private) > 1:
        rotated.chunked_steps += 1
    chunks = [_off_home_batch(g, qsl, seq_lens, block_table, block_size, home, rotated,
                              scheduler_metadata, slot_offset) for g in groups]
    chunks += [_private_batch(i, qsl, seq_lens, block_table, block_size, home,
                              scheduler_metadata, slot_offset) for i in private]
    return chunks


def _isolated_rows(qsl: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                   positions: torch.Tensor, key_start: torch.Tensor, block_size: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kernel rows for a step with isolated segments: one per run of a request's queries that
    share a ``key_start``, in token order (so query rows need no permutation).

    Row ``k`` covers keys ``key_start .. last query of the run``: its table is the request's
    table from block ``key_start // block_size`` on, its length counts from ``key_start``, and
    ``offset[k]`` says which table slot its column 0 is (home slots and shadow pages
    stay keyed by the true slot). Returns ``(qsl, seq_lens, block_table, offset)``.
    """
    num_tokens = positions.numel()
    q_lens = qsl[1:] - qsl[:-1]
    req_of_token = torch.repeat_interleave(torch.arange(q_lens.numel()), q_lens,
                                           output_size=num_tokens)
    first = torch.ones(num_tokens, dtype=torch.bool)
    first[1:] = ((req_of_token[1:] != req_of_token[:-1]) | (key_start[1:] != key_start[:-1])
                 | (positions[1:] != positions[:-1] + 1))  # a new hole of a request
    starts = first.nonzero().flatten()
    row_qsl = torch.cat([starts, torch.tensor([num_tokens])])
    row_req = req_of_token[starts]
    row_key_start = key_start[starts]
    row_lens = positions[row_qsl[1:] - 1] + 1 - row_key_start
    offset = torch.div(row_key_start, block_size, rounding_mode="floor")
    width = int(torch.div(row_lens + block_size - 1, block_size, rounding_mode="floor").max())
    cols = (offset.unsqueeze(1) + torch.arange(width)).clamp(max=block_table.shape[1] - 1)
    table = torch.gather(block_table[row_req].long(), 1, cols).to(block_table.dtype)
    return row_qsl, row_lens, table, offset


def gap_rows(qsl: torch.Tensor, positions: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One kernel row per run of consecutive positions of a request (its holes), in token
    order, for kernels that read a row's keys from its table's column 0 on (the torch
    reference, the Triton kernel): ``(row query_start_loc, row seq_lens, request of each row)``.
    A row's length is its last position + 1, so its queries are the last of its keys."""
    num_tokens = positions.numel()
    q_lens = (qsl[1:] - qsl[:-1]).long()
    req_of_token = torch.repeat_interleave(torch.arange(q_lens.numel()), q_lens,
                                           output_size=num_tokens)
    first = torch.ones(num_tokens, dtype=torch.bool)
    first[1:] = (req_of_token[1:] != req_of_token[:-1]) | (positions[1:] != positions[:-1] + 1)
    starts = first.nonzero().flatten()
    row_qsl = torch.cat([starts, torch.tensor([num_tokens])]).to(qsl.dtype)
    row_lens = (positions[row_qsl[1:].long() - 1] + 1).to(torch.int32)
    return row_qsl, row_lens, req_of_token[starts]



def _masked_batch(view: SpanView, qsl: torch.Tensor, lens: torch.Tensor,
                  block_table: torch.Tensor, positions: torch.Tensor) -> MaskedBatch:
    """The masked requests' rows (one per hole, :func:`gap_rows`), with their key positions."""
    assert view.masked is not None and view.key_positions is not None
    assert view.query_shift is not None
    reqs = view.masked.nonzero().flatten().tolist()
    rows = torch.cat([torch.arange(int(qsl[r]), int(qsl[r + 1])) for r in reqs])
    sub_qsl = torch.zeros(len(reqs) + 1, dtype=torch.long)
    sub_qsl[1:] = torch.cumsum(qsl[1:][reqs] - qsl[:-1][reqs], 0)
    row_qsl, row_lens, row_req = gap_rows(sub_qsl, positions[rows])
    req = torch.tensor(reqs, dtype=torch.long)[row_req]
    # a request's rows (its holes) share its kept copy: each extends it to its own keys
    requests = [view.req_ids[r] if view.req_ids else None for r in req.tolist()]
    return MaskedBatch(
        rows=rows, query_start_loc=row_qsl.to(torch.int32), seq_lens=row_lens,
        block_table=block_table[req], key_positions=view.key_positions[req],
        query_shift=view.query_shift[rows],
        key_start=None if view.key_start is None else view.key_start[rows],
        key_sink=None if view.key_sink is None else view.key_sink[req],
        query_isolated=None if view.query_isolated is None else view.query_isolated[rows],
        requests=requests)

def _sub_batch(reqs: list[int], qsl: torch.Tensor, seq_lens: torch.Tensor,
               block_table: torch.Tensor, scheduler_metadata: ScheduleFn | None) -> SubBatch:
    """Requests ``reqs`` of the step with their own rows, lengths and (physical) tables."""
    starts, ends = qsl[:-1].tolist(), qsl[1:].tolist()
    rows = [torch.arange(starts[i], ends[i]) for i in reqs]
    local_qsl = [0]
    for i in reqs:
        local_qsl.append(local_qsl[-1] + ends[i] - starts[i])
    sub_qsl = torch.tensor(local_qsl, dtype=torch.int32)
    sub_lens = seq_lens[reqs].to(torch.int32)
    return SubBatch(
        rows=torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long),
        query_start_loc=sub_qsl, seq_lens=sub_lens, block_table=block_table[reqs],
        scheduler_metadata=scheduler_metadata(sub_qsl, sub_lens)
        if scheduler_metadata and reqs else None,
    )


def _off_home_batch(reqs: list[int], qsl: torch.Tensor, seq_lens: torch.Tensor,
                    block_table: torch.Tensor, block_size: int, home: HomeSlots,
                    rotated: KeyShadowIndex, scheduler_metadata: ScheduleFn | None,
                    slot_offset: list[int] | None = None) -> OffHomeBatch:
    """Off-home requests that read each block at one slot: which shadow pages to (re)build.

    ``slot_offset[i]``: the true table slot of column 0 of row ``i`` (isolated rows).
    """
    base = _sub_batch(reqs, qsl, seq_lens, block_table, scheduler_metadata)
    lens = seq_lens.tolist()
    width = max(-(-lens[i] // block_size) for i in reqs)
    table_blocks = block_table[reqs, :width].long()
    physical = table_blocks.tolist()
    home_of = home.slots_of(table_blocks).tolist()  # only the blocks read
    in_use: dict[int, int] = {}
    copies: list[int] = []
    moves: list[tuple[int, int]] = []  # block, offset in tokens
    for r, i in enumerate(reqs):
        shift = slot_offset[i] if slot_offset is not None else 0
        for col in range(-(-lens[i] // block_size)):
            block, slot = physical[r][col], shift + col
            if rotated.lookup(block, slot, in_use):
                at = _home_slot(home_of[r][col], block, slot)
                if at == slot:
                    copies.append(block)
                else:
                    moves.append((block, (slot - at) * block_size))
    fill = None
    if copies or moves:
        copy = torch.tensor(copies, dtype=torch.long)
        moved = torch.tensor([b for b, _ in moves], dtype=torch.long)
        fill = RotatedFill(copy_blocks=copy, copy_dest=copy, blocks=moved,
                           offsets=torch.tensor([o for _, o in moves], dtype=torch.long),
                           dest=moved)
    return OffHomeBatch(
        rows=base.rows, query_start_loc=base.query_start_loc, seq_lens=base.seq_lens,
        block_table=base.block_table, scheduler_metadata=base.scheduler_metadata,
        fill=fill, release=rotated.take_evicted(), scratch_pages=0,
        global_block_table=base.block_table,
    )


def _private_batch(i: int, qsl: torch.Tensor, seq_lens: torch.Tensor,
                   block_table: torch.Tensor, block_size: int, home: HomeSlots,
                   scheduler_metadata: ScheduleFn | None,
                   slot_offset: list[int] | None) -> OffHomeBatch:
    """A request reading one block at two slots: every column gets its own scratch page (keys
    moved to the column's slot, values copied), for this call only; the shadow is untouched."""
    base = _sub_batch([i], qsl, seq_lens, block_table, scheduler_metadata)
    n = -(-int(seq_lens[i]) // block_size)
    shift = slot_offset[i] if slot_offset is not None else 0
    blocks = block_table[i, :n].long()
    homes = home.slots_of(blocks).tolist()
    offsets = [(shift + col - _home_slot(at, int(b), shift + col)) * block_size
               for col, (at, b) in enumerate(zip(homes, blocks.tolist(), strict=True))]
    empty = torch.zeros(0, dtype=torch.long)
    fill = RotatedFill(copy_blocks=empty, copy_dest=empty, blocks=blocks,
                       offsets=torch.tensor(offsets, dtype=torch.long), dest=torch.arange(n))
    return OffHomeBatch(
        rows=base.rows, query_start_loc=base.query_start_loc, seq_lens=base.seq_lens,
        block_table=torch.arange(n, dtype=torch.int32).unsqueeze(0),
        scheduler_metadata=base.scheduler_metadata, fill=fill, release=[], scratch_pages=n,
        global_block_table=base.block_table,
    )


def _home_slot(at: int, block: int, slot: int) -> int:
    if at < 0:
        raise RuntimeError(f"minipic: block {block} is read at slot {slot} but was never "
                           "written by this worker (no home slot)")
    return at
