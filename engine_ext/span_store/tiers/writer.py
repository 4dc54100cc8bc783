"""The background writer of one persistent tier: the caller's thread (the engine's step) hands
entries over and never waits for a disk."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from minipic.engine_ext.span_store.tiers.base import Entry, logger

if TYPE_CHECKING:
    from minipic.engine_ext.span_store.tiers.directory import DirTier


class TierWriter:
    """One persistent tier's background writer: a bounded FIFO (entries and bytes) and a
    thread that drains it into ``tier.put``."""

    def __init__(self, tier: DirTier, max_items: int, max_bytes: int,
                 done: Callable[[str], object]) -> None:
        self.tier = tier
        self.max_items = max_items
        self.max_bytes = max_bytes
        self._done = done  # callback(key) after each attempt
        self._items: deque[tuple[str, Entry]] = deque()
        self._bytes = 0
        self._busy = 0
        self._closed = False
        self._cond = threading.Condition()
        self.errors = 0
        self.failed = 0
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"span-store-writer-{tier.name}")
        self._thread.start()

    def offer(self, key: str, entry: Entry) -> bool:
        with self._cond:
            if (self._closed or len(self._items) >= self.max_items
                    or self._bytes + entry.nbytes > self.max_bytes):
                return False
            self._items.append((key, entry))
            self._bytes += entry.nbytes
            self._cond.notify_all()
            return True

    def wait_idle(self, deadline: float | None) -> bool:
        with self._cond:
            while self._items or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self, timeout: float) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._closed:
                    self._cond.wait()
                if not self._items:
                    return
                key, entry = self._items.popleft()
                self._bytes -= entry.nbytes
                self._busy += 1
            try:
                if not self.tier.put(key, entry):
                    self.failed += 1
            except Exception:  # a tier bug must not kill the writer (nor reach the engine)
                self.errors += 1
                logger.exception("span store: writer for tier %r failed on %s",
                                 self.tier.name, key)
            finally:
                self._done(key)
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()
