"""The span store on ``/metrics``: cached prompt tokens split by source (pool, store RAM, store
disk, store shared), through vLLM's own connector-metrics extension point.

Why not vLLM's ``vllm:prompt_tokens_cached_by_source``: it splits only hits reported through
``get_num_new_matched_tokens`` (one contiguous run after the local hit), which the span store
does not use -- its loads are promoted into the pool and then found as pool hits
(``scheduler_side``), so vLLM counts them as ``device``. The store knows better: it attributes
each filled block to every request that waited for it, and when a request finishes it splits the
request's cached tokens (its ``PrefillStats.num_cached_tokens``, the count the HTTP response's
``usage.prompt_tokens_details.cached_tokens`` carries) into what the store filled for it and the
rest, which came from the pool.

How it reaches the front-end (no patch): the scheduler calls the connector's
``get_kv_connector_stats`` after every step and ships the payload in ``SchedulerStats``; the
API server's Prometheus logger builds the connector's ``KVConnectorPromMetrics`` with
``build_prom_metrics`` and calls ``observe`` with that payload. The payload is the counters'
increase since the last call, so nothing is counted twice.

Metrics (Prometheus adds ``_total`` to counters):

* ``minipic:cached_prompt_tokens{source=pool|store_ram|store_disk|store_shared}`` -- per
  finished request, at finish;
* ``minipic:span_store_loaded_tokens{source=ram|disk|shared}`` -- tokens filled from each tier,
  at fill time (a fill whose request was aborted still counts here);
* ``minipic:span_store_blocks{event=saved|loaded|failed_load|skipped_no_room}``;
* ``minipic:span_store_write_pauses{tier=disk|shared}`` and
  ``minipic:span_store_write_resumes{tier}`` -- a tier's writes paused after a full, read-only
  or forbidden disk (each failed probe pauses again, longer) and resumed when a probe write
  succeeded (``tiers/backoff.py``); reported by the worker, which does the writes;
* ``minipic:span_store_key_changes{tier}`` -- times a tier adopted a rotated store secret
  (``tiers/directory.py``: entries under the old one became misses, none deleted);
* ``minipic:span_store_off{reason}`` -- 1 when this engine turned its store off at start
  (``weights_mismatch``: the weights this engine found differ from the digest it was started
  with; ``weights_unknown``: its weights cannot be found to hash; ``kv_inputs_unnamed``: its KV
  depends on something the fingerprint cannot name, a URI or tensorizer load, a callable
  ``hf_overrides``, a drafter or config that cannot be found).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

SOURCES = ("pool", "store_ram", "store_disk", "store_shared")
TIERS = ("ram", "disk", "shared")
BLOCK_EVENTS = ("saved", "loaded", "failed_load", "skipped_no_room")
PERSISTENT_TIERS = ("disk", "shared")
# DirTier counters the worker reports
WRITE_EVENTS = ("write_pauses", "writes_resumed", "key_changes")
OFF_REASONS = ("weights_mismatch", "weights_unknown", "kv_inputs_unnamed")
# the scheduler-side counter each payload field is the increase of
_COUNT_OF_EVENT = {"saved": "saved_blocks", "loaded": "loaded_blocks",
                   "failed_load": "failed_loads", "skipped_no_room": "skipped_no_room"}


def split_cached(num_cached: int, filled: Counter[str]) -> dict[str, int]:
    """A finished request's cached tokens by source: what the store filled for it (capped at
    what it found cached: a filled block evicted before the request ran was computed) and the
    rest from the pool."""
    split = {f"store_{tier}": 0 for tier in TIERS}
    left = max(num_cached, 0)
    for tier in TIERS:
        take = min(filled.get(tier, 0), left)
        split[f"store_{tier}"] = take
        left -= take
    split["pool"] = left
    return split


class StatsDelta:
    """The scheduler side's running totals and what was last reported of them."""

    def __init__(self) -> None:
        self.totals: Counter[str] = Counter()
        self._reported: Counter[str] = Counter()

    def add_request(self, num_cached: int, filled: Counter[str]) -> None:
        for source, tokens in split_cached(num_cached, filled).items():
            self.totals[f"cached_{source}"] += tokens

    def take(self, counts: Counter[str]) -> dict[str, int]:
        """The increase of every field since the last ``take`` (only fields that grew)."""
        current = Counter(self.totals)
        for tier in TIERS:
            current[f"tokens_{tier}"] = counts.get(f"tokens_{tier}", 0)
        for event, name in _COUNT_OF_EVENT.items():
            current[event] = counts.get(name, 0)
        for event in WRITE_EVENTS:
            for tier in PERSISTENT_TIERS:
                current[f"{event}_{tier}"] = counts.get(f"{event}_{tier}", 0)
        for reason in OFF_REASONS:
            current[f"off_{reason}"] = counts.get(f"off_{reason}", 0)
        delta = {k: v - self._reported.get(k, 0) for k, v in current.items()
                 if v > self._reported.get(k, 0)}
        self._reported = current
        return delta


METRIC_PREFIX = "minipic:"


def _unregister_previous() -> None:
    """Drop minipic's collectors of an earlier engine from the global registry: a process that
    builds a second engine (tests, ``LLM`` twice) would otherwise fail on duplicate names. vLLM
    does the same for its own ``vllm:`` metrics (``unregister_vllm_metrics``)."""
    from prometheus_client import REGISTRY

    for collector in list(getattr(REGISTRY, "_collector_to_names", {})):
        if str(getattr(collector, "_name", "")).startswith(METRIC_PREFIX):
            REGISTRY.unregister(collector)


@dataclass
class SpanStoreStats(KVConnectorStats):
    """One interval's increases (``data``: field -> count), summed across steps."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = Counter(self.data)
        merged.update(other.data)
        return SpanStoreStats(data=dict(merged))

    def reduce(self) -> dict[str, int | float]:
        return dict(sorted(self.data.items()))

    def is_empty(self) -> bool:
        return not any(self.data.values())


class SpanStorePromMetrics(KVConnectorPromMetrics):
    """The counters above, one child per engine and label value."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        _unregister_previous()

        def per_label(field: str, name: str, doc: str, label: str, values: tuple[str, ...]
                      ) -> None:
            metric = self._counter_cls(name=name, documentation=doc,
                                       labelnames=[*labelnames, label])
            for value in values:
                self.children[field.format(value)] = {
                    engine: metric.labels(*labels, value)
                    for engine, labels in per_engine_labelvalues.items()}

        # payload field -> engine -> counter child
        self.children: dict[str, dict[int, Any]] = {}
        per_label(
            "cached_{}", "minipic:cached_prompt_tokens",
            "Cached prompt tokens of finished requests by where their KV came from: the pool, "
            "or the span store's RAM / disk / shared tier (minipic span store).",
            "source", SOURCES)
        per_label(
            "tokens_{}", "minipic:span_store_loaded_tokens",
            "Tokens filled into the pool from each span store tier.", "source", TIERS)
        per_label(
            "write_pauses_{}", "minipic:span_store_write_pauses",
            "Times a span store tier paused its writes after a write failed with a full, "
            "read-only or forbidden disk (retried after a growing pause).", "tier",
            PERSISTENT_TIERS)
        per_label(
            "writes_resumed_{}", "minipic:span_store_write_resumes",
            "Times a span store tier resumed writing after a pause (a probe write succeeded).",
            "tier", PERSISTENT_TIERS)
        per_label(
            "key_changes_{}", "minipic:span_store_key_changes",
            "Times a span store tier adopted a rotated store secret (entries under the old one "
            "became misses that stay until LRU evicts them).", "tier", PERSISTENT_TIERS)
        per_label(
            "off_{}", "minipic:span_store_off",
            "1 when this engine turned its span store off at start: weights_mismatch (the "
            "weights it found differ from the digest it was started with), weights_unknown "
            "(its weights cannot be found to hash) or kv_inputs_unnamed (its KV depends on "
            "what the fingerprint cannot name).", "reason", OFF_REASONS)
        per_label(
            "{}", "minipic:span_store_blocks",
            "Span store block events: saved, loaded, failed loads (a miss, the block is "
            "computed), loads skipped for want of free blocks.", "event", BLOCK_EVENTS)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for field, amount in transfer_stats_data.items():
            children = self.children.get(field)
            if children is not None and amount:
                children[engine_idx].inc(amount)
