"""The rotated-block pool: bounded memory for keys rotated at the slot a span is read at.

A request that reads a cached block away from the slot it was written at (a span reused at a
new offset) attends through pool entries: one per ``(table slot, physical block)``, holding that
block's keys rotated for that slot plus its values, in the layout of vLLM's C++ CPU kernel
(``engine_ext/rope_attention_backend.py``). An entry depends only on the block's content and the
slot, so it serves every request and every later step that reads the block there; it dies when
the block is written, or least recently used first when the pool is full.

**Memory.** The pool lives outside vLLM's KV tensors, so it must fit inside the memory the user
configured: :func:`install_budget` wraps the CPU worker's ``determine_available_memory`` so the
KV cache gets ``(1 - share)`` of the configured budget and the pool the rest
(``MINIPIC_ROTATED_POOL_SHARE``, default 0.2). KV cache and pool together never exceed what the
user configured. The pool's entry cap follows from its bytes; it is never below one request's
longest table (``max_model_len / block_size``), so any single request fits.

**Hard cap.** The pool grows (doubling) only up to the cap. When the requests of one step read
more distinct ``(slot, block)`` pairs than the cap, the step's off-home requests are split into
chunks that each fit (``OffHomePlanner`` in the backend); each layer fills and attends chunk by
chunk, so a later chunk may overwrite entries an earlier one used. Memory stays at the cap; the
price is re-rotating those entries in the next step.

**Release when idle.** vLLM's engine runs no step while idle, so the pool is released at the
first step that reads nothing off home once ``idle_release_s`` passed since the last step that
did (default 1 s): every entry dropped, capacity back to its initial size, and each layer frees
its pages.
"""

from __future__ import annotations

import functools
import os
import time
import weakref
from collections import OrderedDict
from typing import Any

SHARE_ENV = "MINIPIC_ROTATED_POOL_SHARE"
STATS_RPC = "minipic_rotated_pool_stats"  # worker method name for collective_rpc
DEFAULT_SHARE = 0.2
IDLE_RELEASE_S = 1.0

# Worker-process facts, set once the worker has sized its memory (install_budget) and read by
# the metadata builders, which are created after that.
_BUDGET: dict[str, Any] = {"pool_bytes": None}
_POOLS: weakref.WeakSet[RotatedBlocks] = weakref.WeakSet()  # live pools of this worker


class RotatedBlocks:
    """Index of the pool: which entry holds which ``(slot, block)``; LRU order; the cap."""

    def __init__(self, initial: int = 64, cap: int | None = None,
                 entry_bytes: int = 0, idle_release_s: float = IDLE_RELEASE_S) -> None:
        self.initial = initial
        self.cap = cap  # None: unbounded (synthetic tests); else the most entries ever held
        self.entry_bytes = entry_bytes  # bytes of one entry over all layers of the group
        self.idle_release_s = idle_release_s
        self.peak_capacity = 0
        self.releases = 0
        self.chunked_steps = 0
        self._last_used = time.monotonic()
        self._reset(initial)
        _POOLS.add(self)

    def _reset(self, capacity: int) -> None:
        self.capacity = capacity if self.cap is None else min(capacity, self.cap)
        self.entries: OrderedDict[tuple[int, int], int] = OrderedDict()  # LRU order
        self.by_block: dict[int, set[int]] = {}  # physical block -> slots with an entry
        self.free = list(range(self.capacity - 1, -1, -1))
        self.peak_capacity = max(self.peak_capacity, self.capacity)

    def invalidate(self, blocks: list[int]) -> None:
        """These blocks were written: every rotated copy of them is stale."""
        for block in blocks:
            for slot in self.by_block.pop(block, ()):
                self.free.append(self.entries.pop((slot, block)))

    def note_step(self, used: bool) -> bool:
        """Record whether this step reads off home; True when the pool was just released."""
        now = time.monotonic()
        if used:
            self._last_used = now
            return False
        if self.entries and now - self._last_used >= self.idle_release_s:
            self.releases += 1
            self._reset(self.initial)
            return True
        return False

    def _evict_or_grow(self, in_use: set[tuple[int, int]]) -> int:
        """The least recently used entry no one in this chunk needs; else grow (up to the cap)."""
        for key in self.entries:
            if key not in in_use:
                entry = self.entries.pop(key)
                slots = self.by_block[key[1]]
                slots.discard(key[0])
                if not slots:
                    del self.by_block[key[1]]
                return entry
        if self.cap is not None and self.capacity >= self.cap:
            raise RuntimeError(f"rotated-block pool: all {self.capacity} entries in use "
                               f"(the planner must chunk the step below the cap)")
        grown = self.capacity * 2 if self.cap is None else min(self.capacity * 2, self.cap)
        self.free = list(range(grown - 1, self.capacity, -1))
        entry, self.capacity = self.capacity, grown
        self.peak_capacity = max(self.peak_capacity, self.capacity)
        return entry

    def lookup(self, key: tuple[int, int], in_use: set[tuple[int, int]]) -> tuple[int, bool]:
        """Pool entry for ``key`` and whether it must be filled in this step."""
        in_use.add(key)
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
            return entry, False
        entry = self.free.pop() if self.free else self._evict_or_grow(in_use)
        self.entries[key] = entry
        self.by_block.setdefault(key[1], set()).add(key[0])
        return entry, True

    def stats(self) -> dict[str, Any]:
        return {
            "entries": len(self.entries), "capacity": self.capacity, "cap": self.cap,
            "bytes": self.capacity * self.entry_bytes,
            "peak_bytes": self.peak_capacity * self.entry_bytes,
            "cap_bytes": None if self.cap is None else self.cap * self.entry_bytes,
            "releases": self.releases, "chunked_steps": self.chunked_steps,
        }


def pool_share() -> float:
    raw = os.environ.get(SHARE_ENV, "")
    share = float(raw) if raw.strip() else DEFAULT_SHARE
    if not 0.0 < share < 1.0:
        raise ValueError(f"{SHARE_ENV}={raw!r}: expected a fraction in (0, 1)")
    return share


def pool_cap_entries(entry_bytes: int, min_entries: int) -> int | None:
    """Entry cap of one pool from the worker's budget (None before the budget is known)."""
    budget = _BUDGET["pool_bytes"]
    if budget is None or entry_bytes <= 0:
        return None
    return max(min_entries, budget // entry_bytes)


def install_budget() -> None:
    """Give the pool its share of the configured KV memory (CPU worker; idempotent)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():  # the pool is the CPU backend's; GPUs read no pool
        return
    from vllm.v1.worker.cpu_worker import CPUWorker

    from engine_ext import patches

    def factory(stock: Any) -> Any:
        @functools.wraps(stock)
        def determine_available_memory(self: Any) -> int:
            total = stock(self)
            pool = int(total * pool_share())
            _BUDGET["pool_bytes"] = pool
            return total - pool

        return determine_available_memory

    patches.apply("rope", {
        "vllm.v1.worker.cpu_worker:CPUWorker.determine_available_memory": factory})
    # Reachable as ``collective_rpc(STATS_RPC)`` from the engine's front-end process.
    setattr(CPUWorker, STATS_RPC, rotated_pool_stats)


def rotated_pool_stats(_worker: Any = None) -> dict[str, Any]:
    """This worker's pools summed (for ``collective_rpc``; the worker argument is unused)."""
    totals: dict[str, Any] = {"pools": len(_POOLS), "bytes": 0, "peak_bytes": 0,
                              "cap_bytes": 0, "releases": 0, "chunked_steps": 0,
                              "budget_bytes": _BUDGET["pool_bytes"]}
    for pool in _POOLS:
        s = pool.stats()
        for key in ("bytes", "peak_bytes", "releases", "chunked_steps"):
            totals[key] += s[key]
        totals["cap_bytes"] += s["cap_bytes"] or 0
    return totals
