"""Lookup past misses: reuse every cached span block of a prompt, compute only the holes.

**The vLLM invariant we bend.** vLLM's prefix cache assumes "each hash chains over the full
prefix" (``vllm/v1/core/kv_cache_utils.py``), so a hit can only ever follow hits:
``FullAttentionManager.find_longest_cache_hit`` stops at the first miss, and a request is one
contiguous prefix of computed tokens (``request.num_computed_tokens``). Span hashing
(``engine_ext/hashing/span_hashing.py``) already breaks the premise: an SSEP-led block's hash covers
only its span, so a span after a cold span (or after a recomputed boundary head) is in the cache but
the stock lookup never gets there.

**Why attaching a block after a miss is still correct.** Under span semantics every block hash
names the block's KV exactly, whatever the cache holds, because the worker enforces span
isolation (``engine_ext/attention/span_segments.py``, applied in
``engine_ext/attention/cpu_backend.py``):

* an SSEP-chained block's KV depends only on its span's tokens (its tokens attend only within
  the span) and its hash covers exactly those tokens (plus salt / LoRA keys);
* any other block's KV depends on the whole prefix, and so does its hash (the stock chain, or a
  chain from a PDEP block whose hash covers the full prefix).

Keys are stored unrotated (position-free) and rotated at the position they are read at, so a
block computed at another offset is the same block. Hence a hit is valid wherever it is found.

**How a request runs** (non-hybrid engines, one KV-cache group, requests that opted in):

1. Admission (``KVCacheManager.get_computed_blocks``): the stock leading run, plus every later
   block whose hash is cached, up to the block holding the last prompt token (which vLLM always
   computes). Those blocks are *pinned* at once (reference count + 1, so nothing evicts them
   before they are used) and kept on the request as runs ``(first block, blocks)``.
2. Chunking (``Scheduler._reserve_prefill_lookahead``, the last clip before allocation on both
   the waiting and the running path): the chunk takes every hole that fits the token budget,
   skipping the cached runs between them (``engine_ext/holes/scheduler_steps.py`` plans, allocates
   and settles such a step; the worker side is ``engine_ext/holes/worker_positions.py``). A chunk
   with one hole stops where the next cached run begins.
3. Jump (start of ``Scheduler.schedule``): a running request whose computed prefix has reached
   a cached run gets the run's blocks appended to its block list (already pinned: the pin becomes
   the request's reference), its ``num_computed_tokens`` advanced over them, and its prefill
   stats' cached tokens increased — so ``num_cached_tokens`` / HTTP ``cached_tokens`` count every
   reused token. The blocks reach the worker as "new blocks" of that request in the next
   ``allocate_slots`` (``KVCacheManager.allocate_slots``), in table order, before the chunk's
   own new blocks. Runs between the holes of one step are attached the same way, at allocation.
4. ``KVCacheManager.free`` (finish, abort, preemption) unpins whatever was not attached yet.

**The second invariant we bend: one contiguous window per request row.** vLLM's model runner
computes a request's step as the tokens ``num_computed_tokens ..`` + ``num_scheduled_tokens``,
with one logits row (its last token). A step with several holes tells the worker
``num_computed_tokens = C + A`` (``C`` computed before the step, ``A`` tokens of the runs
attached between its holes) and ``N`` scheduled tokens, so the sequence length ``C + A + N`` is
the last hole's end, and it sends the holes themselves on the scheduler output. The worker
(``engine_ext/holes/worker_positions.py``) gives each hole token its true position (so its input id,
its slot and its rotation are those of that position); attention runs one kernel row per hole
(``engine_ext/attention/step_plan.py``), each reading keys up to its own last token, so every hole
token attends to exactly what it would in a one-hole-per-step schedule; the last scheduled token is
the prompt's last token when the step ends the prompt. Correct for the same reason as above: every
block a hole reads is either computed earlier in this very step (all layers write the step's
keys before attending) or a cached block whose hash names its KV.

**Cost.** A prompt's holes take one engine step while they fit the chunk budget
(``ceil(hole tokens / budget)`` steps otherwise); a prompt whose spans are all warm has one hole
(the question) and runs exactly as before.

**Span store** (``engine_ext/span_store``, a KV connector): when configured, the lookup first
asks it for the request's span blocks that miss the pool; blocks it holds are filled into fresh
pool blocks and hashed one step later, and the request's next lookup finds them here like any
cached block (``engine_ext/span_store/scheduler_side.py``). The connector's own contiguous
"external tokens" are always 0, so nothing else of this module changes; its saves of a step
with several holes cover exactly the holes (``scheduler_steps.step_ranges``).

Not covered (stock lookup kept): hybrid models (recurrent state depends on the whole prefix),
engines with several KV-cache groups, other KV connectors, requests without span opt-in.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any

from minipic.engine_ext.holes import scheduler_steps, worker_positions
from minipic.engine_ext.vllm_surface.added_names import CACHED_RUNS_ATTR, SPAN_STORE_ATTR
from minipic.span_contract.errors import EngineIntegrationError
from minipic.span_contract.span_config import spans_opted_in

logger = logging.getLogger("vllm.minipic.hole_lookup")




@dataclass
class CachedRuns:
    """Cached blocks of one request beyond its computed prefix, pinned until attached."""

    runs: list[tuple[int, list[Any]]]  # (first block index, blocks), ascending, disjoint
    to_deliver: list[Any] = field(default_factory=list)  # attached, not yet sent to the worker
    attached_tokens: int = 0
    step: scheduler_steps.StepHoles | None = None  # this step's holes, when it computes several

    def next_start(self, after_token: int, block_size: int) -> int | None:
        """First token of the first run that starts after ``after_token``."""
        for start, _ in self.runs:
            if start * block_size > after_token:
                return start * block_size
        return None


def attach_span_store(kv_cache_manager: Any, store: Any) -> None:
    """Have the lookup ask ``store`` (the span store's scheduler half) before vLLM's own lookup.

    Why here: the store's loads are promotions into the pool, so they must happen before the
    prefix lookup of the same request (``store.promote(kv_cache_manager, request, manager)``),
    and the lookup wrapper is the one place that runs then.
    """
    kv_cache_manager.__dict__[SPAN_STORE_ATTR] = store


def full_attention_manager(kv_cache_manager: Any) -> Any | None:
    """The one manager of a single-group full-attention engine (None: lookup stays stock)."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    managers = getattr(kv_cache_manager.coordinator, "single_type_managers", ())
    if len(managers) != 1 or type(managers[0]) is not FullAttentionManager:
        return None
    manager = managers[0]
    if manager.block_pool.hash_block_size != manager.block_size:
        return None
    return manager


def find_cached_runs(kv_cache_manager: Any, request: Any, num_leading_tokens: int,
                     max_cache_hit_length: int | None = None) -> list[tuple[int, list[Any]]]:
    """Cached blocks after the leading hit, grouped in runs of consecutive block indices.

    ``max_cache_hit_length`` (vLLM 0.33's lookup bound; default ``num_tokens - 1``, as vLLM's):
    no attached block reaches past that many tokens, so a bound a connector or the scheduler
    sets holds for the hits past misses too.
    """
    manager = full_attention_manager(kv_cache_manager)
    if manager is None:
        return []
    block_size = manager.block_size
    hashes = request.block_hashes
    # Never the block holding the last prompt token: vLLM must compute it for the logits.
    bound = request.num_tokens - 1
    if max_cache_hit_length is not None:
        bound = min(bound, max_cache_hit_length)
    last = min(len(hashes), max(bound, 0) // block_size)
    group = [manager.kv_cache_group_id]
    runs: list[tuple[int, list[Any]]] = []
    for index in range(num_leading_tokens // block_size + 1, last):
        hit = manager.block_pool.get_cached_block(hashes[index], group)
        if hit is None:
            continue
        if runs and runs[-1][0] + len(runs[-1][1]) == index:
            runs[-1][1].append(hit[0])
        else:
            runs.append((index, [hit[0]]))
    return runs


def _unpin_runs(kv_cache_manager: Any, pending: CachedRuns) -> None:
    blocks = [block for _, run in pending.runs for block in run]
    pending.runs = []
    if blocks:
        kv_cache_manager.block_pool.free_blocks(reversed(blocks))


def _release(kv_cache_manager: Any, request: Any, freeing: bool = False) -> None:
    """Unpin the runs a request holds but has not attached (its own blocks are freed by vLLM)."""
    pending: CachedRuns | None = request.__dict__.pop(CACHED_RUNS_ATTR, None)
    if pending is not None:
        if freeing:
            scheduler_steps.PREFILL_STEPS.freed(request, pending)
        _unpin_runs(kv_cache_manager, pending)


def attach_reached_runs(kv_cache_manager: Any, request: Any) -> int:
    """Attach every cached run the request's computed prefix has reached; tokens attached."""
    pending: CachedRuns | None = request.__dict__.get(CACHED_RUNS_ATTR)
    if pending is None or not pending.runs:
        return 0
    manager = full_attention_manager(kv_cache_manager)
    if manager is None:
        return 0
    block_size = manager.block_size
    rid = request.request_id
    attached = 0
    while pending.runs and pending.runs[0][0] * block_size == request.num_computed_tokens:
        first, blocks = pending.runs.pop(0)
        # The hole just computed is full blocks: make sure it is cached (hashed) before the
        # attached blocks, so vLLM's "blocks before num_cached_block are cached" stays true.
        kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        req_blocks = manager.req_to_blocks[rid]
        if len(req_blocks) != request.num_computed_tokens // block_size:
            # Blocks allocated past the computed prefix (not a layout this module creates):
            # give the remaining runs up and let vLLM compute them, rather than guess.
            logger.warning("request %s: %d blocks for %d computed tokens; cached runs after "
                           "token %d are recomputed", rid, len(req_blocks),
                           request.num_computed_tokens, request.num_computed_tokens)
            pending.runs.insert(0, (first, blocks))
            _unpin_runs(kv_cache_manager, pending)
            break
        req_blocks.extend(blocks)
        manager.num_cached_block[rid] = len(req_blocks)
        pending.to_deliver.extend(blocks)
        tokens = len(blocks) * block_size
        request.num_computed_tokens += tokens
        attached += tokens
    if attached:
        pending.attached_tokens += attached
        stats = getattr(request, "prefill_stats", None)
        if stats is not None and request.num_preemptions <= 0:
            stats.num_cached_tokens += attached
            stats.num_local_cached_tokens += attached
            stats.num_computed_tokens -= attached
    return attached


# -- vLLM wrappers ----------------------------------------------------------------------------


def _wrap_get_computed_blocks(stock: Any) -> Any:
    @functools.wraps(stock)
    def get_computed_blocks(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        # vLLM 0.33 passes max_cache_hit_length (0.32: no further parameter)
        bound = kwargs.get("max_cache_hit_length", args[0] if args else None)
        _release(self, request)  # a re-lookup (admission retried) starts from scratch
        store = self.__dict__.get(SPAN_STORE_ATTR)
        if store is not None and self.prefix_cache_lookup_enabled(request):
            manager = full_attention_manager(self)
            if manager is not None:  # store-held span blocks get pool blocks and fills
                store.promote(self, request, manager)
        blocks, num_hit, boundary = stock(self, request, *args, **kwargs)
        if (spans_opted_in(getattr(request, "sampling_params", None))
                and self.prefix_cache_lookup_enabled(request)):
            runs = find_cached_runs(self, request, num_hit, bound)
            if runs:
                self.block_pool.touch([b for _, run in runs for b in run])
                request.__dict__[CACHED_RUNS_ATTR] = CachedRuns(runs=runs)
        return blocks, num_hit, boundary

    return get_computed_blocks


def _wrap_allocate_slots(stock: Any) -> Any:
    @functools.wraps(stock)
    def allocate_slots(self: Any, request: Any, num_new_tokens: int, *args: Any,
                       **kwargs: Any) -> Any:
        pending: CachedRuns | None = request.__dict__.get(CACHED_RUNS_ATTR)
        plan = pending.step if pending is not None else None
        added: list[Any] = []
        if plan is not None and not plan.realized:
            new_computed = kwargs.get("num_new_computed_tokens", args[0] if args else 0)
            external = kwargs.get("num_external_computed_tokens",
                                  args[3] if len(args) > 3 else 0)
            computed = request.num_computed_tokens + new_computed + external
            if computed != plan.computed or num_new_tokens != plan.tokens:
                raise EngineIntegrationError(
                    f"minipic: request {request.request_id} was planned {plan.tokens} hole "
                    f"tokens from token {plan.computed} but allocation asks {num_new_tokens} "
                    f"from {computed} (the scheduler changed the chunk after its last clip)")
            first_start, first_end = plan.holes[0]
            new_blocks = stock(self, request, first_end - first_start, *args, **kwargs)
            if new_blocks is None:
                return None  # vLLM preempts or waits, then allocates again with this plan
            manager = full_attention_manager(self)
            added = scheduler_steps.allocate_later_holes(self, request, manager, pending, plan)
        else:
            new_blocks = stock(self, request, num_new_tokens, *args, **kwargs)
        if new_blocks is None or pending is None or not (pending.to_deliver or added):
            return new_blocks
        # The worker appends a running request's new block ids to its table: blocks attached
        # by the jump come first, then the first hole's, then each run and hole after it.
        groups = new_blocks.blocks
        merged = (pending.to_deliver + list(groups[0]) + added, *groups[1:])
        pending.to_deliver = []
        return self.create_kv_cache_blocks(merged)

    return allocate_slots


def _wrap_free(stock: Any) -> Any:
    @functools.wraps(stock)
    def free(self: Any, request: Any) -> None:
        _release(self, request, freeing=True)
        stock(self, request)

    return free


def _wrap_schedule(stock: Any) -> Any:
    @functools.wraps(stock)
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        for request in self.running:
            if CACHED_RUNS_ATTR in request.__dict__:
                attach_reached_runs(self.kv_cache_manager, request)
        return stock(self, *args, **kwargs)

    return schedule


def _wrap_reserve_prefill_lookahead(stock: Any) -> Any:
    @functools.wraps(stock)
    def _reserve_prefill_lookahead(self: Any, request: Any, num_computed_tokens: int,
                                   num_new_tokens: int) -> int:
        num_new_tokens = stock(self, request, num_computed_tokens, num_new_tokens)
        pending: CachedRuns | None = request.__dict__.get(CACHED_RUNS_ATTR)
        if pending is None or not pending.runs or num_new_tokens <= 0:
            return num_new_tokens
        pending.step = None
        # spec decode's lookahead slots: one hole per step
        if not self.num_lookahead_tokens and scheduler_steps.all_holes_per_step():
            holes = scheduler_steps.plan_holes(pending.runs, num_computed_tokens, num_new_tokens,
                                          request.num_tokens, self.block_size)
            if len(holes) > 1:
                pending.step = scheduler_steps.StepHoles(computed=num_computed_tokens, holes=holes)
                return pending.step.tokens
        stop = pending.next_start(num_computed_tokens, self.block_size)
        if stop is not None and stop < num_computed_tokens + num_new_tokens:
            return stop - num_computed_tokens  # end this chunk where the cached run begins
        return num_new_tokens

    return _reserve_prefill_lookahead


def _wrap_update_after_schedule(stock: Any) -> Any:
    @functools.wraps(stock)
    def _update_after_schedule(self: Any, scheduler_output: Any) -> None:
        scheduler_steps.settle(self, scheduler_output)
        stock(self, scheduler_output)

    return _update_after_schedule


def install() -> None:
    """Wrap the vLLM methods listed in the module docstring: the scheduler's here, the model
    runner's in ``engine_ext/holes/worker_positions.py`` (EngineCore and workers; idempotent;
    checked against the patch table, ``engine_ext/vllm_surface/patches.py``)."""
    from minipic.engine_ext.vllm_surface import patches

    kvm = "vllm.v1.core.kv_cache_manager:KVCacheManager"
    sched = "vllm.v1.core.sched.scheduler:Scheduler"
    scheduler_steps.install()  # holes per step; engine steps per prompt
    patches.apply("holes", {
        **worker_positions.factories(),
        f"{kvm}.get_computed_blocks": _wrap_get_computed_blocks,
        f"{kvm}.allocate_slots": _wrap_allocate_slots,
        f"{kvm}.free": _wrap_free,
        f"{sched}.schedule": _wrap_schedule,
        f"{sched}._reserve_prefill_lookahead": _wrap_reserve_prefill_lookahead,
        f"{sched}._update_after_schedule": _wrap_update_after_schedule,
    })
