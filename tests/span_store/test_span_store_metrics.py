"""The span store's ``/metrics`` counters (``engine_ext/span_store/metrics.py``) without an engine:
the cached-token split of a request, the per-step increases the scheduler ships, and the
Prometheus children they land in (a real ``prometheus_client`` registry). The HTTP test of the
same counters is ``test_span_store_http.py``."""

from __future__ import annotations

import random
from collections import Counter
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client import Counter as PromCounter

from minipic.engine_ext.span_store.metrics import (
    OFF_REASONS,
    PERSISTENT_TIERS,
    SOURCES,
    TIERS,
    WRITE_EVENTS,
    SpanStorePromMetrics,
    SpanStoreStats,
    StatsDelta,
    split_cached,
)

pytestmark = pytest.mark.fast


def test_split_adds_up_and_caps_store_at_cached(seed) -> None:
    rng = random.Random(seed)
    for _ in range(200):
        filled = Counter({t: rng.randrange(0, 5) * 32 for t in TIERS})
        cached = rng.randrange(-1, 12) * 32
        split = split_cached(cached, filled)
        assert set(split) == set(SOURCES)
        assert sum(split.values()) == max(cached, 0), (seed, cached, filled)
        assert all(v >= 0 for v in split.values())
        store = sum(filled.values())
        assert split["pool"] == max(cached - store, 0), (seed, cached, filled)


def test_increases_sum_to_totals(seed) -> None:
    """However steps interleave requests and fills, the shipped increases add up to the totals,
    and no step ships a field that did not grow."""
    rng = random.Random(seed)
    delta, counts = StatsDelta(), Counter()
    shipped: Counter[str] = Counter()
    want: Counter[str] = Counter()
    for _ in range(300):
        if rng.random() < 0.5:
            tier = rng.choice(TIERS)
            counts[f"tokens_{tier}"] += 32
            counts["loaded_blocks"] += 1
            want[f"tokens_{tier}"] += 32
            want["loaded"] += 1
        if rng.random() < 0.3:
            filled = Counter({rng.choice(TIERS): 32 * rng.randrange(0, 3)})
            cached = 32 * rng.randrange(0, 6)
            delta.add_request(cached, filled)
            for source, tokens in split_cached(cached, filled).items():
                want[f"cached_{source}"] += tokens
        if rng.random() < 0.1:
            counts["saved_blocks"] += 1
            want["saved"] += 1
        if rng.random() < 0.02 and not any(counts[f"off_{r}"] for r in OFF_REASONS):
            reason = rng.choice(OFF_REASONS)  # set once, at the connector's start
            counts[f"off_{reason}"] = 1
            want[f"off_{reason}"] = 1
        step = delta.take(counts)
        assert all(v > 0 for v in step.values()), step
        shipped.update(step)
    assert +shipped == +want, seed
    assert delta.take(counts) == {}


def test_prometheus_children_per_engine_and_label(seed) -> None:
    rng = random.Random(seed)
    registry = CollectorRegistry()

    def registered(cls: type) -> type:
        class InRegistry(cls):  # type: ignore[misc, valid-type]
            def __init__(self, *args, **kwargs) -> None:
                super().__init__(*args, registry=registry, **kwargs)
        return InRegistry

    types = {PromCounter: registered(PromCounter), Gauge: registered(Gauge),
             Histogram: registered(Histogram)}
    config = SimpleNamespace(kv_transfer_config=None)
    labels = {0: ["m", "0"], 1: ["m", "1"]}
    prom = SpanStorePromMetrics(config, types, ["model_name", "engine"], labels)
    stats = SpanStoreStats(data={})
    sent: dict[int, Counter[str]] = {0: Counter(), 1: Counter()}
    for _ in range(20):
        engine = rng.choice((0, 1))
        data = {f"cached_{rng.choice(SOURCES)}": rng.randrange(1, 500),
                f"tokens_{rng.choice(TIERS)}": rng.randrange(1, 500),
                f"{rng.choice(WRITE_EVENTS)}_{rng.choice(PERSISTENT_TIERS)}": rng.randrange(3),
                f"off_{rng.choice(OFF_REASONS)}": rng.randrange(2)}
        stats = SpanStoreStats(data=data).aggregate(stats)
        prom.observe(data, engine)
        sent[engine].update(data)
    for engine in (0, 1):
        for source in SOURCES:
            got = registry.get_sample_value("minipic:cached_prompt_tokens_total",
                                            {"model_name": "m", "engine": str(engine),
                                             "source": source})
            assert got == sent[engine][f"cached_{source}"], (seed, engine, source)
        for tier in TIERS:
            got = registry.get_sample_value("minipic:span_store_loaded_tokens_total",
                                            {"model_name": "m", "engine": str(engine),
                                             "source": tier})
            assert got == sent[engine][f"tokens_{tier}"], (seed, engine, tier)
        for event, metric in (("write_pauses", "write_pauses"),
                              ("writes_resumed", "write_resumes"),
                              ("key_changes", "key_changes")):
            for tier in PERSISTENT_TIERS:
                got = registry.get_sample_value(f"minipic:span_store_{metric}_total",
                                                {"model_name": "m", "engine": str(engine),
                                                 "tier": tier})
                assert got == sent[engine][f"{event}_{tier}"], (seed, engine, event, tier)
        for reason in OFF_REASONS:
            got = registry.get_sample_value("minipic:span_store_off_total",
                                            {"model_name": "m", "engine": str(engine),
                                             "reason": reason})
            assert got == sent[engine][f"off_{reason}"], (seed, engine, reason)
    # a Counter sum drops zero counts; a counter that stayed at 0 is the same report
    reduced = {k: v for k, v in stats.reduce().items() if v}
    assert reduced == dict(sorted((sent[0] + sent[1]).items()))
    assert not stats.is_empty() and SpanStoreStats(data={}).is_empty()


def test_worker_write_events_ship_once(tmp_path, seed, monkeypatch) -> None:
    """The worker's tiers' pauses and resumes reach the scheduler's counters as increases,
    each once. A full disk by ``os.open`` raising ENOSPC for the store's new files (as in
    ``test_span_store_tiers``'s fault matrix: a real ENOSPC needs a mount namespace)."""
    import errno
    import os

    from minipic.engine_ext.span_store.tiers import DirTier, Entry, TieredStore
    from minipic.engine_ext.span_store.tiers.backoff import WriteBackoff
    from minipic.engine_ext.span_store.worker_side import PageCopier

    clock = SimpleNamespace(now=0.0)
    tier = DirTier(tmp_path, 1 << 24, "fp", backoff=WriteBackoff(clock=lambda: clock.now))
    copier = PageCopier(TieredStore(None, [tier]), Entry)
    rng = random.Random(seed)
    real_open = os.open

    def full(path, flags, *args, **kwargs):
        ours = str(path).startswith(str(tmp_path)) or (  # or a temp file made in a shard
            kwargs.get("dir_fd") is not None and str(path).startswith(".tmp."))
        if ours and flags & os.O_CREAT:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", full)
    for _ in range(3):  # the first write and two failed probes: three pauses
        assert not tier.put(rng.randbytes(32).hex(), Entry(b"x" * 10, {}))
        clock.now += 1000
    paused = copier.tier_events()
    assert paused == {"write_pauses_disk": 3} and copier.tier_events() == {}
    monkeypatch.undo()
    assert tier.put(rng.randbytes(32).hex(), Entry(b"x" * 10, {}))
    resumed = copier.tier_events()
    assert resumed == {"writes_resumed_disk": 1}
    shipped = StatsDelta().take(Counter(paused) + Counter(resumed))
    assert shipped == {"write_pauses_disk": 3, "writes_resumed_disk": 1}
