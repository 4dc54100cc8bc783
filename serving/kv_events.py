"""Follow each replica's vLLM KV events (``--kv-events-config``) into a ``BlockIndex``.

vLLM publishes, once per engine step that changed its cache, a ``KVEventBatch`` on a ZMQ PUB
socket: frames ``(topic, seq as 8 bytes big-endian, msgpack payload)``. ``BlockStored`` carries the
engine's own block hashes — minipic's span hashes, cut to 64 bits by vLLM — so nothing is
recomputed from token ids here. The engine also keeps its last ``buffer_steps`` batches behind a
ROUTER "replay" socket: send ``seq`` (8 bytes) from a DEALER, get every buffered batch from
``seq`` on, then an end marker whose seq is -1.

How the stream is kept honest:

* **new subscription** — replay from 0 first (the replica may have cached blocks before this
  router existed), then follow live batches, skipping those the replay already applied;
* **gap** (a live seq jumps) — replay from the first missing seq; when the replay no longer has
  it (the buffer moved on) or does not answer, the replica's holdings are cleared: the router
  routes that replica by load until new events teach it again (``resets`` counts this);
* **seq goes back** — the engine (and its publisher) restarted with an empty cache: clear.

A wrong or missing belief only costs a recomputed span on some replica, never an answer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from minipic.serving.block_index import BlockIndex

log = logging.getLogger(__name__)

END_SEQ = -1
REPLAY_TIMEOUT_MS = 2000


def _ints(hashes: list[int | bytes]) -> list[int]:
    """Event hashes as the router's ints (vLLM sends 64-bit ints unless told to send bytes)."""
    return [h if isinstance(h, int) else int.from_bytes(h, "big") for h in hashes]


@dataclass(frozen=True)
class EventSource:
    """Where one replica publishes: its PUB endpoint and its replay endpoint."""

    endpoint: str
    replay_endpoint: str | None = None


@dataclass
class SourceStats:
    last_seq: int | None = None
    batches: int = 0
    stored: int = 0
    removed: int = 0
    replays: int = 0
    resets: int = 0
    gaps: int = 0


@dataclass
class _Sub:
    source: EventSource
    socket: Any  # zmq SUB socket
    stats: SourceStats = field(default_factory=SourceStats)


class KvEventSubscriber:
    """One background thread following every replica's event stream."""

    def __init__(self, index: BlockIndex, poll_ms: int = 100) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.index = index
        self._zmq = zmq
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._ctx = zmq.Context.instance()
        self._poll_ms = poll_ms
        self._lock = threading.Lock()
        self._wanted: dict[Hashable, EventSource] = {}
        self._subs: dict[Hashable, _Sub] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="minipic-kv-events", daemon=True)
        self._thread.start()

    # -- called from the router ------------------------------------------------------------------

    def set_sources(self, sources: Mapping[Hashable, EventSource]) -> None:
        """The replicas to follow now; replicas not named any more are forgotten."""
        with self._lock:
            self._wanted = dict(sources)

    def stats(self) -> dict[Hashable, SourceStats]:
        with self._lock:
            return {key: SourceStats(**vars(sub.stats)) for key, sub in self._subs.items()}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    # -- the thread -------------------------------------------------------------------------------

    def _reconcile(self, poller: Any) -> None:
        with self._lock:
            wanted = dict(self._wanted)
        for key in [k for k, sub in self._subs.items() if wanted.get(k) != sub.source]:
            sub = self._subs.pop(key)
            poller.unregister(sub.socket)
            sub.socket.close(linger=0)
            self.index.cleared(key)
        for key, source in wanted.items():
            if key in self._subs:
                continue
            socket = self._ctx.socket(self._zmq.SUB)
            socket.setsockopt(self._zmq.SUBSCRIBE, b"")
            socket.connect(source.endpoint)
            sub = _Sub(source, socket)
            with self._lock:
                self._subs[key] = sub
            poller.register(socket, self._zmq.POLLIN)
            self._replay(key, sub, 0)

    def _run(self) -> None:
        poller = self._zmq.Poller()
        while not self._stop.is_set():
            try:
                self._reconcile(poller)
                ready = dict(poller.poll(self._poll_ms))
                for key, sub in list(self._subs.items()):
                    if sub.socket in ready:
                        while True:
                            try:
                                frames = sub.socket.recv_multipart(flags=self._zmq.NOBLOCK)
                            except self._zmq.Again:
                                break
                            self._on_frames(key, sub, frames)
            except Exception:  # the router must keep routing (by load) whatever happens here
                log.exception("minipic KV event subscriber")
                self._stop.wait(1.0)
        for sub in self._subs.values():
            sub.socket.close(linger=0)

    def _on_frames(self, key: Hashable, sub: _Sub, frames: list[bytes]) -> None:
        if len(frames) != 3:
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        last = sub.stats.last_seq
        if last is not None and seq <= last:
            if seq < last and seq == 0:  # a new publisher: the engine restarted, cache empty
                self._reset(key, sub)
            else:
                return  # already applied by a replay
        elif last is not None and seq > last + 1:
            sub.stats.gaps += 1
            if self._replay(key, sub, last + 1):
                if seq <= (sub.stats.last_seq or -1):
                    return
            else:
                self._reset(key, sub)
        self._apply(key, sub, seq, frames[2])

    def _reset(self, key: Hashable, sub: _Sub) -> None:
        sub.stats.resets += 1
        sub.stats.last_seq = None
        self.index.cleared(key)

    def _apply(self, key: Hashable, sub: _Sub, seq: int, payload: bytes) -> None:
        batch = self._decoder.decode(payload)
        for event in batch.events:
            kind = type(event).__name__
            if kind == "BlockStored":
                self.index.stored(key, _ints(event.block_hashes))
                sub.stats.stored += len(event.block_hashes)
            elif kind == "BlockRemoved":
                self.index.removed(key, _ints(event.block_hashes))
                sub.stats.removed += len(event.block_hashes)
            elif kind == "AllBlocksCleared":
                self.index.cleared(key)
        sub.stats.batches += 1
        sub.stats.last_seq = seq

    def _replay(self, key: Hashable, sub: _Sub, start: int) -> bool:
        """Apply buffered batches from ``start``; False when the buffer no longer reaches back
        to ``start`` or the replica does not answer (the caller then clears the replica)."""
        if sub.source.replay_endpoint is None:
            return start == 0  # nothing to replay from; a fresh subscription starts empty
        sub.stats.replays += 1
        dealer = self._ctx.socket(self._zmq.DEALER)
        dealer.setsockopt(self._zmq.LINGER, 0)
        dealer.connect(sub.source.replay_endpoint)
        first: int | None = None
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while dealer.poll(REPLAY_TIMEOUT_MS):
                frames = dealer.recv_multipart()
                if len(frames) != 4:
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    # an empty buffer answers with the end marker alone: fine from 0 only
                    return start == 0 or first == start
                if first is None:
                    first = seq
                    if seq != start and start != 0:
                        return False
                last = sub.stats.last_seq
                if last is None or seq > last:
                    self._apply(key, sub, seq, frames[3])
            return False
        finally:
            dealer.close()
