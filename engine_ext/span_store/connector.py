"""The span store behind vLLM's KV-connector API (``KVConnectorBase_V1``, loaded by module path).

**What is stored.** Every full span-chained block an engine computes -- in a span prefill, a
hole of the lookup past misses, or a cold final -- once: the block's pages of every attention
layer as the engine holds them, and the table slot it was written at (its home; on CPU the
cached keys are rotated there). Span-chained blocks (``span_hashing.span_chained_blocks``) are the
SSEP-led block of a span and the blocks that follow it up to the next PDEP block: span
isolation in attention makes their KV a function of the span's tokens alone, which is what their
hash names. No other block is stored: its KV depends on the whole prefix.

**Under which key.** ``keys.entry_key``: the block hash (tokens, span chain, ``cache_salt``, LoRA)
mixed with a fingerprint of everything else the KV bytes depend on (``fingerprint_facts``: the
weights' content and revision, overrides, quantization, dtype, block size, rotary config, span
config, KV page layout and minipic's engine code), and vLLM's root hash. Entries also carry the
fingerprint in their header, under the store's MAC (``tiers/files.py``): an entry written by
another model, config or build, or by anyone without the store's secret, is never read. Weights
that cannot be found to hash (a hub id not downloaded) mean no store, and so does any input the
fingerprint cannot name (``unnamed_kv_inputs``: weights loaded from a URI or by tensorizer, a
callable ``hf_overrides``, a drafter or external config that cannot be found). With tensor
parallelism each rank stores its own part of an entry (``keys.rank_key``) and a block counts as
loaded only when every rank loaded its part (``scheduler_side``). A tenant's blocks hash with its
salt, so another tenant (or no salt) never finds them, at any position.

**Why a loaded block is the block the engine would have computed.** Its bytes are the pages
the engine wrote when it computed that hash, and the home slot they were rotated at comes with
them (``worker_side``); reads elsewhere move the keys by the slot difference like any cached
block's. How loads reach requests anywhere in a prompt (not only right after the local hit,
which is all this API's ``get_num_new_matched_tokens`` can report): ``scheduler_side``.

Tiers (``tiers``): a bounded RAM LRU in the worker, in front of a bounded crash-safe directory on
local disk and, for several replicas, a shared directory. vLLM's KV connector API is an
extension point, so the store adds no rows to ``engine_ext/vllm_surface/patches.py``: it is reached
from the lookup wrapper ``engine_ext/holes/scheduler_lookup.py`` already installs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from minipic.engine_ext.holes.scheduler_lookup import attach_span_store, full_attention_manager
from minipic.engine_ext.span_store.keys import config_fingerprint, rank_key
from minipic.span_contract.errors import EngineIntegrationError
from minipic.span_contract.span_config import SpanConfig
from minipic.span_contract.span_store_config import SpanStoreConfig
from minipic.span_contract.weights_digest import engine_digest

logger = logging.getLogger("vllm.minipic.span_store")



@dataclass
class SpanStoreMetadata(KVConnectorMetadata):
    loads: list[tuple[int, str]] = field(default_factory=list)  # (block id, key)
    saves: list[tuple[int, str, int]] = field(default_factory=list)  # (block id, key, slot)


@dataclass
class SpanStoreWorkerMetadata(KVConnectorWorkerMetadata):
    loaded: list[tuple[int, str]] = field(default_factory=list)  # (block id, source tier)
    failed: list[int] = field(default_factory=list)
    saved: list[str] = field(default_factory=list)
    not_saved: list[str] = field(default_factory=list)
    # increases of the tiers' write counters ("write_pauses_disk": 1, ...; metrics.WRITE_EVENTS)
    tier_events: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, SpanStoreWorkerMetadata)
        events = dict(self.tier_events)
        for name, count in other.tier_events.items():
            events[name] = events.get(name, 0) + count
        return SpanStoreWorkerMetadata(self.loaded + other.loaded, self.failed + other.failed,
                                       self.saved + other.saved,
                                       self.not_saved + other.not_saved, events)


def _tiers(config: SpanStoreConfig, fingerprint: str) -> list[Any]:
    from minipic.engine_ext.span_store.tiers import DirTier
    from minipic.engine_ext.span_store.tiers.probe import MetadataProbe

    tiers = []
    floor = None if config.min_free_gib is None else int(config.min_free_gib * 2**30)
    for name, folder, gib in (("disk", config.dir, config.disk_gib),
                              ("shared", config.shared_dir, config.shared_gib)):
        if folder:
            probe = MetadataProbe(deadline_s=config.probe_deadline_ms / 1e3,
                                  budget_s=config.probe_budget_ms / 1e3,
                                  name=f"span-store-probe-{name}")
            tiers.append(DirTier(folder, int(gib * 2**30), fingerprint, name,
                                 group_access=config.group_access, group=config.group,
                                 min_free_bytes=floor, probe=probe))
    return [tier for tier in tiers if tier.usable]  # an unusable one said why in the log


def engine_weights_digest(config: SpanStoreConfig, model_config: Any) -> tuple[str, str | None]:
    """The digest of the weights this engine process finds, and why the store must be off
    (None: it may run).

    Computed here, in every engine process, from the files on this node -- never taken from
    the launcher, nor from the launcher's digest cache: a hub id the launcher hashed from an
    older cached snapshot, a replica on another node, a folder replaced during start-up, or a
    stale or written-over launcher cache entry would otherwise name this engine's KV with other
    weights' digest. The engine keeps its own cache (``weights_digest.ENGINE_CACHE``) under a
    stamp a replacement cannot keep (size, mtime, ctime, inode, device) and re-hashes the
    configs and safetensors headers at every start, so a restart of unchanged files reads a
    few MB, and new files are hashed in full once. The launcher's digest (which lookups,
    ``minipic index`` and the span index use without loading weights) must agree, or those
    would look for keys this engine never writes: a disagreement turns the store off, loudly
    (``weights_mismatch``). ``--load-format`` and the loader's options are in the fingerprint
    (``fingerprint_facts``): random weights from the same folder get other keys."""
    from minipic.span_contract.span_store_config import weights_identity

    own = engine_digest(str(model_config.model), model_config.revision)
    if not own:
        return "", "weights_unknown"
    of = weights_identity(str(model_config.model), model_config.revision)
    if config.weights_digest and config.weights_of == of and config.weights_digest != own:
        return "", "weights_mismatch"
    return own, None


def engine_store_check(config: SpanStoreConfig, vllm_config: Any
                       ) -> tuple[str, str | None, str | None]:
    """(weights digest, why the store is off or None, the detail to log): first what the
    fingerprint cannot name (``unnamed_kv_inputs``: ``kv_inputs_unnamed``), then the weights
    (``engine_weights_digest``)."""
    from minipic.span_contract.span_store_config import unnamed_kv_inputs

    unnamed = unnamed_kv_inputs(vllm_config, engine_digest)
    if unnamed is not None:
        return "", "kv_inputs_unnamed", unnamed
    digest, reason = engine_weights_digest(config, vllm_config.model_config)
    return digest, reason, None


class MinipicSpanStore(KVConnectorBase_V1):
    """Span KV outside the engine: saved once when computed, loaded wherever a prompt needs it."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.config = SpanStoreConfig.from_extra_config(extra)
        span = SpanConfig.from_env()
        if span is None:
            raise EngineIntegrationError(
                "the minipic span store needs the minipic plugin (span hashing and the "
                "position-free backend); start the engine through minipic")
        if vllm_config.scheduler_config.async_scheduling or (
                vllm_config.parallel_config.pipeline_parallel_size > 1):
            raise EngineIntegrationError(
                "the minipic span store fills blocks before a step's forward; async "
                "scheduling and pipeline parallelism would let a fill race an earlier write")
        self.ranks = vllm_config.parallel_config.tensor_parallel_size
        self.rank = 0
        digest, self.off_reason, detail = engine_store_check(self.config, vllm_config)
        self.fingerprint = config_fingerprint(vllm_config, digest, span, digest_of=engine_digest)
        self.block_size = vllm_config.cache_config.block_size
        if self.off_reason is None:
            tiers = _tiers(self.config, self.fingerprint)
        else:
            tiers = []
            self.config = self.config.model_copy(update={"ram_mib": 0})
            model = vllm_config.model_config.model
            if self.off_reason == "weights_mismatch":
                logger.error(
                    "minipic span store is OFF for this engine: the weights of %s on this node "
                    "differ from the digest the launcher computed (%s); the folder changed "
                    "during start-up, a hub id resolved to another snapshot, or this replica "
                    "runs on another node with other files. Restart the server to use the "
                    "store again (span tokens are computed meanwhile, answers stay right)",
                    model, self.config.weights_digest)
            elif self.off_reason == "kv_inputs_unnamed" and role == KVConnectorRole.SCHEDULER:
                logger.warning("minipic span store is off: %s; a store entry must name "
                               "everything its KV was computed from (span tokens are "
                               "computed, answers stay right)", detail)
            elif role == KVConnectorRole.SCHEDULER:
                logger.warning(
                    "minipic span store is off: the weights of %s cannot be found to name "
                    "them (a model id that is not downloaded?); a store entry must name the "
                    "weights that computed it", model)
        self.lookup = None
        self.pages = None
        self._results = SpanStoreWorkerMetadata()
        if role == KVConnectorRole.SCHEDULER:
            from minipic.engine_ext.span_store.scheduler_side import StoreLookup

            sched = vllm_config.scheduler_config
            chunk = (getattr(sched, "long_prefill_token_threshold", 0)
                     or sched.max_num_batched_tokens) if sched.enable_chunked_prefill else None
            self.lookup = StoreLookup(tiers, self.fingerprint, self.block_size, span,
                                      chunk_tokens=chunk, ranks=self.ranks)
            if self.off_reason is not None:
                self.lookup.counts[f"off_{self.off_reason}"] = 1  # /metrics says so
            logger.info("minipic span store: fingerprint %s, tiers %s (RAM %d MiB in the "
                        "worker)", self.fingerprint, [t.name for t in tiers], self.config.ram_mib)
        else:
            from minipic.engine_ext.span_store.fill_queue import FillQueue
            from minipic.engine_ext.span_store.tiers import Entry, RamTier, TieredStore
            from minipic.engine_ext.span_store.worker_side import PageCopier

            if self.ranks > 1:
                from vllm.distributed import get_tensor_model_parallel_rank

                self.rank = get_tensor_model_parallel_rank()

            ram = RamTier(self.config.ram_mib << 20) if self.config.ram_mib else None
            self.pages = PageCopier(TieredStore(ram, tiers), Entry)
            self.fills = FillQueue(self.pages.store, threads=self.config.read_threads,
                                   step_bytes=int(self.config.fill_mib_per_step * 2**20),
                                   deadline_s=self.config.read_deadline_s)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss, never a lost result

    # -- scheduler side ---------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        attach_span_store(kv_cache_manager, self)

    def promote(self, kv_cache_manager: Any, request: Any, manager: Any) -> None:
        """Called by the lookup wrapper before vLLM's own lookup (``scheduler_side``)."""
        assert self.lookup is not None
        self.lookup.promote(kv_cache_manager, request, manager)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        assert self.lookup is not None
        self.lookup.note(request)
        if self.lookup.must_wait(request):
            return None, False  # its blocks are being filled: ask again next step
        return 0, False  # store hits become pool hits, counted by the lookup itself

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        return

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self.lookup is not None and self._kv_cache_manager is not None
        loads, saves = self.lookup.plan_loads(scheduler_output, self._kv_cache_manager)
        return SpanStoreMetadata(loads=loads, saves=saves)

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        if self.lookup is None or not isinstance(meta, SpanStoreWorkerMetadata):
            return
        manager = full_attention_manager(self._kv_cache_manager)
        if manager is not None:
            self.lookup.on_worker_output(manager, meta.loaded, meta.failed, meta.saved,
                                         meta.not_saved)
        self.lookup.counts.update(meta.tier_events)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Any]:
        if self.lookup is not None:
            self.lookup.forget(request)
        return False, None

    def stats(self) -> dict[str, Any]:
        assert self.lookup is not None
        return {"fingerprint": self.fingerprint, "config": self.config.model_dump(),
                **self.lookup.stats()}

    # -- /metrics (engine_ext/span_store/metrics.py) -----------------------------------------

    def get_kv_connector_stats(self) -> Any:
        """Counters' increase since the last step (scheduler side; the worker reports none)."""
        if self.lookup is None:
            return None
        from minipic.engine_ext.span_store.metrics import SpanStoreStats

        delta = self.lookup.reported.take(self.lookup.counts)
        return SpanStoreStats(data=delta) if delta else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        from minipic.engine_ext.span_store.metrics import SpanStoreStats

        return SpanStoreStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type, type],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> Any:
        from minipic.engine_ext.span_store.metrics import SpanStorePromMetrics

        return SpanStorePromMetrics(vllm_config, metric_types, labelnames,
                                    per_engine_labelvalues)

    # -- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self.pages is not None
        self.pages.register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Fill the blocks whose reads are done before anything of the step reads the cache
        (``fill_queue``: reads run ahead on threads; a block lands when its read is done)."""
        if self.pages is None or not isinstance(kv_connector_metadata, SpanStoreMetadata):
            return
        self.fills.submit([(block_id, self._part(key))
                           for block_id, key in kv_connector_metadata.loads])
        filled, homes = [], []
        for block_id, key, found in self.fills.ready():
            try:
                got = self.pages.fill(block_id, key, found)
            except Exception:  # noqa: BLE001 (any failure is a miss, never wrong KV)
                logger.exception("minipic span store: loading %s failed", key[:16])
                got = None
            if got is None:
                self._results.failed.append(block_id)
            else:
                self._results.loaded.append((block_id, got[0]))
                filled.append(block_id)
                homes.append(got[1])
        self.pages.filled(filled, homes)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return  # fills already ran in handle_preemptions

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # whole blocks are copied once per step, in wait_for_save

    def wait_for_save(self) -> None:
        if self.pages is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, SpanStoreMetadata):
            return
        for block_id, key, slot in meta.saves:
            try:
                ok = self.pages.save(block_id, self._part(key), slot)
            except Exception:  # noqa: BLE001 (a failed save is a later miss)
                logger.exception("minipic span store: saving %s failed", key[:16])
                ok = False
            (self._results.saved if ok else self._results.not_saved).append(key)

    def _part(self, key: str) -> str:
        """This rank's part of an entry (the key itself without tensor parallelism)."""
        return rank_key(key, self.rank, self.ranks)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        results, self._results = self._results, SpanStoreWorkerMetadata()
        if self.pages is not None:
            results.tier_events = self.pages.tier_events()
        if not (results.loaded or results.failed or results.saved or results.not_saved
                or results.tier_events):
            return None
        return results

    def shutdown(self) -> None:
        if self.pages is not None:
            self.fills.close()
            self.pages.store.close()
