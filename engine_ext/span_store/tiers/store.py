"""The tiered store: RAM first, then the persistent tiers in order, their writes off the
caller's thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from minipic.engine_ext.span_store.tiers.base import RAM_SOURCE, Entry, check_key, logger
from minipic.engine_ext.span_store.tiers.directory import DirTier
from minipic.engine_ext.span_store.tiers.ram import RamTier
from minipic.engine_ext.span_store.tiers.writer import TierWriter


class TieredStore:
    """RAM first, then each persistent tier in order; persistent writes off the caller's thread.

    ``put`` stores in RAM at once and hands the entry to each tier's writer thread; if a
    writer's queue is full (``queue_size`` entries or ``max_pending_bytes``) that write is
    dropped and counted (``skipped_queue_full``) — the caller never blocks on a disk. Until its
    writes finish an entry is *pending*: ``get``/``has`` report it as ``"ram"`` (it is in host
    memory), even if the RAM tier evicted it or there is none. A hit in a persistent tier is
    promoted into RAM. Faults in a tier (even a tier's own bug) are misses, never exceptions;
    an invalid key is a ``ValueError`` at once, in the caller's thread.
    """

    def __init__(self, ram: RamTier | None, tiers: Sequence[DirTier], *,
                 queue_size: int = 256, max_pending_bytes: int = 512 << 20,
                 close_timeout_s: float = 30.0) -> None:
        names = [t.name for t in tiers]
        if len(set(names)) != len(names) or RAM_SOURCE in names:
            raise ValueError(f"tier names must be unique and not {RAM_SOURCE!r}: {names}")
        self.ram = ram
        self.tiers = list(tiers)
        self.close_timeout_s = close_timeout_s
        self._lock = threading.Lock()
        self._pending: dict[str, list[Any]] = {}  # key -> [entry, writers still to finish]
        self._closed = False
        self._c = {"misses": 0, "queued": 0, "skipped_queue_full": 0, "skipped_writes_off": 0,
                   "skipped_closed": 0, "tier_errors": 0}
        self._hits = dict.fromkeys([RAM_SOURCE, *names], 0)
        self._logged: set[str] = set()
        self._writers = [TierWriter(t, queue_size, max_pending_bytes, self._write_done)
                         for t in self.tiers]

    def get(self, key: str) -> tuple[Entry, str] | None:
        """``(entry, source)`` with source ``"ram"`` or a tier's name, or None."""
        if self.tiers:
            check_key(key)
        entry = self.ram.get(key) if self.ram is not None else None
        if entry is None:
            with self._lock:
                pending = self._pending.get(key)
            entry = pending[0] if pending else None
        if entry is not None:
            self._hit(RAM_SOURCE)
            return entry, RAM_SOURCE
        for tier in self.tiers:
            try:
                entry = tier.get(key)
            except Exception:
                self._tier_fault(tier, "get")
                continue
            if entry is not None:
                if self.ram is not None:
                    self.ram.put(key, entry)
                self._hit(tier.name)
                return entry, tier.name
        with self._lock:
            self._c["misses"] += 1
        return None

    def has(self, key: str) -> str | None:
        """Which source holds ``key``: ``"ram"`` (RAM tier or pending write), then the first
        tier whose ``has`` says so (unverified), else None. Touches no LRU order."""
        if self.tiers:
            check_key(key)
        if self.ram is not None and key in self.ram:
            return RAM_SOURCE
        with self._lock:
            if key in self._pending:
                return RAM_SOURCE
        for tier in self.tiers:
            try:
                if tier.has(key):
                    return tier.name
            except Exception:
                self._tier_fault(tier, "has")
        return None

    def put(self, key: str, entry: Entry) -> bool:
        """RAM now; each persistent tier through its writer (never blocks; see class doc).
        True if the entry is held somewhere afterwards (RAM, or queued for a tier): the
        scheduler only counts on entries that are."""
        if self.tiers:
            check_key(key)  # in the caller's thread: a bad key is the caller's bug
        in_ram = False
        if self.ram is not None:
            self.ram.put(key, entry)
            in_ram = key in self.ram
        with self._lock:
            if self._closed:
                self._c["skipped_closed"] += 1
                return in_ram
            if key in self._pending:
                return True  # already on its way
            slot = [entry, 1]  # this call holds one reference until every writer has it
            self._pending[key] = slot
        queued = False
        for writer in self._writers:
            if not writer.tier.writes_enabled:
                outcome = "skipped_writes_off"
            else:
                with self._lock:
                    slot[1] += 1  # before offering: the writer may finish at once
                if writer.offer(key, entry):
                    outcome = "queued"
                    queued = True
                else:
                    with self._lock:
                        slot[1] -= 1
                    outcome = "skipped_queue_full"
            with self._lock:
                self._c[outcome] += 1
        self._write_done(key)  # drop this call's reference
        return in_ram or queued

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued write has been attempted (or ``timeout`` seconds passed;
        ``stats()["pending_writes"]`` then says how many remain)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for writer in self._writers:
            if not writer.wait_idle(deadline):
                return

    def close(self) -> None:
        """Finish pending writes (up to ``close_timeout_s``), then stop the writers. Idempotent;
        afterwards ``put`` stores in RAM only."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.flush(self.close_timeout_s)
        for writer in self._writers:
            writer.close(timeout=1.0)

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict:
        with self._lock:
            out: dict[str, Any] = {"hits": dict(self._hits), **self._c,
                                   "pending_writes": len(self._pending)}
        out["writer_failed"] = sum(w.failed for w in self._writers)
        out["writer_errors"] = sum(w.errors for w in self._writers)
        out["ram"] = self.ram.stats() if self.ram is not None else None
        out["tiers"] = {t.name: t.stats() for t in self.tiers}
        return out

    def _write_done(self, key: str) -> None:
        with self._lock:
            slot = self._pending.get(key)
            if slot is not None:
                slot[1] -= 1
                if slot[1] <= 0:
                    del self._pending[key]

    def _hit(self, source: str) -> None:
        with self._lock:
            self._hits[source] += 1

    def _tier_fault(self, tier: DirTier, op: str) -> None:
        with self._lock:
            self._c["tier_errors"] += 1
            first = tier.name not in self._logged
            self._logged.add(tier.name)
        if first:
            logger.exception("span store: tier %r failed in %s; treated as a miss", tier.name, op)
