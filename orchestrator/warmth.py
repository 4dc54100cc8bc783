"""What the client believes is warm in the engine's prefix cache, and how that belief is checked.

Why a belief and not a fact: the engine never tells a client which blocks it holds. It evicts by
LRU under memory pressure, forgets everything on restart, and may be reset by an operator. The
registry records "this span prefill completed" so later requests can skip it (``skip_warm``),
and every final response corrects it: vLLM reports how many prompt tokens it found cached, and
the prompt builder says how many it should have found (``expected_cached_tokens``). A shortfall
names the first span that missed; that span and everything after it is marked cold.

Keys are ``(cache_salt, prefill_key)``: a span warmed under one salt is invisible under another
(vLLM mixes the salt into the first block's hash), so it must be warmed per salt.

``epoch`` counts resets. A prefill remembers the epoch it started in and warms nothing once the
registry was reset after it started. The scheduler resets once per outage (when its circuit
opens on a lost connection, ``orchestrator.circuit``), so thirty requests failing together cause
one reset, not thirty; ``reset(if_epoch=...)`` lets other callers do the same.

Stored spans (``learn_stored``): spans a span store holds (listed by ``minipic index`` in the
store's manifest, ``orchestrator.span_index``) are warm for any engine that runs on that store,
after a reset or a restart too: the store outlives both. They are kept apart, keyed by the salt's
digest (the manifest never names a salt), survive ``reset``, and leave only through
``mark_cold``: a final that found one missing (evicted from the bounded store) corrects it.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from minipic.orchestrator.span_index import salt_digest
from minipic.prompt_builder import BuiltPrompt, SpanInfo

WarmKey = tuple[str | None, str]  # (cache_salt, prefill_key)


class WarmthRegistry:
    """Span prefills believed to be cached, least recently used first (bounded: ``capacity``)."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self.epoch = 0
        self._warm: collections.OrderedDict[WarmKey, int] = collections.OrderedDict()
        self._stored: set[tuple[str | None, str]] = set()  # (salt digest, prefill key)

    def __len__(self) -> int:
        return len(self._warm)

    def __contains__(self, key: WarmKey) -> bool:
        return key in self._warm or self._is_stored(key)

    def _is_stored(self, key: WarmKey) -> bool:
        return bool(self._stored) and (salt_digest(key[0]), key[1]) in self._stored

    def is_warm(self, key: WarmKey) -> bool:
        if key in self._warm:
            self._warm.move_to_end(key)
            return True
        return self._is_stored(key)

    def learn_stored(self, keys: set[tuple[str | None, str]]) -> int:
        """Spans a span store holds, as ``(salt digest, prefill key)``; returns how many are
        new. Warm from now on, resets included (see the module docstring)."""
        before = len(self._stored)
        self._stored.update(keys)
        return len(self._stored) - before

    @property
    def stored(self) -> int:
        """How many stored spans the registry knows of."""
        return len(self._stored)

    def mark_warm(self, key: WarmKey, tokens: int = 0, *, epoch: int | None = None) -> bool:
        """Record a completed prefill. Ignored (returns False) when it ran in an older epoch:
        a prefill that finished before a restart warmed a cache that no longer exists."""
        if epoch is not None and epoch != self.epoch:
            return False
        self._warm[key] = tokens
        self._warm.move_to_end(key)
        while len(self._warm) > self.capacity:
            self._warm.popitem(last=False)
        return True

    def mark_cold(self, keys: list[WarmKey] | set[WarmKey]) -> None:
        for key in keys:
            self._warm.pop(key, None)
            if self._stored:
                self._stored.discard((salt_digest(key[0]), key[1]))

    def reset(self, *, if_epoch: int | None = None) -> bool:
        """Forget what the engine's pool held (it restarted or was reset); stored spans stay
        (the store was not reset). Returns whether it reset."""
        if if_epoch is not None and if_epoch != self.epoch:
            return False
        self._warm.clear()
        self.epoch += 1
        return True


@dataclass(frozen=True)
class CacheCheck:
    """A final response's cached-token count held against the prompt's layout."""

    expected: int
    cached: int
    hits: dict[int, bool | None]  # position in prompt.spans -> reused? (None: not expected)
    cold_keys: tuple[str, ...]  # prefill keys to re-warm, in prompt order

    @property
    def ok(self) -> bool:
        return self.cached >= self.expected


def _expected_end(span: SpanInfo, expected: int) -> int | None:
    """Prompt offset up to which this span must be cached for the lookup to count it, or None
    when a stock lookup is not expected to reach it (it lies at or past the first planned miss)."""
    if span.prefill_key is None or span.reused_block_count == 0 or span.start >= expected:
        return None
    return min(span.end, expected)


def check_cache(prompt: BuiltPrompt, cached_tokens: int) -> CacheCheck:
    """Which of the prompt's warmed spans the engine actually reused.

    minipic's engine reuses every cached block, holes allowed, so ``cached_tokens`` is a count,
    not a frontier: a shortfall says *that* some span was cold, not which. Spans are attributed
    in prompt order (the first ``cached_tokens`` worth counted as hits), which is exact when the
    cold spans are the last ones and otherwise names a warm span as a re-warm candidate (a
    re-warm of a warm span costs one block of recompute). Correctness never depends on it: the
    engine computed the cold spans in isolation inside the final.
    """
    expected = prompt.expected_cached_tokens
    hits: dict[int, bool | None] = {}
    cold: list[str] = []
    for i, span in enumerate(prompt.spans):
        end = _expected_end(span, expected)
        if end is None or span.prefill_key is None:
            hits[i] = None
            continue
        hit = cached_tokens >= end
        hits[i] = hit
        if not hit and span.prefill_key not in cold:
            cold.append(span.prefill_key)
    return CacheCheck(expected=expected, cached=cached_tokens, hits=hits, cold_keys=tuple(cold))
