"""The span store's EngineCore half: which blocks to load before a request runs, which to save.

**Load = promotion into the pool, one step ahead.** vLLM's connector API reports an external hit
as one contiguous run right after the local hit, which stops at the first miss; span blocks
sit anywhere in a prompt. So the store does not go through that accounting at all. When a
request that opted into span semantics is looked up (``KVCacheManager.get_computed_blocks``,
wrapped by ``engine_ext/holes/scheduler_lookup.py``), every span-chained block
(``span_chained_blocks``) that misses the pool but is in the store gets a fresh pool block, and the
worker is told (this step's connector metadata) to fill it. The request waits one step
(``get_num_new_matched_tokens`` answers None: "ask again"). The worker reports each fill; a
filled block is then inserted into the prefix cache under its hash, exactly as if the engine
had computed it, and released. At its next lookup the request finds those blocks as ordinary
pool hits -- the leading run, or runs after misses that ``hole_lookup`` attaches -- and from then
on they are ordinary cached blocks (counted as cached tokens, evictable, shareable).

Fills take only the room the pool can spare: what is left after them must hold the
request's first chunk (chunked prefill allocates chunk by chunk), and the fills that do not fit
are computed instead -- a request waiting for another's fill of the same block waits either way.
The worker reads entries ahead on threads (``fill_queue``), so a fill may land several steps
after it was asked for; the block stays held and unhashed until then.

Why one step ahead rather than hashing at once: a fill can fail (entry evicted, corrupt,
store deleted), and a hash in the pool is trusted by every request of the step. Inserted only
after the fill succeeded, a failure is a miss: the block is freed unhashed and the request
computes it.

**Save.** ``build_connector_meta`` lists, per scheduled request, the span-chained blocks this
step completes (full prompt blocks only) whose key the store does not have yet; the worker
copies them after the forward. Blocks found in the pool or the store are never re-saved.

**Tensor parallelism.** Each rank holds the KV heads of its shard, so each writes its own part of
an entry (``keys.rank_key``) and fills its own part of a block. A block is in the store only when
every rank's part is; a fill is decided only when every rank reported it (its reads may land in
different steps) and is a load only if every rank loaded -- until then the block stays held, so
no rank can be writing into a block the pool already gave to someone else; a save is known only
when every rank saved.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from minipic.engine_ext.hashing.span_hashing import span_chained_blocks
from minipic.engine_ext.holes.scheduler_steps import step_ranges
from minipic.engine_ext.span_store.keys import entry_key, rank_key
from minipic.engine_ext.span_store.metrics import StatsDelta
from minipic.span_contract.span_config import SpanConfig, spans_opted_in

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

logger = logging.getLogger("vllm.minipic.span_store")

# Keys this engine's worker saved, remembered so that a lookup finds them before the tiers' own
# index has listed them (``tiers/dir_index.py``: ``has`` touches no file either): bounded (an
# LRU), because a key the RAM tier evicted long ago is as likely on disk as any other.
MAX_KNOWN_KEYS = 1 << 16


@dataclass
class _Load:
    block: Any  # the pool block being filled (held: reference count 1)
    key: str
    index: int  # block index in the request that asked for it
    block_hash: bytes
    request: Any
    waiters: set[str] = field(default_factory=set)


class StoreLookup:
    """Scheduler-side state: known keys, fills in flight, saves planned, counters."""

    def __init__(self, tiers: list[Any], fingerprint: str, block_size: int,
                 span_config: SpanConfig, chunk_tokens: int | None = None,
                 max_known: int = MAX_KNOWN_KEYS, ranks: int = 1) -> None:
        self.tiers = tiers  # persistent tiers (``has`` only; the worker reads them)
        self.ranks = ranks  # tensor-parallel workers: each holds a part of every block
        # block id -> the sources its fill reported so far, one per rank (None: that rank failed)
        self.fill_reports: dict[int, list[str | None]] = {}
        # key -> whether each rank that reported so far saved its part
        self.save_reports: dict[str, list[bool]] = {}
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.span_config = span_config
        # the most prompt tokens one step computes for a request (chunked prefill): the room
        # a request needs beside its fills
        self.chunk_tokens = chunk_tokens
        self.max_known = max_known
        # saved by this engine's worker and held by its store (RAM or on its way), LRU
        self.known: OrderedDict[str, None] = OrderedDict()
        self.requests: dict[str, Any] = {}
        # request -> its preemption count at its store round (one round per admission)
        self.looked_up: dict[str, int] = {}
        self.pending_loads: list[tuple[int, str]] = []  # for the next metadata
        self.in_flight: dict[int, _Load] = {}  # block id -> fill
        self.in_flight_keys: dict[str, int] = {}
        self.waiting: dict[str, set[int]] = {}  # request -> fills it waits for
        self.saving: set[str] = set()
        self.counts: Counter[str] = Counter()
        # request -> tokens the store filled for it, by tier (split of its cached tokens)
        self.filled_for: dict[str, Counter[str]] = {}
        # request -> its PrefillStats (vLLM hands it to the output at the first token, so it is
        # kept here to read the request's cached tokens when it finishes)
        self.prefill_of: dict[str, Any] = {}
        self.reported = StatsDelta()  # for /metrics (``metrics``)

    # -- lookup -----------------------------------------------------------------------------

    def source_of(self, key: str) -> str | None:
        """Which tier has ``key`` (None: nobody); RAM is what this engine saved."""
        if key in self.known:
            self.known.move_to_end(key)
            return "ram"
        for tier in self.tiers:
            if all(tier.has(rank_key(key, rank, self.ranks)) for rank in range(self.ranks)):
                return str(tier.name)
        return None

    def promote(self, kv_cache_manager: Any, request: Any, manager: Any) -> None:
        """Give the request's store-held span blocks pool blocks and queue their fills."""
        rid = request.request_id
        if self.looked_up.get(rid) == request.num_preemptions or not spans_opted_in(
                getattr(request, "sampling_params", None)):
            return
        if getattr(request, "lora_request", None) is not None:
            # vLLM names an adapter by name and path, not by its weights: a store entry could
            # not say which adapter computed it, so LoRA requests neither load nor save
            return
        self.requests[rid] = request
        pool, group = manager.block_pool, manager.kv_cache_group_id
        bs = self.block_size
        hashes = request.block_hashes
        flags = span_chained_blocks(request, bs, self.span_config)
        last = min(len(hashes), (request.num_tokens - 1) // bs)  # never the logits block
        wanted: list[tuple[int, str]] = []
        waits: set[int] = set()
        hits: list[Any] = []  # the request's own pool hits: a fill must not evict them
        for index in range(last):
            cached = pool.get_cached_block(hashes[index], [group])
            if cached is not None:
                hits.append(cached[0])
                continue
            if not flags[index]:
                continue
            key = entry_key(self.fingerprint, hashes[index])
            if key in self.in_flight_keys:  # another request is having it filled
                block_id = self.in_flight_keys[key]
                self.in_flight[block_id].waiters.add(rid)
                waits.add(block_id)
            elif self.source_of(key) is not None:
                wanted.append((index, key))
        if wanted:
            pool.touch(hits)  # held while fresh blocks are taken (LRU eviction skips them)
            try:
                room = pool.get_num_free_blocks() - self._first_chunk_blocks(
                    request, len(hits) + len(waits) + len(wanted))
                if room < len(wanted):
                    # as many fills as leave room for the request's first chunk; the rest it
                    # computes (a miss costs time, never a stall or wrong KV)
                    self.counts["skipped_no_room"] += len(wanted) - max(room, 0)
                    wanted = wanted[:max(room, 0)]
                blocks = pool.get_new_blocks(len(wanted)) if wanted else []
            finally:
                pool.free_blocks(reversed(hits))
            for (index, key), block in zip(wanted, blocks, strict=True):
                load = _Load(block, key, index, hashes[index], request, {rid})
                self.in_flight[block.block_id] = load
                self.in_flight_keys[key] = block.block_id
                self.pending_loads.append((block.block_id, key))
                waits.add(block.block_id)
        self.looked_up[rid] = request.num_preemptions  # one store round per admission
        if waits:
            self.waiting[rid] = waits

    def _first_chunk_blocks(self, request: Any, covered: int) -> int:
        """Free blocks the request needs to compute its first chunk once ``covered`` of its
        blocks are hits or fills (chunked prefill allocates chunk by chunk)."""
        bs = self.block_size
        left = max(request.num_tokens - covered * bs, 1)
        if self.chunk_tokens:
            left = min(left, self.chunk_tokens)
        return -(-left // bs) + 1  # the chunk may straddle one more block

    def note(self, request: Any) -> None:
        """Every request the scheduler looks up (for its cached-token split at finish)."""
        stats = getattr(request, "prefill_stats", None)
        if stats is not None:
            self.prefill_of.setdefault(request.request_id, stats)

    def must_wait(self, request: Any) -> bool:
        return bool(self.waiting.get(request.request_id))

    # -- metadata ---------------------------------------------------------------------------

    def plan_loads(self, scheduler_output: Any, kv_cache_manager: Any
                  ) -> tuple[list[tuple[int, str]], list[tuple[int, str, int]]]:
        """This step's fills and saves ``(block id, key, table slot)``."""
        loads, self.pending_loads = self.pending_loads, []
        saves: list[tuple[int, str, int]] = []
        bs = self.block_size
        for rid, count in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(rid)
            if request is None:
                continue
            # before this step (vLLM advances it later); several holes when the step computes
            # them all (engine_ext/holes/scheduler_steps.py)
            ranges = step_ranges(request, count)
            last = min(len(request.block_hashes), request.num_prompt_tokens // bs)
            indices = [i for start, stop in ranges
                       for i in range(start // bs, min(stop // bs, last))]
            if not indices:
                continue
            flags = span_chained_blocks(request, bs, self.span_config)
            ids = kv_cache_manager.get_block_ids(rid)[0]
            for index in indices:
                if not flags[index] or index >= len(ids):
                    continue
                key = entry_key(self.fingerprint, request.block_hashes[index])
                # no stat here: a block this step computes missed the store at its lookup, and
                # a writer that finds the file already there (another replica's) skips it
                if key in self.saving or key in self.known:
                    continue
                self.saving.add(key)
                saves.append((ids[index], key, index))
        return loads, saves

    # -- worker results ---------------------------------------------------------------------

    def on_worker_output(self, manager: Any, loaded: list[tuple[int, str]],
                         failed: list[int], saved: list[str], not_saved: list[str]) -> None:
        """Hash filled blocks into the pool, free failed ones, learn saved keys.

        With several workers (vLLM concatenates their reports, each worker reporting a block
        once) a block is decided when every one reported it: cached only if every one loaded
        its part, failed if any did not."""
        loaded, failed_ids = self._decided_fills(loaded, failed)
        saved, not_saved = self._decided_saves(saved, not_saved)
        for key in saved:
            self.saving.discard(key)
            self.known[key] = None
            self.known.move_to_end(key)
            if len(self.known) > self.max_known:
                self.known.popitem(last=False)
            self.counts["saved_blocks"] += 1
        for key in not_saved:
            self.saving.discard(key)
        pool, group = manager.block_pool, manager.kv_cache_group_id
        bs = self.block_size
        for block_id, source in loaded:
            load = self._finish(block_id)
            if load is None:
                continue
            request, index = load.request, load.index
            if index < len(request.block_hashes) and request.block_hashes[index] == (
                    load.block_hash) and pool.get_cached_block(load.block_hash, [group]) is None:
                blocks = [pool.null_block] * index + [load.block]
                pool.cache_full_blocks(request, blocks, index, index + 1, bs, group)
                self.counts[f"tokens_{source}"] += bs
                self.counts["loaded_blocks"] += 1
                for rid in load.waiters & self.requests.keys():  # not finished yet
                    self.filled_for.setdefault(rid, Counter())[source] += bs
            pool.free_blocks([load.block])
        for block_id in failed_ids:
            load = self._finish(block_id)
            if load is None:
                continue
            self.known.pop(load.key, None)
            self.counts["failed_loads"] += 1
            pool.free_blocks([load.block])

    def _decided_fills(self, loaded: list[tuple[int, str]], failed: list[int]
                       ) -> tuple[list[tuple[int, str]], set[int]]:
        """The fills every rank has now reported: (loaded with a source, failed ids). Until
        then the block stays held: another rank's read has not landed yet."""
        new = [*loaded, *((block_id, None) for block_id in failed)]
        done_loaded: list[tuple[int, str]] = []
        done_failed: set[int] = set()
        for block_id, sources in _decided(self.fill_reports, new, self.ranks):
            if all(source is not None for source in sources):
                done_loaded.append((block_id, str(sources[0])))
            else:
                done_failed.add(block_id)
        return done_loaded, done_failed

    def _decided_saves(self, saved: list[str], not_saved: list[str]
                       ) -> tuple[list[str], list[str]]:
        """The saves every rank has now reported: (saved by all, not saved by some)."""
        new = [*((key, True) for key in saved), *((key, False) for key in not_saved)]
        done_saved: list[str] = []
        done_not: list[str] = []
        for key, oks in _decided(self.save_reports, new, self.ranks):
            (done_saved if all(oks) else done_not).append(key)
        return done_saved, done_not

    def _finish(self, block_id: int) -> _Load | None:
        load = self.in_flight.pop(block_id, None)
        if load is None:
            return None
        self.in_flight_keys.pop(load.key, None)
        for rid in load.waiters:
            waits = self.waiting.get(rid)
            if waits is not None:
                waits.discard(block_id)
                if not waits:
                    del self.waiting[rid]
        return load

    def forget(self, request: Any) -> None:
        """The request finished or was aborted (fills it asked for still complete); its cached
        tokens are split by source for ``/metrics``."""
        rid = request.request_id
        stats = self.prefill_of.pop(rid, None)
        self.reported.add_request(0 if stats is None else stats.num_cached_tokens,
                                  self.filled_for.pop(rid, Counter()))
        self.requests.pop(rid, None)
        self.looked_up.pop(rid, None)
        self.waiting.pop(rid, None)

    def stats(self) -> dict[str, Any]:
        return {"counts": dict(self.counts), "known_keys": len(self.known),
                "in_flight": len(self.in_flight),
                "tiers": [tier.stats() for tier in self.tiers]}


def _decided(reports: dict[K, list[V]], new: Iterable[tuple[K, V]], ranks: int
             ) -> list[tuple[K, list[V]]]:
    """Adds one step's reports (from any rank) to ``reports``; returns, and forgets, every key
    this step touched that all ``ranks`` have now reported, with their reports, in first-seen
    order. Under tensor parallelism each rank holds its own part of a block, so a block is
    loaded (or a save done) only when every rank says so."""
    touched: dict[K, None] = {}
    for key, value in new:
        reports.setdefault(key, []).append(value)
        touched[key] = None
    return [(key, reports.pop(key)) for key in touched if len(reports[key]) >= ranks]
