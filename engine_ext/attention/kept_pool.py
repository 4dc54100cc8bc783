"""Span requests' kept copies, in the KV-cache blocks reserved for them, one pool per
KV-cache group.

A span request's question and the tokens it decodes see exactly its real keys, moved to their
logical positions: a causal prefix of a compact copy of them, which vLLM's kernel attends
without a mask (``engine_ext/attention/masked_rows.py``). This module decides, once per step
for every layer of the group, where each request's copy lives and what the step appends to it.

Why pages of one tensor and not a tensor per request: every running request's copy sits in
the layer's own KV-cache tensor, in blocks reserved for it, indexed by its own row of a block
table, so a step's decoding queries of *all* span requests go through **one** kernel call per
layer, and their new keys through one gather, one rotation and one write; a tensor per request
cost a kernel call, a rotation and a write per request and layer (at 32 requests decoding
together, most of the step). The pages are:

* **reserved with the request** by the scheduler (``kept_reservation.py``): KV-cache blocks
  admitted, preempted and freed with the request's own, so every running span request that
  decodes holds its copy, and the copies take no memory outside the configured KV space. Each
  step's reservations arrive with the scheduler output (:func:`set_step_reservations`); a row
  whose request holds none (a span prefill, an earlier chunk, a request too long to fit twice)
  is attended through a copy built for the step (the same result, slower);
* **checked by content**: a copy is extended only while the request reads the same blocks at
  the same home slots it was built from (compared by value) into the same reserved pages; a
  rebuilt table or a new reservation (after a preemption) starts it over;
* **forgotten** when the request leaves the batch; its blocks are the scheduler's to free.

Pure torch, no vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from minipic.engine_ext.attention.masked_rows import PreparedRow


@dataclass
class _Held:
    """One request's copy: its pages (the same ids in every layer) and what it holds."""

    pages: list[int]
    count: int  # keys held (real keys, in order)
    covered: int  # the request's keys 0 .. covered - 1 were looked at
    blocks: torch.Tensor  # the blocks it was built from (table order) ...
    home: torch.Tensor  # ... and their home slots: the content it is valid for


@dataclass
class KeptStep:
    """What every layer does with the copies in one step (built once, by
    :meth:`KeptPool.plan`): the new keys to gather from the cache (``blocks``, ``offsets``,
    their ``key_moves`` as rows of the offset table) and the ``slots`` they go to; the plain
    queries of every pooled row as one kernel batch (``rows`` of the step's query tensor, their
    ``query_moves``, ``qsl``, ``seq_lens``, ``table``); ``transient``: the rows with no reserved
    room, attended through a copy of their own for this step."""

    blocks: torch.Tensor
    offsets: torch.Tensor
    key_moves: torch.Tensor
    slots: torch.Tensor
    rows: torch.Tensor
    query_moves: torch.Tensor
    qsl: torch.Tensor
    seq_lens: torch.Tensor
    table: torch.Tensor
    transient: list[int]
    derived: dict = field(default_factory=dict)  # the kernel's schedule, per window


POOLS: list[KeptPool] = []  # this worker's pools, one per KV-cache group (their stats)
# this step's reserved copy blocks: {request id: (block ids of group 0, ...)} and the groups'
# layer names, set by the worker before its forward (kept_reservation.deliver)
_STEP: dict[str, Any] = {"reserved": {}, "groups": []}


def set_step_reservations(reserved: dict[str, tuple[list[int], ...]],
                          groups: list[list[str]]) -> None:
    """The step's reserved copy blocks, for every pool of this worker."""
    _STEP["reserved"], _STEP["groups"] = reserved, groups


class KeptPool:
    """The copies of one KV-cache group's span requests, in blocks the scheduler reserved."""

    def __init__(self, layer_names: list[str], block_size: int) -> None:
        self.layers = frozenset(layer_names)
        self.block_size = block_size
        self.held: dict[str, _Held] = {}
        # None: the step's reservations from the scheduler; a dict: given by its caller (the
        # attention test harness, which has no scheduler)
        self.reserved: dict[str, list[int]] | None = None
        self.peak_pages = 0  # most pages held at once
        self.transient_rows = 0  # rows attended through a copy built for the step

    @property
    def used_pages(self) -> int:
        return sum(len(held.pages) for held in self.held.values())

    def stats(self) -> dict[str, int]:
        return {"kept_pages": self.used_pages, "kept_peak_pages": self.peak_pages,
                "kept_requests": len(self.held), "kept_transient_rows": self.transient_rows}

    def reservations(self) -> dict[str, list[int]]:
        """Each request's reserved pages in this group, this step."""
        if self.reserved is not None:
            return self.reserved
        group = next((g for g, names in enumerate(_STEP["groups"])
                      if self.layers.intersection(names)), None)
        if group is None:
            return {}
        return {rid: pages[group] for rid, pages in _STEP["reserved"].items()
                if len(pages) > group and pages[group]}

    def keep_only(self, requests: set) -> None:
        """Forget the copies of requests not in ``requests`` (their blocks are the
        scheduler's)."""
        for gone in [r for r in self.held if r not in requests]:
            del self.held[gone]

    def plan(self, rows: list[PreparedRow]) -> KeptStep:
        """Where each row's plain queries find their copy this step, and what it appends."""
        bs = self.block_size
        self.keep_only({row.request for row in rows if row.request is not None})
        reserved = self.reservations()
        gather: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        batch: list[tuple[PreparedRow, list[int]]] = []
        transient: list[int] = []
        fell_back: set[str] = set()
        for index, row in enumerate(rows):
            if not row.plain.queries.numel():
                continue
            pages = reserved.get(row.request) if row.request is not None else None
            held = None if row.request in fell_back or not pages else self._copy_for(row, pages)
            keys = row.plain.keys
            new = keys[keys >= held.covered] if held is not None else keys
            if held is None or -(-(held.count + new.numel()) // bs) > len(pages):
                transient.append(index)
                self.transient_rows += 1
                if row.request is not None:
                    fell_back.add(row.request)
                continue
            held.pages = list(pages[:-(-(held.count + new.numel()) // bs)])
            if new.numel():
                at = torch.arange(held.count, held.count + new.numel())
                ids = torch.tensor(held.pages, dtype=torch.long)
                gather.append((row.blocks[new // bs], new % bs, row.key_moves[new],
                               ids[at // bs] * bs + at % bs))
            held.count += new.numel()
            held.covered = max(held.covered, row.keys)
            full = -(-row.keys // bs)
            held.blocks, held.home = row.blocks[:full], row.home[:full]
            batch.append((row, held.pages))
        self.peak_pages = max(self.peak_pages, self.used_pages)
        empty = torch.zeros(0, dtype=torch.long)
        columns = [torch.cat(part) if part else empty for part in zip(*gather, strict=True)] \
            if gather else [empty] * 4
        return KeptStep(*columns, *_kernel_rows(batch), transient=transient)

    def _copy_for(self, row: PreparedRow, pages: list[int]) -> _Held:
        """The row's request's copy, valid for what the row reads and where it lies (a new one
        where the old was built from other content or into other pages)."""
        held = self.held.get(row.request)
        if held is not None:
            full = -(-held.covered // self.block_size)
            if (held.covered <= row.keys and held.blocks.numel() == full
                    and list(pages[:len(held.pages)]) == held.pages
                    and torch.equal(held.blocks, row.blocks[:full])
                    and torch.equal(held.home, row.home[:full])):
                return held
        held = _Held(pages=[], count=0, covered=0, blocks=row.blocks[:0], home=row.home[:0])
        self.held[row.request] = held
        return held


def _kernel_rows(batch: list[tuple[PreparedRow, list[int]]]
                 ) -> tuple[torch.Tensor, ...]:
    """``(rows, query_moves, qsl, seq_lens, table)`` of the pooled rows' plain queries as one
    kernel batch: each row's runs of consecutive keys, its table its copy's pages."""
    if not batch:
        empty = torch.zeros(0, dtype=torch.long)
        return (empty, empty, torch.zeros(1, dtype=torch.int32),
                torch.zeros(0, dtype=torch.int32), torch.zeros(0, 1, dtype=torch.int32))
    rows, moves, qsl, lens, tables = [], [], [torch.zeros(1, dtype=torch.int32)], [], []
    width = max(len(pages) for _, pages in batch)
    base = 0
    for row, pages in batch:
        rows.append(row.queries[row.plain.queries])
        moves.append(row.query_moves[row.plain.queries])
        qsl.append(row.plain.qsl[1:] + base)
        base += int(row.plain.qsl[-1])
        lens.append(row.plain.seq_lens)
        table = torch.zeros(row.plain.seq_lens.numel(), width, dtype=torch.int32)
        table[:, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
        tables.append(table)
    return (torch.cat(rows), torch.cat(moves), torch.cat(qsl), torch.cat(lens),
            torch.cat(tables))
