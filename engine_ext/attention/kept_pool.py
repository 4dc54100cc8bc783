"""The pages that hold span requests' kept copies, one allocator per KV-cache group.

A span request's question and the tokens it decodes see exactly its real keys, moved to their
logical positions: a causal prefix of a compact copy of them, which vLLM's kernel attends
without a mask (``engine_ext/attention/masked_rows.py``). This module decides, once per step
for every layer of the group, where each request's copy lives and what the step appends to it.

Why one pool of pages and not a tensor per request: every running request's copy sits in the
same page tensor of a layer, indexed by its own row of a block table, so a step's decoding
queries of *all* span requests go through **one** kernel call per layer, and their new keys
through one gather, one rotation and one write; a tensor per request cost a kernel call, a
rotation and a write per request and layer (at 32 requests decoding together, most of the
step). And the pool is what bounds and frees the copies:

* **reserved with the request**: pages are taken when a request's copy grows and stay its own
  until it leaves, so a request that got a copy keeps it to its last token; a request that
  finds no free pages is attended through a copy built for the step (the same result, slower)
  and takes pages as soon as some are free;
* **sized** by ``MINIPIC_ROTATED_POOL_SHARE`` of the group's KV blocks: the key shadow's share,
  which rule 1 leaves idle (every request reading a span off home holds layout tokens). At the
  default 0.1 the copies of running span requests may hold a tenth of the KV cache's tokens;
  an operator whose span requests run many at once with long prompts raises the share;
* **freed** when the request leaves vLLM's batch (finished, aborted, preempted, or not
  scheduled this step): the step after, every layer gives its pages back to the OS
  (``madvise``, ``key_shadow/pages.py``);
* **checked by content**: a copy is extended only while the request reads the same blocks at
  the same home slots it was built from (compared by value); a rebuilt table starts it over.

Pure torch, no vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

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
    """What every layer does with the pool in one step (built once, by :meth:`KeptPool.plan`).

    ``release``: pages freed since the last step (every layer gives them back first); the new
    keys to gather from the cache (``blocks``, ``offsets``, their ``key_moves`` as rows of the
    offset table) and the ``slots`` they go to; the plain queries of every pooled row as one
    kernel batch (``rows`` of the step's query tensor, their ``query_moves``, ``qsl``,
    ``seq_lens``, ``table``); ``transient``: the rows that found no room, attended through a
    copy of their own for this step."""

    release: list[int]
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


class KeptPool:
    """Page ids ``0 .. pages - 1`` of every layer's kept-copy tensor, and the copies in them."""

    def __init__(self, pages: int, block_size: int) -> None:
        self.pages = max(int(pages), 0)
        self.block_size = block_size
        self._free = list(range(self.pages - 1, -1, -1))
        self.held: dict[str, _Held] = {}
        self._released: list[int] = []
        self.peak_pages = 0  # most pages held at once
        self.transient_rows = 0  # rows that found no room (a copy built for the step)

    @property
    def used_pages(self) -> int:
        return self.pages - len(self._free)

    def stats(self) -> dict[str, int]:
        return {"kept_pages": self.used_pages, "kept_capacity_pages": self.pages,
                "kept_peak_pages": self.peak_pages, "kept_requests": len(self.held),
                "kept_transient_rows": self.transient_rows}

    def keep_only(self, requests: set) -> list[int]:
        """Free the copies of requests not in ``requests``; every page freed since the last
        call (what the layers give back now)."""
        for gone in [r for r in self.held if r not in requests]:
            held = self.held.pop(gone)
            self._free.extend(held.pages)
            self._released.extend(held.pages)
        released, self._released = self._released, []
        return released

    def plan(self, rows: list[PreparedRow]) -> KeptStep:
        """Where each row's plain queries find their copy this step, and what it appends."""
        bs = self.block_size
        release = self.keep_only({row.request for row in rows if row.request is not None})
        gather: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        batch: list[tuple[PreparedRow, list[int]]] = []
        transient: list[int] = []
        fell_back: set[str] = set()
        for index, row in enumerate(rows):
            if not row.plain.queries.numel():
                continue
            held = None if row.request in fell_back else self._copy_for(row)
            if held is None:
                transient.append(index)
                self.transient_rows += 1
                if row.request is not None:
                    fell_back.add(row.request)
                continue
            keys = row.plain.keys
            new = keys[keys >= held.covered]
            need = -(-(held.count + new.numel()) // bs) - len(held.pages)
            if need > len(self._free):
                transient.append(index)
                self.transient_rows += 1
                fell_back.add(row.request)
                if not held.pages:  # nothing held yet: no entry to keep
                    self.held.pop(row.request, None)
                continue
            held.pages.extend(self._free.pop() for _ in range(need))
            if new.numel():
                at = torch.arange(held.count, held.count + new.numel())
                pages = torch.tensor(held.pages, dtype=torch.long)
                gather.append((row.blocks[new // bs], new % bs, row.key_moves[new],
                               pages[at // bs] * bs + at % bs))
            held.count += new.numel()
            held.covered = max(held.covered, row.keys)
            full = -(-row.keys // bs)
            held.blocks, held.home = row.blocks[:full], row.home[:full]
            batch.append((row, held.pages))
        self.peak_pages = max(self.peak_pages, self.used_pages)
        # pages of copies found stale above may already hold a new copy's keys in this step:
        # every layer gives its pages back before it writes, so they go back now, not later
        release += self._released
        self._released = []
        empty = torch.zeros(0, dtype=torch.long)
        columns = [torch.cat(part) if part else empty for part in zip(*gather, strict=True)] \
            if gather else [empty] * 4
        return KeptStep(release, *columns, *_kernel_rows(batch), transient=transient)

    def _copy_for(self, row: PreparedRow) -> _Held | None:
        """The row's request's copy, valid for what the row reads (a new one where the old was
        built from other content); None for a row of no known request."""
        if row.request is None:
            return None
        held = self.held.get(row.request)
        if held is not None:
            full = -(-held.covered // self.block_size)
            if (held.covered <= row.keys and held.blocks.numel() == full
                    and torch.equal(held.blocks, row.blocks[:full])
                    and torch.equal(held.home, row.home[:full])):
                return held
            self._free.extend(held.pages)
            self._released.extend(held.pages)
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
