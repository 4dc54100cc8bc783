"""The span store's worker half: copy KV pages between the engine's cache and the store.

An entry is one block's pages of every attention layer, byte for byte as the engine holds them
(vLLM's stock page; on CPU the keys rotated at the block's *home* slot, in the kernel's ISA
packing, which the config fingerprint names), plus that home slot. Loading copies the bytes
back into a fresh block and tells the metadata builder the block's home
(``MinipicCPUAttentionMetadataBuilder.blocks_filled``): the keys are then exactly what the
engine wrote when it computed the block at that slot, and reads at any other slot move them by
the slot difference, as for any cached block. So a loaded block is the block the engine would
have computed, bit for bit, wherever it is read.

Fills run in ``handle_preemptions``, the first thing of every ``execute_model``, before the
step's attention metadata is built (which reads the home slots) and before any forward. Saves
copy the pages in ``wait_for_save`` (after the forward wrote them) -- a memcpy of the block on
the step's thread -- and the store writes them to its persistent tiers on its own thread.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch

logger = logging.getLogger("vllm.minipic.span_store")


class PageCopier:
    """Reads and writes whole blocks of this worker's KV caches."""

    def __init__(self, store: Any, entry_cls: type) -> None:
        self.store = store  # a TieredStore
        self.entry_cls = entry_cls
        self.layers: list[str] = []
        self.caches: list[torch.Tensor] = []
        self.page_bytes = 0
        self._reported: dict[str, int] = {}  # tier write counters as last reported

    def tier_events(self) -> dict[str, int]:
        """Increases of the persistent tiers' write counters since the last call (for
        ``/metrics``: the scheduler, which exports them, does no writes itself)."""
        from minipic.engine_ext.span_store.metrics import WRITE_EVENTS

        out: dict[str, int] = {}
        for tier in self.store.tiers:
            stats = tier.stats()
            for event in WRITE_EVENTS:
                name = f"{event}_{tier.name}"
                grown = int(stats.get(event, 0)) - self._reported.get(name, 0)
                if grown > 0:
                    out[name] = grown
                    self._reported[name] = int(stats[event])
        return out

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.layers = sorted(kv_caches)
        self.caches = [kv_caches[name] for name in self.layers]
        first = self.caches[0]
        self.page_bytes = first[0].numel() * first.element_size()
        if any(c[0].numel() * c.element_size() != self.page_bytes for c in self.caches):
            raise ValueError("minipic span store: attention layers with different page sizes")
        for tier in self.store.tiers:  # a file larger than our entries is refused unread
            tier.bound_entries(self.page_bytes * len(self.caches))

    def _meta(self, home: int) -> dict[str, Any]:
        return {"home": home, "layers": len(self.layers), "page_bytes": self.page_bytes,
                "dtype": str(self.caches[0].dtype)}

    def save(self, block_id: int, key: str, slot: int) -> bool:
        """Copy a block out (all layers) and hand it to the store; False if the store holds it
        nowhere (RAM too small, every writer's queue full or writes paused)."""
        from minipic.engine_ext.attention.cpu_backend import home_slot_of

        home = home_slot_of(self.layers[0], block_id)
        if home is None:
            home = slot  # no home slots (GPU backend): the slot it was computed at
        elif home < 0:
            return False  # never written here: nothing to save
        pages = torch.cat([cache[block_id].reshape(-1).view(torch.uint8).cpu()
                           for cache in self.caches])
        return bool(self.store.put(key, self.entry_cls(pages.numpy().tobytes(),
                                                       self._meta(home))))

    def load(self, block_id: int, key: str) -> tuple[str, int] | None:
        """Fill ``block_id`` from the store; ``(source, home slot)`` or None (a miss)."""
        return self.fill(block_id, key, self.store.get(key))

    def fill(self, block_id: int, key: str, found: tuple[Any, str] | None
             ) -> tuple[str, int] | None:
        """Copy an entry read for ``key`` (``store.get``'s answer) into ``block_id``;
        ``(source, home slot)``, or None when there is none or it does not fit these pages."""
        if found is None:
            return None
        entry, source = found
        meta = entry.meta
        expected = self._meta(int(meta.get("home", -1)))
        if meta != expected or len(entry.payload) != self.page_bytes * len(self.caches) or (
                expected["home"] < 0):
            logger.warning("minipic span store: entry %s does not fit this engine's pages "
                           "(%s); treated as a miss", key[:16], meta)
            return None
        with warnings.catch_warnings():  # a read-only buffer: we only copy out of it
            warnings.simplefilter("ignore", UserWarning)
            data = torch.frombuffer(entry.payload, dtype=torch.uint8)
        for layer, cache in enumerate(self.caches):
            page = cache[block_id]
            chunk = data[layer * self.page_bytes:(layer + 1) * self.page_bytes]
            page.copy_(chunk.view(page.dtype).view(page.shape))
        return source, expected["home"]

    def filled(self, blocks: list[int], homes: list[int]) -> None:
        """Tell the attention metadata builder the home slots of freshly filled blocks."""
        from minipic.engine_ext.attention.cpu_backend import blocks_filled

        blocks_filled(self.layers[0], blocks, homes)


def flush_worker_store(timeout_s: float) -> dict[str, Any]:
    """Wait (up to ``timeout_s``) until this worker's span store has written what it was given,
    and report its write counters; empty when the engine runs no span store.

    Why: the store writes off the engine's step (a background writer per tier); a caller that
    records a span as durable (``minipic index``'s manifest) must not do so before its blocks
    are on disk. Called in the worker (``collective_rpc``) through vLLM's KV-transfer group,
    the one handle a worker has on its connector.
    """
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return {}
    pages = getattr(get_kv_transfer_group(), "pages", None)
    if not isinstance(pages, PageCopier):
        return {}
    store = pages.store
    store.flush(timeout_s)
    stats = store.stats()
    tiers = stats.get("tiers") or {}
    return {
        "tiers": len(tiers),
        "pending_writes": int(stats.get("pending_writes", 0)),
        "skipped_queue_full": int(stats.get("skipped_queue_full", 0)),
        "writer_errors": int(stats.get("writer_errors", 0)),
        "write_errors": sum(int(t.get("write_errors", 0)) for t in tiers.values()),
        "writes_enabled": all(bool(t.get("writes_enabled", True)) for t in tiers.values()),
        "evictions": sum(int(t.get("evictions", 0)) for t in tiers.values()),
        "kv_bytes_per_block": int(pages.page_bytes) * len(pages.caches),
    }
