"""``PrioritySlots``: a bounded number of engine requests in flight, granted oldest work first.

Why not ``asyncio.Semaphore``: it grants in arrival order. When a batch starts, every question
asks for its span prefills at once, so a FIFO queue would hold the first question's final prompt
behind every other question's prefills — a barrier in disguise. Granting by priority (the
question's submission number) lets question 0's final go as soon as its spans are warm while
later questions' prefills wait their turn, which is the pipelining ISPS is about.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import AsyncIterator


class PrioritySlots:
    """At most ``limit`` holders; waiters are served lowest ``priority`` first, then FIFO."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self.in_use = 0
        self._waiters: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    @property
    def waiting(self) -> int:
        return sum(not fut.done() for _, _, fut in self._waiters)

    async def acquire(self, priority: float = 0) -> None:
        if self.in_use < self.limit and not self.waiting:
            self.in_use += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (priority, next(self._order), fut))
        try:
            await fut  # release() counts us in before waking us
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted, then cancelled: hand it on
                self.release()
            raise

    def release(self) -> None:
        self.in_use -= 1
        while self._waiters:
            _, _, fut = heapq.heappop(self._waiters)
            if not fut.done():  # skip waiters that were cancelled
                self.in_use += 1
                fut.set_result(None)
                return

    @contextlib.asynccontextmanager
    async def hold(self, priority: float = 0) -> AsyncIterator[None]:
        await self.acquire(priority)
        try:
            yield
        finally:
            self.release()
