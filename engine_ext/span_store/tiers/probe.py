"""Asking the filesystem whether an entry exists without letting it stall the scheduler.

``DirTier.has`` answers from its in-memory index (``dir_index``), which learns of entries other
processes wrote only at its next listing. Without more, a replica that prefilled a document a
moment ago would not be found by another replica's next request on the same folder. So an
index miss is checked on the folder too -- but the scheduler's thread never makes that call:
one ``lstat`` at a time runs on a daemon thread of its own, and the scheduler waits for it at
most ``deadline_s``, and in all at most ``budget_s`` per ``window_s``:

* a local disk answers in microseconds (the thread hand-off is most of the cost);
* a slow network mount spends the budget quickly and lookups then answer from the index alone
  until the window ends: the stall a cold prompt adds to running decodes is bounded by
  ``budget_s`` per ``window_s`` (5% by default), whatever the mount's latency;
* a hung mount leaves one probe hanging on the probe thread; until it returns, no further probe
  is started and lookups answer from the index. The scheduler never waits past the deadline.

"Unknown" (budget spent, deadline passed, a probe still hanging) is a miss: the block is
computed, the answer stays right.
"""

from __future__ import annotations

import os
import queue
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

# A probe's answer waits at most this long: an lstat takes microseconds locally, but the probe
# thread may first wait for the GIL (Python switches threads every 5 ms)
DEADLINE_S = 0.02
BUDGET_S = 0.05
WINDOW_S = 1.0


def _is_regular_file(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


class MetadataProbe:
    """``is_file(path)`` off the caller's thread, with a deadline and a time budget (module
    docstring). ``budget_s=0`` turns probing off (the index alone answers)."""

    def __init__(self, deadline_s: float = DEADLINE_S, budget_s: float = BUDGET_S,
                 window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic,
                 name: str = "span-store-probe") -> None:
        self.deadline_s = deadline_s
        self.budget_s = budget_s
        self.window_s = window_s
        self._clock = clock
        self._name = name
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple[str, Future]] | None = None
        self._hanging: Future | None = None
        self._window_start = clock()
        self._spent = 0.0
        self.counts = {"probes": 0, "probe_hits": 0, "probes_skipped": 0, "probe_timeouts": 0}

    def is_file(self, path: str | os.PathLike) -> bool:
        """Whether a regular file is at ``path`` (no symlink followed); False when unknown."""
        with self._lock:
            if not self._may_probe():
                self.counts["probes_skipped"] += 1
                return False
            job: Future = Future()
            self._worker().put((os.fspath(path), job))
            self.counts["probes"] += 1
        started = self._clock()
        try:
            found = job.result(timeout=self.deadline_s)
        except FutureTimeout:
            with self._lock:
                self._hanging = job
                self.counts["probe_timeouts"] += 1
            found = False
        with self._lock:
            self._spent += self._clock() - started
            if found:
                self.counts["probe_hits"] += 1
        return found

    def _may_probe(self) -> bool:
        """Under the lock: no probe hanging, and budget left in this window."""
        if self.budget_s <= 0:
            return False
        if self._hanging is not None:
            if not self._hanging.done():
                return False
            self._hanging = None
        now = self._clock()
        if now - self._window_start >= self.window_s:
            self._window_start, self._spent = now, 0.0
        return self._spent < self.budget_s

    def _worker(self) -> queue.SimpleQueue:
        """Under the lock: the probe thread's queue (the thread starts with the first probe; a
        daemon, so a probe hanging on a dead mount never holds the process at exit)."""
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(self._jobs,), daemon=True,
                             name=self._name).start()
        return self._jobs


def _serve(jobs: queue.SimpleQueue) -> None:
    while True:
        path, job = jobs.get()
        if job.set_running_or_notify_cancel():
            job.set_result(_is_regular_file(path))
