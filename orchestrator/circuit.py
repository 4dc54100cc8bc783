"""``Circuit``: one orchestrator's shared view of whether its engine can take requests.

Why: with each request retrying on its own timer, an outage multiplies — two orchestrators made
7,471 failed sends in two minutes of a server being down. Here an outage is an event
of the orchestrator, not of each request:

- the first retryable failure *opens* the circuit; from then on no request is sent;
- one probe at a time waits (exponential backoff with jitter, counted per orchestrator:
  ``RetryPolicy.delay`` of the number of probes that failed in a row, drawn from [cap/2, cap]
  so two orchestrators drift apart) and then asks the backend's
  ``health()`` (``GET /health``). Backends without one are trusted after the wait;
- when the engine answers, its span configuration is read again (``check_config``): a server
  restarted with another block size or markers would silently never hit the cache, so that is
  ``ConfigMismatchError`` for every waiting request and for later ones, until it matches again;
- then the circuit *closes* and the waiting requests go.

A failure of a request sent before the last recovery (``generation``) is stale: it belongs to
the outage already handled and does not open the circuit again. How long a request may wait is
its own question's business (``RetryBudget``): it stops at its deadline, and every probe that
fails while it waits counts as one of its attempts — so ``max_attempts`` bounds the tries made
for a question (its sends, and the probes made on its behalf) as before the circuit existed.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Protocol

from minipic.orchestrator.errors import (
    ConfigMismatchError,
    EngineError,
    EngineUnreachableError,
    MinipicError,
)
from minipic.orchestrator.retry import RetryPolicy

RECHECK_S = 1.0  # while mismatched, re-read the server's configuration at most this often


class Budget(Protocol):
    def deadline(self) -> float:
        """``time.monotonic()`` after which a request stops waiting for the engine."""
        ...

    def failed(self) -> bool:
        """Count one failed try; False when no other one is allowed."""
        ...


class Circuit:
    """Shared by the requests of one orchestrator on one event loop."""

    def __init__(
        self, backend: object, policy: Callable[[], RetryPolicy], *,
        on_open: Callable[[MinipicError], None] | None = None,
        on_close: Callable[[float], None] | None = None,
        on_restart: Callable[[], None] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.backend = backend
        self._on_restart = on_restart
        self._policy = policy  # read at each use: options can change while it runs
        self._on_open = on_open
        self._on_close = on_close
        self._rng = rng or random.Random()
        self.generation = 0  # increments at each recovery
        self.level = 0  # probes failed in a row (sets the backoff); 0 after a success
        self.opened_at: float | None = None  # None: closed
        self.last_error: MinipicError | None = None
        self.mismatch: ConfigMismatchError | None = None
        self.probes = 0  # health probes sent (for tests and logs)
        # resolved at each probe's outcome: True when the engine is back
        self._tick: asyncio.Future[bool] | None = None
        self._waiting = 0  # requests waiting now: the probe stops when none is left
        self._probe: asyncio.Task[None] | None = None
        self._check: asyncio.Task[None] | None = None
        self._checked_at = float("-inf")

    @property
    def is_open(self) -> bool:
        return self.opened_at is not None

    # -- what requests call --------------------------------------------------------------------

    async def ready(self, budget: Budget) -> int:
        """Wait until requests may be sent; returns the generation to report failures with.

        Raises ``ConfigMismatchError`` while the engine runs another span configuration, and
        the outage's error (``EngineUnreachableError`` for a lost connection) when ``budget``
        runs out — its deadline passes, or its attempts, counting the probes that failed while
        it waited — with the engine still down.
        """
        while True:
            if self.mismatch is not None:
                await self.check_config()
            if not self.is_open:
                return self.generation
            self._start_probe()
            tick = self._tick
            assert tick is not None
            left = budget.deadline() - time.monotonic()
            if left <= 0:
                raise self._down_error()
            self._waiting += 1
            try:
                async with asyncio.timeout(left):
                    recovered = await asyncio.shield(tick)
            except TimeoutError:
                raise self._down_error() from None
            finally:
                self._waiting -= 1
            if not recovered and not budget.failed():  # a probe failed on its behalf too
                raise self._down_error()

    def failed(self, exc: MinipicError, generation: int) -> None:
        """A request sent in ``generation`` failed with a retryable error."""
        if generation != self.generation or self.is_open:
            return  # the outage it belongs to is already known (or over)
        self.opened_at = time.monotonic()
        self.last_error = exc
        self._tick = asyncio.get_running_loop().create_future()
        if self._on_open is not None:
            self._on_open(exc)

    def succeeded(self) -> None:
        self.level = 0

    async def check_config(self) -> None:
        """Re-read the engine's span configuration (one read shared by concurrent callers, at
        most one per ``RECHECK_S``); raise ``ConfigMismatchError`` when it differs."""
        running = self._check is not None and not self._check.done()
        if not running and time.monotonic() - self._checked_at >= RECHECK_S:
            self._check = asyncio.get_running_loop().create_task(self._read_config())
        if self._check is not None:
            await asyncio.shield(self._check)
        if self.mismatch is not None:
            raise self.mismatch

    # -- the probe -----------------------------------------------------------------------------

    def _start_probe(self) -> None:
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._probe_until_up(),
                                                                 name="minipic-circuit-probe")

    async def _probe_until_up(self) -> None:
        while self.is_open:
            await asyncio.sleep(self._policy().delay(self.level + 1, self._rng))
            self.probes += 1
            if await self._healthy():
                try:
                    await self._read_config(raise_unreachable=True)
                except MinipicError:
                    pass  # answered health, then not: still coming up
                else:
                    self._close()
                    return
            self.level += 1
            self._next_tick()
            if not self._waiting:
                return  # nobody to probe for; the next request that waits starts it again

    def _next_tick(self) -> None:
        """Wake the waiters (they count the failed probe) and give them a new one to wait on."""
        tick, self._tick = self._tick, asyncio.get_running_loop().create_future()
        if tick is not None and not tick.done():
            tick.set_result(False)

    async def _healthy(self) -> bool:
        health = getattr(self.backend, "health", None)
        if health is None:
            return True
        try:
            return bool(await health())
        except Exception:  # a probe that fails in any way means "not up yet"
            return False

    async def _read_config(self, *, raise_unreachable: bool = False) -> None:
        check = getattr(self.backend, "check_config", None)
        if check is None:
            return
        try:
            await check()
            self.mismatch = None
        except ConfigMismatchError as exc:
            self.mismatch = exc
        except MinipicError:
            if raise_unreachable:
                raise
        finally:
            self._checked_at = time.monotonic()
            take_restart = getattr(self.backend, "take_restart", None)
            if take_restart is not None and take_restart() and self._on_restart is not None:
                self._on_restart()  # another server process: its cache is empty

    def _close(self) -> None:
        down = time.monotonic() - (self.opened_at or time.monotonic())
        self.opened_at = None
        self.generation += 1
        if self._tick is not None and not self._tick.done():
            self._tick.set_result(True)
        if self._on_close is not None:
            self._on_close(down)

    def _down_error(self) -> EngineError:
        """The error a request gets when it stops waiting: of the kind that opened the circuit
        (still retryable: the engine may come back for a later call)."""
        down = time.monotonic() - (self.opened_at or time.monotonic())
        last = self.last_error
        message = (f"engine still failing after {down:.1f} s ({self.probes} health probes); "
                   f"last error: {type(last).__name__}: {last}")
        if last is None or isinstance(last, EngineUnreachableError):
            return EngineUnreachableError(message)
        return EngineError(message, retryable=True,
                           status_code=getattr(last, "status_code", None))
