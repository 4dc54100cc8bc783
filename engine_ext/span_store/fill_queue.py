"""Store reads ahead of the engine's step: a thread pool, a per-step byte cap, an I/O deadline.

A fill reads a file and checks its MAC before its bytes can be copied into the pool. Done on
the step's thread, a cold disk or a network mount stalls every running decode for
as long as the reads take: 8k tokens of SmolLM2 are 256 entries of 1.47 MB. So the worker hands
each step's loads to reader threads and, at every step, copies in only what has been read --
at most ``step_bytes`` of it, so one step's copying stays short -- and reports the rest later.
The scheduler keeps a block in flight (held, unhashed, the requests that need it waiting) until
the worker reports it, so a fill may land any number of steps after it was asked for.

A read still running after ``deadline_s`` is given up: the block is reported failed, the
requests waiting for it compute it (a miss costs time, never correctness), and the late result
is dropped. ``threads=0`` reads on the step's thread, as before (the benchmark's "before").
"""

from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any


@dataclass
class _Read:
    key: str
    future: Future | None  # None: read synchronously (``result`` set)
    started: float
    result: Any = None


class FillQueue:
    """Reads of store entries for blocks the scheduler asked to fill, in asking order."""

    def __init__(self, store: Any, threads: int = 4, step_bytes: int = 64 << 20,
                 deadline_s: float = 2.0, wait_s: float = 0.02) -> None:
        if threads < 0 or step_bytes <= 0 or deadline_s <= 0 or wait_s < 0:
            raise ValueError("threads >= 0, step_bytes > 0, deadline_s > 0, wait_s >= 0")
        self.store = store
        self.step_bytes = step_bytes
        self.deadline_s = deadline_s
        self.wait_s = wait_s
        self._pool = (ThreadPoolExecutor(threads, thread_name_prefix="span-store-read")
                      if threads else None)
        self._reads: OrderedDict[int, _Read] = OrderedDict()  # block id -> its read
        self.timed_out = 0

    def __len__(self) -> int:
        return len(self._reads)

    def submit(self, loads: list[tuple[int, str]]) -> None:
        """Start reading ``(block id, key)`` entries (synchronously without threads)."""
        now = time.monotonic()
        for block_id, key in loads:
            if self._pool is None:
                self._reads[block_id] = _Read(key, None, now, self._get(key))
            else:
                self._reads[block_id] = _Read(key, self._pool.submit(self._get, key), now)

    def ready(self) -> list[tuple[int, str, Any]]:
        """This step's ``(block id, key, (entry, source) | None)``: reads done, in asking
        order, up to ``step_bytes`` (one read always goes, however large); reads past the
        deadline as None. Waits at most ``wait_s`` for reads asked for just now."""
        running = [r.future for r in self._reads.values()
                   if r.future is not None and not r.future.done()]
        if running and self.wait_s:
            wait_futures(running, timeout=self.wait_s)
        out: list[tuple[int, str, Any]] = []
        taken = 0
        now = time.monotonic()
        for block_id, read in list(self._reads.items()):
            if read.future is not None and not read.future.done():
                if now - read.started > self.deadline_s:
                    read.future.cancel()  # a late result is dropped either way
                    del self._reads[block_id]
                    self.timed_out += 1
                    out.append((block_id, read.key, None))
                continue
            found = read.result if read.future is None else read.future.result()
            size = len(found[0].payload) if found is not None else 0
            if out and taken + size > self.step_bytes:
                continue  # the next step copies it
            taken += size
            del self._reads[block_id]
            out.append((block_id, read.key, found))
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _get(self, key: str) -> Any:
        try:
            return self.store.get(key)
        except Exception:  # noqa: BLE001 (a failed read is a miss; TieredStore logs its faults)
            return None
