"""The host-RAM tier: a bounded, thread-safe LRU in front of the persistent tiers."""

from __future__ import annotations

import threading
from collections import OrderedDict

from minipic.engine_ext.span_store.tiers.base import Entry


class RamTier:
    """Bounded host-RAM LRU, thread-safe. Capacity counts :attr:`Entry.nbytes`.

    ``capacity_bytes=0`` is valid and stores nothing (RAM tier effectively off).
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = int(capacity_bytes)
        self._entries: OrderedDict[str, Entry] = OrderedDict()  # LRU first
        self._bytes = 0
        self._lock = threading.Lock()
        self._hits = self._misses = self._evictions = self._too_large = 0

    def get(self, key: str) -> Entry | None:
        """The entry (now most recently used), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return entry

    def put(self, key: str, entry: Entry) -> None:
        """Store (replacing ``key`` if present), evicting least recently used entries to fit.
        An entry larger than the whole capacity is not stored (and ``key`` is dropped)."""
        size = entry.nbytes
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            if size > self.capacity_bytes:
                self._too_large += 1
                return
            while self._bytes + size > self.capacity_bytes:
                _, victim = self._entries.popitem(last=False)
                self._bytes -= victim.nbytes
                self._evictions += 1
            self._entries[key] = entry
            self._bytes += size

    def delete(self, key: str) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes

    def __contains__(self, key: str) -> bool:
        """Membership without touching LRU order or hit counters."""
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def keys(self) -> list[str]:
        """Keys from least to most recently used (a snapshot)."""
        with self._lock:
            return list(self._entries)

    def stats(self) -> dict:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self._bytes,
                    "capacity_bytes": self.capacity_bytes, "hits": self._hits,
                    "misses": self._misses, "evictions": self._evictions,
                    "too_large": self._too_large}
