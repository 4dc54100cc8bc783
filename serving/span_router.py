"""Where the replica is chosen: a Ray Serve request router that knows where spans are cached.

Prefix-affinity routers (Ray's ``PrefixCacheAffinityRouter``, SGLang's, llm-d's, Dynamo's) score
a replica by the *leading run* of a prompt it holds. A minipic span hashes the same at any offset
(``engine_ext/hashing/span_hashing.py``) and each engine reuses it past misses
(``engine_ext/holes/scheduler_lookup.py``), so this router scores a replica by how many of the
request's block hashes it holds **anywhere** in the prompt, as learned from the replicas' own KV
events (``serving/kv_events.py``) plus the blocks it just sent them (``serving/block_index.py``).

The policy, in order:

1. **Question affinity.** A span prefill that names its final prompt (``minipic_route_as``, sent by
   minipic's client to a cluster) carries the final's hashes and group, so the prefill goes where
   the final will go and the final follows (``group_ttl_s``): a question's spans meet on one
   replica even when all of them were cold.
2. **Most held blocks wins**; among replicas holding equally many, the shortest queue (this
   router's requests in flight, or Ray's queue length when higher).
3. **Hot spots spread.** A replica with more than ``max_imbalance`` requests in flight above the
   least-loaded one does not compete; the request goes to the best holder among the others
   (``held:spread``), or by load when none of them holds anything (``load:holders-busy``). So a
   span is never copied because it is popular: a second copy is made only when its holders are
   too busy for its traffic, or when a question needs it beside spans held elsewhere (its final
   goes where most of its blocks are and computes the rest there).
4. Nothing held anywhere (or no hashes: unreadable prompt, unmatchable hash setup): load only.

A replica whose hash setup differs from the ingress's (``hash_fingerprint``) is routed by load
only: its events could never match. A wrong belief costs a recomputed span, never an answer.

``max_imbalance`` is, unless fixed by the deployment, decided from the replicas' own reports
(``serving.store_identity``): small only while every replica reports the same span store, since
only then does a replica that misses load what another computed.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from minipic.serving import router_registry
from minipic.serving.block_index import BlockIndex
from minipic.serving.kv_events import EventSource, KvEventSubscriber
from minipic.serving.request_blocks import RoutedRequest
from minipic.serving.store_identity import STAT_KEY, StoreDecision, decide, log_decision

log = logging.getLogger(__name__)

def replica_key(replica_id: ReplicaID) -> str:
    return replica_id.unique_id


class SpanAffinityRouter(FIFOMixin, RequestRouter):
    """Score replicas by the request's span blocks they hold, anywhere in the prompt."""

    def initialize_state(self, hash_fingerprint: str | None = None,
                         max_imbalance: int | None = None, expect_ttl_s: float = 30.0,
                         group_ttl_s: float = 120.0) -> None:
        """``max_imbalance`` None: decided from the replicas' store identities (``_sync_store``),
        as for per-replica stores until every replica reported one and the same."""
        self.hash_fingerprint = hash_fingerprint
        self.fixed_imbalance = max_imbalance
        self.store: StoreDecision | None = None
        self.max_imbalance = decide([]).max_imbalance if max_imbalance is None else max_imbalance
        self.group_ttl_s = group_ttl_s
        self.index = BlockIndex(expect_ttl_s=expect_ttl_s)
        self.events = KvEventSubscriber(self.index)
        self.in_flight: Counter[str] = Counter()
        self._groups: dict[int, tuple[str, float]] = {}
        self._sources: dict[str, EventSource] = {}
        self.decisions: Counter[str] = Counter()  # why requests went where they went
        self.choose_ms = 0.0
        self.chosen = 0
        router_registry.register(self.app_name, self)

    # -- replicas and their event streams -------------------------------------------------------

    def _matchable(self, replica: RunningReplica) -> bool:
        stats = replica.routing_stats or {}
        return bool(stats.get("kv_events")) and (
            self.hash_fingerprint is None or stats.get("hash_fingerprint") == self.hash_fingerprint)

    def _sync_sources(self) -> None:
        sources = {}
        for replica in self.curr_replicas.values():
            stats = replica.routing_stats or {}
            if self._matchable(replica):
                sources[replica_key(replica.replica_id)] = EventSource(
                    stats["kv_events"], stats.get("kv_replay"))
        if sources != self._sources:
            self._sources = sources
            self.events.set_sources(sources)
        self._sync_store(self.curr_replicas.values())

    def _sync_store(self, replicas: Iterable[RunningReplica]) -> None:
        """Shared-store routing or not, from the store identity each replica reports; logged
        when it changes."""
        decision = decide((r.routing_stats or {}).get(STAT_KEY) for r in replicas)
        if decision != self.store:
            self.store = decision
            log_decision(decision)
        if self.fixed_imbalance is None:
            self.max_imbalance = decision.max_imbalance

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {replica_key(r.replica_id) for r in replicas}
        for key in set(self.in_flight) - live:
            del self.in_flight[key]
        self._sync_sources()

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        key = replica_key(replica_id)
        self.index.cleared(key)
        self._groups = {g: v for g, v in self._groups.items() if v[0] != key}
        self._sync_sources()

    # -- the decision ---------------------------------------------------------------------------

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        start = time.perf_counter()
        try:
            self._sync_sources()
            return self._rank(candidate_replicas, _routed(pending_request))
        finally:
            self.choose_ms += (time.perf_counter() - start) * 1e3
            self.chosen += 1

    def _load(self, replica: RunningReplica) -> int:
        """Requests in flight on a replica: this router's own count, or Ray's cached queue length
        when that is higher (other ingress replicas send there too)."""
        own = self.in_flight.get(replica_key(replica.replica_id), 0)
        return max(own, self.replica_queue_len_cache.get(replica.replica_id) or 0)

    def _rank(self, candidates: list[RunningReplica],
              request: RoutedRequest | None) -> list[list[RunningReplica]]:
        if not candidates:
            return []
        if request is None or not request.block_hashes:
            self.decisions["load:no-hashes"] += 1
            return [candidates]  # Ray takes the shortest queue
        by_key = {replica_key(r.replica_id): r for r in candidates}
        load = {k: self._load(r) for k, r in by_key.items()}
        least = min(load.values())

        def too_busy(key: str) -> bool:
            return load[key] - least > self.max_imbalance

        chosen = self._group_replica(request.group)
        if chosen in by_key and not too_busy(chosen):
            why = "group"
        else:
            matchable = [k for k, r in by_key.items() if self._matchable(r)]
            held = self.index.held(request.block_hashes, matchable)
            best = max(held.values(), default=0)
            # replicas within max_imbalance of the least loaded compete on what they hold
            fit = {k: held.get(k, 0) for k in by_key if not too_busy(k)}
            fit_best = max(fit.values())
            if fit_best > 0:
                why = "held" if fit_best == best else "held:spread"
                pool = [k for k, n in fit.items() if n == fit_best]
            else:
                why = "load:holders-busy" if best else "load:nothing-held"
                pool = list(fit)
            fewest = min(load[k] for k in pool)
            chosen = random.choice([k for k in pool if load[k] == fewest])
            if request.group is not None:
                # pinned now, not when Ray reports the request routed: a question's prefills
                # are sent together and must not each pick a replica by load
                self._pin(request.group, chosen)
        self.decisions[why] += 1
        return [[by_key[chosen]], [r for k, r in by_key.items() if k != chosen]]

    def _pin(self, group: int, key: str) -> None:
        self._groups[group] = (key, time.monotonic() + self.group_ttl_s)
        if len(self._groups) > 100_000:  # bounded: drop the oldest pins
            for old in list(self._groups)[:10_000]:
                del self._groups[old]

    def _group_replica(self, group: int | None) -> str | None:
        if group is None:
            return None
        entry = self._groups.get(group)
        if entry is None or entry[1] < time.monotonic():
            self._groups.pop(group, None)
            return None
        return entry[0]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        key = replica_key(replica_id)
        self.in_flight[key] += 1
        request = _routed(pending_request)
        if request is None or not request.block_hashes:
            return
        self.index.expect(key, request.block_hashes)
        if request.group is not None:
            self._pin(request.group, key)  # where it went (Ray may have taken a later rank)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        key = replica_key(replica_id)
        if self.in_flight.get(key, 0) > 0:
            self.in_flight[key] -= 1

    # -- introspection (GET /minipic/cluster) ---------------------------------------------------

    def held_by(self, hashes: list[int], include_expected: bool = True) -> dict[str, int]:
        return self.index.held(hashes, [replica_key(r) for r in self.curr_replicas],
                               include_expected)

    def state(self) -> dict[str, Any]:
        stats = self.events.stats()
        sizes = self.index.sizes()
        replicas = {}
        for rid, replica in self.curr_replicas.items():
            key = replica_key(rid)
            s = stats.get(key)
            replicas[key] = {
                "blocks_held": sizes.get(key, 0),
                "in_flight": self.in_flight.get(key, 0),
                "matchable": self._matchable(replica),
                "http": (replica.routing_stats or {}).get("http"),
                "pids": {"replica": (replica.routing_stats or {}).get("replica_pid"),
                         "server": (replica.routing_stats or {}).get("server_pid")},
                "events": vars(s) if s else None,
            }
        return {
            "router": type(self).__name__,
            "replicas": replicas,
            "decisions": dict(self.decisions),
            "choose_ms_mean": self.choose_ms / self.chosen if self.chosen else 0.0,
            "max_imbalance": self.max_imbalance,
            "store": None if self.store is None else {
                "shared": self.store.shared, "kind": self.store.kind, "why": self.store.why,
                "max_imbalance_fixed": self.fixed_imbalance is not None},
        }


class RoundRobinRouter(RequestRouter):
    """Baseline: replicas in turn, whatever they hold (for benchmarks)."""

    def initialize_state(self, **_: Any) -> None:
        self._turn = 0

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        self._turn += 1
        first = self._turn % len(ordered)
        return [[r] for r in ordered[first:] + ordered[:first]]


def _routed(pending_request: PendingRequest | None) -> RoutedRequest | None:
    if pending_request is None or not pending_request.args:
        return None
    arg = pending_request.args[0]
    return arg if isinstance(arg, RoutedRequest) else None
