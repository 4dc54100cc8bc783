"""What the router believes each replica holds: block hashes, as the engines announced them.

Two sources feed it, and they are kept apart because they are trusted differently:

* **stored** — counts per hash from the replica's own KV events (``BlockStored`` adds,
  ``BlockRemoved`` subtracts, ``AllBlocksCleared`` empties). vLLM may store one hash in two
  blocks, so a hash is held while its count is positive, not merely once seen.
* **expected** — hashes of requests the router just sent to a replica, before that replica's
  events could arrive (span prefills and their final are sent milliseconds apart). An expectation
  lapses after ``expect_ttl_s``: a request that failed or was aborted never stores its blocks,
  and a stale belief must not pull traffic forever.

Nothing here affects an answer: a wrong belief only sends a request where its spans must be
computed again. Pure Python (no Ray, no vLLM): the router's policy is unit-tested on it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence

ReplicaKey = Hashable


class BlockIndex:
    """Per-replica block holdings; thread-safe (KV events arrive on the subscriber thread)."""

    def __init__(self, expect_ttl_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.expect_ttl_s = expect_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._stored: dict[ReplicaKey, Counter[int]] = {}
        self._expected: dict[ReplicaKey, dict[int, float]] = {}

    # -- engine truth ---------------------------------------------------------------------------

    def stored(self, replica: ReplicaKey, hashes: Iterable[int]) -> None:
        with self._lock:
            counts = self._stored.setdefault(replica, Counter())
            expected = self._expected.get(replica, {})
            for h in hashes:
                counts[h] += 1
                expected.pop(h, None)  # confirmed

    def removed(self, replica: ReplicaKey, hashes: Iterable[int]) -> None:
        with self._lock:
            counts = self._stored.get(replica)
            if counts is None:
                return
            for h in hashes:
                left = counts.get(h, 0) - 1
                if left > 0:
                    counts[h] = left
                else:
                    counts.pop(h, None)

    def cleared(self, replica: ReplicaKey) -> None:
        """Forget what a replica held: ``AllBlocksCleared``, its stream lost beyond replay, or
        the replica gone (died, scaled down)."""
        with self._lock:
            self._stored.pop(replica, None)
            self._expected.pop(replica, None)

    # -- router's own sends ---------------------------------------------------------------------

    def expect(self, replica: ReplicaKey, hashes: Iterable[int]) -> None:
        deadline = self._clock() + self.expect_ttl_s
        with self._lock:
            stored = self._stored.get(replica, Counter())
            expected = self._expected.setdefault(replica, {})
            for h in hashes:
                if h not in stored:
                    expected[h] = deadline

    # -- queries --------------------------------------------------------------------------------

    def held(self, hashes: Sequence[int], replicas: Iterable[ReplicaKey],
             include_expected: bool = True) -> dict[ReplicaKey, int]:
        """How many of ``hashes`` each replica holds (or, with ``include_expected``, is expected
        to hold), in any position."""
        now = self._clock()
        wanted = set(hashes)
        out: dict[ReplicaKey, int] = {}
        with self._lock:
            for replica in replicas:
                stored = self._stored.get(replica)
                n = len(wanted.intersection(stored)) if stored else 0
                expected = self._expected.get(replica) if include_expected else None
                if expected:
                    for h in wanted.difference(stored or ()):
                        deadline = expected.get(h)
                        if deadline is not None:
                            if deadline >= now:
                                n += 1
                            else:
                                del expected[h]
                out[replica] = n
        return out

    def snapshot(self) -> dict[ReplicaKey, set[int]]:
        """Hashes each replica is known (by its events) to hold."""
        with self._lock:
            return {r: set(c) for r, c in self._stored.items()}

    def sizes(self) -> dict[ReplicaKey, int]:
        with self._lock:
            return {r: len(c) for r, c in self._stored.items()}
