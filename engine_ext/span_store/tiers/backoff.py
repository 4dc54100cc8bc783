"""When a directory tier writes again after a fault: exponential back-off, the next write a probe.

A full disk, a quota, a read-only remount or a shard folder another replica's user created
without access for us are usually transient: an operator frees space, the mount comes back, the
folder's mode is fixed. Turning writes off for the life of the process (a restart to recover)
loses every span computed meanwhile; retrying every write hammers a failing disk from the
engine's writer thread. So writes pause for 1 s, 2 s, 4 s ... up to ``max_s``; the first write
after a pause is the probe, and its success resumes writing and resets the pause.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class WriteBackoff:
    """Thread-safe pause state of one tier's writes."""

    def __init__(self, initial_s: float = 1.0, max_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < initial_s <= max_s:
            raise ValueError(f"need 0 < initial_s <= max_s, got {initial_s}, {max_s}")
        self.initial_s = initial_s
        self.max_s = max_s
        self._clock = clock
        self._lock = threading.Lock()
        self._pause_s = 0.0  # the last pause; 0 = writing normally
        self._until = 0.0

    def like(self) -> WriteBackoff:
        """A fresh back-off with this one's pauses and clock: for another fault of the same
        tier (its secret file reading bad) that must pause and retry on its own."""
        return WriteBackoff(self.initial_s, self.max_s, self._clock)

    def allowed(self) -> bool:
        """Whether a write may be tried now (normal, or a probe after the pause ran out)."""
        with self._lock:
            return self._clock() >= self._until

    @property
    def paused(self) -> bool:
        """Whether the last write attempt failed (writes are off or probing)."""
        with self._lock:
            return self._pause_s > 0

    def failed(self) -> float:
        """A write failed with a "takes no writes" error: pause, twice as long as last time.
        Returns the pause in seconds."""
        with self._lock:
            self._pause_s = min(self.max_s, self._pause_s * 2 or self.initial_s)
            self._until = self._clock() + self._pause_s
            return self._pause_s

    def succeeded(self) -> bool:
        """A write succeeded; True if that ended a pause (the probe worked)."""
        with self._lock:
            resumed = self._pause_s > 0
            self._pause_s = 0.0
            self._until = 0.0
            return resumed
