"""The key shadow: bounded memory for keys rotated at the slot a span is read at.

A request that reads a cached block away from the slot it was written at (a span reused at a
new offset) attends with that block's keys moved to the slot it is read at
(``engine_ext/attention/cpu_backend.py``). Those keys live in each layer's *key shadow*
(``engine_ext/attention/key_shadow/pages.py``): a page per physical block, at the block's own index,
with the KV cache's shape and strides, so vLLM's C++ kernel reads keys from the shadow and **values
in place from the KV cache** with the request's own (physical) block table. Only keys are ever
copied; the values never move.

This module is the shadow's index, one per KV-cache group (all its layers share block ids and
see the same step plan): which slot each block's shadow page holds, least recently used first,
and the cap. A shadow page depends only on the block's content and the slot, so it serves every
request and every later step that reads the block at that slot; it turns stale when the block is
written, and is refilled (or its memory given back) later.

**Memory.** The shadow is reserved address space; memory is committed only for the pages that
are written, and given back (``madvise(MADV_DONTNEED)``) when a page is evicted. It must fit
inside the memory the user configured: :func:`install_budget` wraps the CPU worker's
``determine_available_memory`` so the KV cache gets ``(1 - share)`` of the configured budget and
the pool the rest (``MINIPIC_ROTATED_POOL_SHARE``, default 0.1), and never less than one
request needs: its longest table (``max_model_len / block_size`` blocks) of shadow pages plus
one layer's scratch copy (keys and values) of that table for a private chunk. KV cache and pool
together never exceed what the user configured, and the pool's cap (how many blocks may hold a
shadow page) is what its bytes hold after the scratch reserve -- so any single request fits
and the pool never outgrows its budget.

**One slot per block per kernel call.** A shadow page holds a block at one slot. When the
requests of one step read the same block at two slots, or more distinct blocks than the cap,
the step's off-home requests are split into chunks that each fit (``step_plan``); each layer
fills and attends chunk by chunk, so a later chunk may refill pages an earlier one used. A single
request that reads one block at two slots (the same document twice in a prompt) gets a private
chunk: its keys *and* values copied into a scratch page set for that call only.

**Release when idle.** vLLM's engine runs no step while idle, so the pool is released at the
first step that reads nothing off home once ``idle_release_s`` passed since the last step that
did (default 1 s): every entry dropped and every layer gives its shadow's memory back.
"""

from __future__ import annotations

import functools
import os
import time
import weakref
from collections import OrderedDict
from typing import Any

from minipic.span_contract.engine_utilities import KEY_SHADOW_STATS_RPC
from minipic.span_contract.env import KEY_SHADOW_SHARE_ENV

SHARE_ENV = KEY_SHADOW_SHARE_ENV
DEFAULT_SHARE = 0.1  # of the KV budget: keys only, values are read in place
IDLE_RELEASE_S = 1.0
STALE = -1  # a held page whose block was written since: committed memory, no valid slot

# Worker-process facts, set once the worker has sized its memory (install_budget) and read by
# the metadata builders, which are created after that.
_BUDGET: dict[str, Any] = {"pool_bytes": None}
_POOLS: weakref.WeakSet[KeyShadowIndex] = weakref.WeakSet()  # live pools of this worker


class PoolFull(RuntimeError):
    """A chunk needs more pages than the cap (the planner must chunk below it)."""


class KeyShadowIndex:
    """Index of the key shadow: which slot each block's page holds; LRU order; the cap."""

    def __init__(self, cap: int | None = None, entry_bytes: int = 0,
                 idle_release_s: float = IDLE_RELEASE_S) -> None:
        self.cap = cap  # None: unbounded (synthetic tests); else the most pages ever held
        self.entry_bytes = entry_bytes  # bytes of one block's keys over all layers of the group
        self.idle_release_s = idle_release_s
        self.held: OrderedDict[int, int] = OrderedDict()  # block -> slot (STALE), LRU first
        self.peak_entries = 0
        self.releases = 0
        self.chunked_steps = 0
        self.evictions = 0
        self._evicted: list[int] = []  # pages to give back before the next fill
        self._last_used = time.monotonic()
        _POOLS.add(self)

    def invalidate(self, blocks: list[int]) -> None:
        """These blocks were written: their shadow pages are stale (memory still held)."""
        for block in blocks:
            if block in self.held:
                self.held[block] = STALE

    def note_step(self, used: bool) -> bool:
        """Record whether this step reads off home; True when the pool was just released."""
        now = time.monotonic()
        if used:
            self._last_used = now
            return False
        if self.held and now - self._last_used >= self.idle_release_s:
            self.releases += 1
            self.held.clear()
            self._evicted.clear()  # the layers give every page back
            return True
        return False

    def _evict(self, in_use: dict[int, int]) -> None:
        """Drop the least recently used page no one in this chunk needs."""
        for block in self.held:
            if block not in in_use:
                del self.held[block]
                self._evicted.append(block)
                self.evictions += 1
                return
        raise PoolFull(f"key shadow: all {len(self.held)} pages in use (the planner "
                       "must chunk the step below the cap)")

    def lookup(self, block: int, slot: int, in_use: dict[int, int]) -> bool:
        """Claim ``block``'s shadow page for ``slot`` in this chunk; True when it must be filled.

        ``in_use`` maps the chunk's blocks to the slot each is read at; a block the chunk
        already reads at another slot is the planner's error (it splits such requests).
        """
        claimed = in_use.setdefault(block, slot)
        if claimed != slot:
            raise ValueError(f"block {block} read at slots {claimed} and {slot} in one chunk")
        held = self.held.get(block)
        if held is not None:
            self.held.move_to_end(block)
            if held == slot:
                return False
        elif self.cap is not None and len(self.held) >= self.cap:
            self._evict(in_use)
        self.held[block] = slot
        self.peak_entries = max(self.peak_entries, len(self.held))
        return True

    def take_evicted(self) -> list[int]:
        """Blocks evicted since the last call, whose pages every layer must give back."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def stats(self) -> dict[str, Any]:
        return {
            "entries": len(self.held), "cap": self.cap,
            "bytes": len(self.held) * self.entry_bytes,
            "peak_bytes": self.peak_entries * self.entry_bytes,
            "cap_bytes": None if self.cap is None else self.cap * self.entry_bytes,
            "releases": self.releases, "chunked_steps": self.chunked_steps,
            "evictions": self.evictions,
        }


def pool_share() -> float:
    raw = os.environ.get(SHARE_ENV, "")
    share = float(raw) if raw.strip() else DEFAULT_SHARE
    if not 0.0 < share < 1.0:
        raise ValueError(f"{SHARE_ENV}={raw!r}: expected a fraction in (0, 1)")
    return share


def pool_cap_entries(entry_bytes: int, min_entries: int, scratch_bytes: int = 0) -> int | None:
    """Entry cap of one pool from the worker's budget, after ``scratch_bytes`` kept for a
    private chunk's scratch copy (None before the budget is known)."""
    budget = _BUDGET["pool_bytes"]
    if budget is None or entry_bytes <= 0:
        return None
    cap = max(budget - scratch_bytes, 0) // entry_bytes
    if cap < min_entries:
        from minipic.span_contract.errors import EngineIntegrationError

        raise EngineIntegrationError(
            f"the key shadow's {budget / 2**20:.0f} MiB hold {cap} blocks after the "
            f"scratch reserve, fewer than one request's {min_entries}: raise "
            f"{SHARE_ENV} or the KV space, or lower --max-model-len")
    return cap


def one_request_bytes(vllm_config: Any) -> int:
    """Pool bytes one request of ``max_model_len`` needs: its table of shadow pages (keys of
    every attention layer) and one layer's scratch copy of it (keys and values)."""
    import torch

    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    block = vllm_config.cache_config.block_size
    layers = model.get_num_layers_by_block_type(parallel, "attention")
    itemsize = torch.tensor([], dtype=model.dtype).element_size()
    page = block * model.get_num_kv_heads(parallel) * model.get_head_size() * itemsize
    longest = -(-model.max_model_len // block)
    return longest * page * layers + 2 * longest * page


def install_budget() -> None:
    """Give the pool its share of the configured KV memory (CPU worker; idempotent)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():  # the pool is the CPU backend's; GPUs read no pool
        return
    from vllm.v1.worker.cpu_worker import CPUWorker

    from minipic.engine_ext.vllm_surface import patches

    def factory(stock: Any) -> Any:
        @functools.wraps(stock)
        def determine_available_memory(self: Any) -> int:
            total = stock(self)
            pool = max(int(total * pool_share()), one_request_bytes(self.vllm_config))
            if pool >= total:
                from minipic.span_contract.errors import EngineIntegrationError

                raise EngineIntegrationError(
                    f"one request of max_model_len needs {pool / 2**20:.0f} MiB of rotated "
                    f"keys, all of the {total / 2**20:.0f} MiB KV budget: raise the KV space "
                    f"or lower --max-model-len")
            _BUDGET["pool_bytes"] = pool
            return total - pool

        return determine_available_memory

    patches.apply("rope", {
        "vllm.v1.worker.cpu_worker:CPUWorker.determine_available_memory": factory})
    # Reachable as ``collective_rpc(KEY_SHADOW_STATS_RPC)`` from the engine's front-end process.
    patches.add("rope", {f"{CPUWorker.__module__}:CPUWorker.{KEY_SHADOW_STATS_RPC}":
                         key_shadow_stats})


def key_shadow_stats(_worker: Any = None) -> dict[str, Any]:
    """This worker's pools summed, the kept copies' pages (``kept_pool``) included (for
    ``collective_rpc``; the worker argument is unused)."""
    totals: dict[str, Any] = {"pools": len(_POOLS), "bytes": 0, "peak_bytes": 0,
                              "cap_bytes": 0, "releases": 0, "chunked_steps": 0, "evictions": 0,
                              "budget_bytes": _BUDGET["pool_bytes"]}
    for pool in _POOLS:
        s = pool.stats()
        for key in ("bytes", "peak_bytes", "releases", "chunked_steps", "evictions"):
            totals[key] += s[key]
        totals["cap_bytes"] += s["cap_bytes"] or 0
    from minipic.engine_ext.attention.kept_pool import POOLS  # their pages are KV blocks

    for kept in POOLS:
        for key, value in kept.stats().items():
            totals[key] = totals.get(key, 0) + value
    return totals
