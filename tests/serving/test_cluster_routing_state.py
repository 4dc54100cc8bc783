"""The router's knowledge without a cluster: the block index, and vLLM's real KV-event publisher
followed through live batches, gaps (replayed), a replay buffer that moved on, and a restart.

The publisher is vLLM's own ``ZmqEventPublisher`` on local ports; only the engine is absent.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

import pytest
from support.servers import free_port

from minipic.serving.block_index import BlockIndex

pytestmark = pytest.mark.fast


def _hashes(rng: random.Random, n: int) -> list[int]:
    return [rng.getrandbits(63) | 1 for _ in range(n)]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_index_counts_copies_and_finds_blocks_anywhere(seed: int) -> None:
    rng = random.Random(seed)
    index = BlockIndex()
    a, b = _hashes(rng, 2), _hashes(rng, 3)
    index.stored("r0", a)
    index.stored("r1", b)
    index.stored("r1", b[:1])  # vLLM may store one hash in two blocks
    request = [rng.randrange(2**63), *reversed(b), *a]  # order and position do not matter
    assert index.held(request, ["r0", "r1"]) == {"r0": 2, "r1": 3}
    index.removed("r1", b[:1])
    assert index.held(request, ["r1"]) == {"r1": 3}  # one copy left
    index.removed("r1", b[:1])
    assert index.held(request, ["r1"]) == {"r1": 2}
    index.cleared("r0")
    assert index.held(request, ["r0", "r1"]) == {"r0": 0, "r1": 2}


def test_expectations_count_until_confirmed_or_lapsed() -> None:
    clock = Clock()
    index = BlockIndex(expect_ttl_s=10, clock=clock)
    index.expect("r0", [1, 2, 3])
    assert index.held([1, 2, 3, 4], ["r0"]) == {"r0": 3}
    index.stored("r0", [1])  # confirmed: stays after the expectation would lapse
    clock.now = 11
    assert index.held([1, 2, 3], ["r0"]) == {"r0": 1}
    assert index.snapshot() == {"r0": {1}}  # expectations are never reported as engine truth


# -- KV events, from vLLM's real publisher ----------------------------------------------------


class Publisher:
    def __init__(self, buffer_steps: int = 100) -> None:
        from vllm.distributed.kv_events import ZmqEventPublisher

        pub, replay = free_port(), free_port()
        self.endpoint, self.replay = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"
        self.pub = ZmqEventPublisher(0, endpoint=f"tcp://*:{pub}",
                                     replay_endpoint=f"tcp://*:{replay}",
                                     buffer_steps=buffer_steps)

    def stored(self, hashes: list[int]) -> None:
        from vllm.distributed.kv_events import BlockStored, KVEventBatch

        self.pub.publish(KVEventBatch(ts=time.time(), events=[BlockStored(
            block_hashes=hashes, parent_block_hash=None, token_ids=[0] * (32 * len(hashes)),
            block_size=32, lora_id=None, medium="GPU", lora_name=None)]))

    def removed(self, hashes: list[int]) -> None:
        from vllm.distributed.kv_events import BlockRemoved, KVEventBatch

        self.pub.publish(KVEventBatch(ts=time.time(), events=[
            BlockRemoved(block_hashes=hashes, medium="GPU")]))

    def cleared(self) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, KVEventBatch

        self.pub.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))

    def close(self) -> None:
        self.pub.shutdown()


def _until(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture
def publisher():
    pub = Publisher()
    yield pub
    pub.close()


def test_subscriber_learns_earlier_and_live_events(publisher: Publisher, seed: int) -> None:
    from minipic.serving.kv_events import EventSource, KvEventSubscriber

    rng = random.Random(seed)
    early, late = _hashes(rng, 4), _hashes(rng, 3)
    publisher.stored(early)  # before the router existed: only the replay socket has it
    time.sleep(0.3)
    index = BlockIndex()
    sub = KvEventSubscriber(index)
    try:
        sub.set_sources({"r0": EventSource(publisher.endpoint, publisher.replay)})
        _until(lambda: index.snapshot().get("r0") == set(early))
        time.sleep(0.3)  # the SUB socket's subscription reaches the publisher
        publisher.stored(late)
        publisher.removed(early[:1])
        _until(lambda: index.snapshot().get("r0") == set(early[1:]) | set(late))
        publisher.cleared()
        _until(lambda: not index.snapshot().get("r0"))
        stats = sub.stats()["r0"]
        assert stats.gaps == 0 and stats.resets == 0 and stats.last_seq == 3
        sub.set_sources({})  # the replica went away: forgotten
        publisher.stored(late)
        time.sleep(0.3)
        assert "r0" not in index.snapshot()
    finally:
        sub.close()


def _frames(seq: int, pub: Publisher, hashes: list[int]) -> list[bytes]:
    import msgspec
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    batch = KVEventBatch(ts=0.0, events=[BlockStored(
        block_hashes=hashes, parent_block_hash=None, token_ids=[0] * 32, block_size=32,
        lora_id=None, medium="GPU", lora_name=None)])
    return [b"", seq.to_bytes(8, "big"), msgspec.msgpack.Encoder().encode(batch)]


@pytest.mark.parametrize("buffer_steps", [100, 2])
def test_gap_is_replayed_or_the_replica_is_cleared(buffer_steps: int, seed: int) -> None:
    """A live batch arrives after missed ones: the replay fills the gap while the buffer
    still has it; once the buffer moved on, the replica's holdings are dropped (routing by load
    for it) rather than kept with a hole nobody knows about."""
    from minipic.serving.kv_events import EventSource, KvEventSubscriber, _Sub

    rng = random.Random(seed)
    pub = Publisher(buffer_steps=buffer_steps)
    index = BlockIndex()
    sub = KvEventSubscriber(index)
    try:
        batches = [_hashes(rng, 2) for _ in range(6)]
        for hashes in batches:
            pub.stored(hashes)
        time.sleep(0.3)
        follow = _Sub(EventSource(pub.endpoint, pub.replay), socket=None)
        sub._on_frames("r0", follow, _frames(0, pub, batches[0]))  # first batch seen live
        sub._on_frames("r0", follow, _frames(5, pub, batches[5]))  # then 1..4 were missed
        held = index.snapshot()["r0"]
        assert follow.stats.gaps == 1
        if buffer_steps >= 6:
            assert held == {h for b in batches for h in b}
            assert follow.stats.resets == 0 and follow.stats.last_seq == 5
        else:
            assert held == set(batches[5])  # what is known for sure after the reset
            assert follow.stats.resets == 1
        sub._on_frames("r0", follow, _frames(0, pub, batches[0]))  # seq restarts: new engine
        assert index.snapshot()["r0"] == set(batches[0])
    finally:
        sub.close()
        pub.close()


# -- the span router's policy, on Ray's own router and replica classes (no cluster) -----------


@dataclass
class Candidate:
    """What ``choose_replicas`` reads of Ray's ``RunningReplica`` (whose constructor looks up
    a live actor): its id and its routing stats."""

    replica_id: Any
    routing_stats: dict[str, Any]


@pytest.fixture
def router():
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

    from minipic.serving.span_router import SpanAffinityRouter

    deployment = DeploymentID(name="engine", app_name="policy-test")
    r = SpanAffinityRouter(deployment_id=deployment,
                           handle_source=DeploymentHandleSource.UNKNOWN)
    r.initialize_state(hash_fingerprint="fp", max_imbalance=2)
    replicas = [Candidate(ReplicaID(unique_id=f"r{i}", deployment_id=deployment),
                          {"kv_events": f"tcp://127.0.0.1:{free_port()}",
                           "hash_fingerprint": "fp"}) for i in range(3)]
    yield r, replicas  # candidates are passed to _rank, as Ray passes them to choose_replicas
    r.events.close()


def _first(ranks) -> str:
    return ranks[0][0].replica_id.unique_id


def test_policy_holder_then_hot_spot_then_group(router, seed: int) -> None:
    from minipic.serving.request_blocks import RoutedRequest

    r, replicas = router
    rng = random.Random(seed)
    span, other = _hashes(rng, 4), _hashes(rng, 4)
    r.index.stored("r1", span)
    r.index.stored("r2", span[:2])  # a partial holder ranks after the full one
    ask = RoutedRequest(route="completions", body={}, block_hashes=[*other[:1], *span])
    ranks = r._rank(replicas, ask)
    assert _first(ranks) == "r1" and len(ranks[0]) == 1
    # the holder is busy beyond max_imbalance: the span gets a second copy on an idle replica
    r.in_flight["r1"] = 3
    assert _first(r._rank(replicas, ask)) == "r2"  # r2 holds part of it and is idle
    assert r.decisions["held:spread"] == 1
    r.in_flight["r2"] = 3
    assert _first(r._rank(replicas, ask)) == "r0"
    assert r.decisions["load:holders-busy"] == 1
    # nothing held: least loaded, and a question's later requests follow its first one
    r.in_flight.clear()
    r.in_flight.update({"r0": 1, "r1": 1})
    cold = RoutedRequest(route="completions", body={}, block_hashes=other[1:], group=7)
    assert _first(r._rank(replicas, cold)) == "r2"
    r.in_flight["r2"] = 2  # still within max_imbalance of the others: the pin holds
    assert _first(r._rank(replicas, cold)) == "r2" and r.decisions["group"] == 1
    # a replica whose hash setup differs is never matched by hashes
    assert r._matchable(replicas[0])
    replicas[0].routing_stats["hash_fingerprint"] = "other"
    assert not r._matchable(replicas[0])


def _span_router(max_imbalance: int | None) -> Any:
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from minipic.serving.span_router import SpanAffinityRouter

    r = SpanAffinityRouter(deployment_id=DeploymentID(name="engine", app_name="store-test"),
                           handle_source=DeploymentHandleSource.UNKNOWN)
    r.initialize_state(hash_fingerprint="fp", max_imbalance=max_imbalance)
    return r


def test_store_identity_is_one_per_directory_not_per_path(tmp_path) -> None:
    """Replicas pointed at one folder (on one node, or through a shared mount) read one identity
    however many create it at once; a folder each (the default store on each node's own disk)
    gives one each, even a copy of a store with its id file (rsync to another node)."""
    import shutil
    from concurrent.futures import ThreadPoolExecutor

    from minipic.engine_ext.span_store.tiers.directory import DirTier
    from minipic.serving.store_identity import ID_NAME, ReplicaStore, store_identity

    shared = tmp_path / "mount" / "span-store"  # not there yet: the first replica makes it
    with ThreadPoolExecutor(8) as pool:
        seen = list(pool.map(lambda _: store_identity(shared), range(8)))
    assert seen[0] and set(seen) == {seen[0]}
    assert [p.name for p in shared.iterdir()] == [ID_NAME]  # no temp file left behind
    # the real store tier on that folder keeps working, and keeps the id (its scans skip it)
    tier = DirTier(shared, 1 << 20, "fp")
    assert tier.usable and store_identity(shared) == seen[0]
    node_a, node_b = tmp_path / "a" / "span-store", tmp_path / "b" / "span-store"
    assert store_identity(node_a) != store_identity(node_b)
    copy = tmp_path / "copy"
    shutil.copytree(shared, copy)
    assert (copy / ID_NAME).read_bytes() == (shared / ID_NAME).read_bytes()
    assert store_identity(copy) not in (None, seen[0])
    # a store folder deleted under running replicas and recreated is another store
    replica = ReplicaStore(shared)
    assert replica.identity() == seen[0]
    shutil.rmtree(shared)
    again = store_identity(shared)
    assert again and again != seen[0] and replica.identity() == again


def test_router_routes_for_a_shared_store_only_when_every_replica_reports_it(
        router, seed: int, tmp_path) -> None:
    """The store is treated as shared (affinity only a tie-break: max_imbalance 1) only when
    every replica reports the same store identity: replicas whose stores are folders of the
    same path on their own nodes keep the per-replica routing (4), and the decision is logged."""
    import logging

    from minipic.serving.request_blocks import RoutedRequest
    from minipic.serving.store_identity import (
        MAX_IMBALANCE,
        MAX_IMBALANCE_SHARED_STORE,
        STAT_KEY,
        ReplicaStore,
    )

    fixed, replicas = router  # its max_imbalance was set by the deployment: never changed
    r = _span_router(None)
    records: list[logging.LogRecord] = []
    keep = logging.Handler(logging.INFO)
    keep.emit = records.append  # the router's log lines, as Serve's handlers would get them
    log = logging.getLogger("ray.serve.minipic")
    level = log.level
    log.addHandler(keep)
    log.setLevel(logging.INFO)
    try:
        one = tmp_path / "one"
        for replica in replicas:  # each replica reads the identity itself
            replica.routing_stats[STAT_KEY] = ReplicaStore(one).identity()
        r._sync_store(replicas)
        fixed._sync_store(replicas)
        assert r.store.shared and r.max_imbalance == MAX_IMBALANCE_SHARED_STORE == 1
        assert fixed.max_imbalance == 2 and fixed.state()["store"]["shared"]
        span = _hashes(random.Random(seed), 4)
        r.index.stored("r1", span)
        ask = RoutedRequest(route="completions", body={}, block_hashes=span)
        r.in_flight.update({"r0": 1, "r1": 2, "r2": 1})
        assert _first(r._rank(replicas, ask)) == "r1"  # one above the least loaded: held
        r.in_flight["r1"] = 3
        assert _first(r._rank(replicas, ask)) in {"r0", "r2"}  # two above: load decides
        # the same path on another node: r2's folder is its own
        replicas[2].routing_stats[STAT_KEY] = ReplicaStore(tmp_path / "node2").identity()
        r._sync_store(replicas)
        assert not r.store.shared and r.store.kind == "several"
        assert r.max_imbalance == MAX_IMBALANCE == 4 and not r.state()["store"]["shared"]
        assert _first(r._rank(replicas, ask)) == "r1"  # two above: the holder still gets it
        warned = [rec for rec in records if rec.levelno == logging.WARNING]
        assert len(warned) == 1 and "2 different span stores" in warned[0].getMessage()
        # a replica reporting none (no shared tier, not reported yet): per-replica routing
        del replicas[2].routing_stats[STAT_KEY]
        r._sync_store(replicas)
        assert (r.store.kind, r.max_imbalance) == ("partial", MAX_IMBALANCE)
        decisions = [rec.getMessage() for rec in records]
        assert sum("one shared store" in m for m in decisions) == 2  # r and fixed, once each
        assert len(decisions) == 4  # each change said once
        r._sync_store(replicas)
        assert len(records) == 4
    finally:
        log.removeHandler(keep)
        log.setLevel(level)
        r.events.close()


# -- the ingress's body limit, on the real ingress app (no Ray cluster, no replica) -----------


async def _post(app: Any, path: str, content: Any, headers: dict[str, str]) -> Any:
    import httpx

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as client:
        return await client.post(path, content=content, headers=headers)


def _recorded(rng: random.Random, sizes: list[int], pulled: list[int]) -> Any:
    """A request body sent as the server asks for it, recording each chunk handed over."""
    async def body():
        for size in sizes:
            pulled.append(size)
            yield rng.randbytes(size)

    return body()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions",
                                  "/minipic/cluster/held"])
async def test_ingress_refuses_an_oversized_body_before_reading_it(
        path: str, monkeypatch, seed: int) -> None:
    """The cluster's URL applies ``--max-body-mib`` as a server does, before it holds, parses or
    hashes a body: a declared length over the limit is refused without reading a byte, a
    chunked body as soon as it passes the limit; the answer is the replicas' own 413. The
    ingress's routes (where replicas are called) are reached only by bodies within the limit:
    outside a Serve replica they fail on the missing replica context, which the refused
    requests never meet."""
    from fastapi import FastAPI
    from ray.serve.exceptions import RayServeException

    from minipic.serving.documents.bodies import Limits
    from minipic.serving.documents.middleware import DocumentsMiddleware
    from minipic.serving.ingress import app
    from minipic.span_contract.env import MAX_BODY_MIB_ENV

    rng = random.Random(seed)
    monkeypatch.setenv(MAX_BODY_MIB_ENV, f"{rng.uniform(0.002, 0.05):.6f}")
    limit = Limits.from_env().body_bytes
    json_headers = {"content-type": "application/json"}

    pulled: list[int] = []
    declared = limit + rng.randint(1, 1 << 20)
    sizes = [declared // 4] * 3 + [declared - 3 * (declared // 4)]
    refused = await _post(app, path, _recorded(rng, sizes, pulled),
                          {**json_headers, "content-length": str(declared)})
    assert refused.status_code == 413 and pulled == []  # not a byte read

    chunks = [rng.randint(100, max(101, limit // 7)) for _ in range(64)]
    assert sum(chunks) > limit
    chunked = await _post(app, path, _recorded(rng, chunks, pulled), json_headers)
    assert chunked.status_code == 413
    assert "content-length" not in chunked.request.headers  # chunked: length unknown
    assert sum(pulled[:-1]) <= limit < sum(pulled) < sum(chunks)  # stopped at the limit

    # the same answer a replica's server gives (its documents middleware, real)
    replica = DocumentsMiddleware(FastAPI(), Limits.from_env())
    theirs = await _post(replica, "/v1/chat/completions", b"x" * (limit + 1), json_headers)
    assert theirs.status_code == 413
    assert refused.json() == chunked.json() == theirs.json()
    assert refused.json()["error"]["type"] == "RequestTooLargeError"
    assert str(limit) in refused.json()["error"]["message"]

    # exactly at the limit (either way of sending it): past the bound, into the routes
    body = b'{"prompt": "' + b"a" * (limit - 14) + b'"}'
    assert len(body) == limit
    with pytest.raises(RayServeException, match="replica"):
        await _post(app, path, body, json_headers)
    with pytest.raises(RayServeException, match="replica"):
        await _post(app, path, _recorded(rng, [limit], []), json_headers)


@pytest.mark.parametrize("argv, message", [
    (["--replicas", "0"], "at least 1"),
    (["--replicas", "2", "--no-pic"], "needs the plugin"),
    (["--replicas", "2", "--", "--max-num-seqs", "4"], "not passed to replicas"),
])
def test_serve_replicas_refuses_bad_flags_clearly(argv: list[str], message: str) -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "minipic.cli", "serve", "--model", "tiny-llama",
                           *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_router_refuses_a_vllm_whose_hashing_it_was_not_checked_against(monkeypatch) -> None:
    """The router hashes with vLLM's own classes; if their signatures moved it must stop, not
    route on hashes that silently differ from the engine's."""
    from vllm.v1.core import kv_cache_utils

    from minipic.serving.request_blocks import HashSetup, RequestBlockHasher, none_hash_seed
    from minipic.span_contract.errors import EngineIntegrationError
    from minipic.span_contract.span_config import SpanConfig

    # this process's own seed: building a hasher sets vLLM's root hash for the process
    setup = HashSetup(SpanConfig(block_size=32, ssep_id=1, pdep_id=2, pad_id=0),
                      seed=none_hash_seed("sha256"))
    RequestBlockHasher(setup, None)  # the installed vLLM: fine
    monkeypatch.setattr(kv_cache_utils, "maybe_convert_block_hash", lambda h, bits=64: h)
    with pytest.raises(EngineIntegrationError, match="maybe_convert_block_hash"):
        RequestBlockHasher(setup, None)
