"""Every hole of a request in one engine step: the scheduler side of the lookup past misses
(``engine_ext/holes/scheduler_lookup.py``).

A prompt whose cached span blocks are separated by misses (cold spans, recomputed boundary
heads, the question) has several *holes*. vLLM's model runner computes one contiguous window
per request row (positions ``num_computed_tokens ..``), so the lookup past misses used to take
one engine step per hole. Here one step takes as many holes as the token budget allows:

1. **Plan** (``Scheduler._reserve_prefill_lookahead``, the last clip before allocation on both
   scheduling paths): walk the request's pinned cached runs from its computed prefix, taking
   each hole in turn and skipping each run, until the chunk's token budget is spent (the last
   hole taken may be cut: chunked prefill continues it next step). The chunk's size becomes the
   holes' token count.
2. **Allocate** (``KVCacheManager.allocate_slots``): the first hole through vLLM's own
   allocation (leading hit, watermark, admission gate, caching of its full blocks); then for
   each later hole the run before it is attached (its pin becomes the request's reference, as
   in the jump) and the hole's blocks are allocated and cached through the same manager calls,
   so the request's block list stays in table order. Holes that do not fit the free blocks are
   dropped from the step (never a partial hole allocation).
3. **Settle** (``Scheduler._update_after_schedule``, before vLLM advances the request): the step
   computes ``N`` hole tokens and skips ``A`` attached ones, so ``num_computed_tokens`` moves
   ``C -> C + A + N`` (the end of the last hole) and the worker is told ``C + A`` as the
   request's computed tokens: with ``N`` scheduled tokens its sequence length is then exactly
   the last hole's end, so vLLM's logits row (the step's last token), discard mask and
   prefill-done test are all right. The holes travel to the worker on the scheduler output
   (:data:`HOLES_ATTR`); ``engine_ext/holes/worker_positions.py`` gives their tokens their true
   positions there.

Accounting: attached tokens count as cached (prefill stats, so HTTP ``cached_tokens``) exactly
as in the jump; KV events come from vLLM's own block caching; preemption, abort and finish free
every block of the request (attached runs included) through ``KVCacheManager.free``, and
unattached runs are unpinned there (``hole_lookup``). Not planned (one hole per step, as
before): speculative decoding's lookahead slots, and a run that starts at the computed prefix
(the jump attaches it first).
"""

from __future__ import annotations

import collections
import os
import threading
from dataclasses import dataclass
from typing import Any

from minipic.engine_ext.vllm_surface.added_names import (
    CACHED_RUNS_ATTR,
    HOLES_ATTR,
    PREFILL_STEPS_ATTR,
)
from minipic.span_contract.engine_utilities import HOLE_STATS_UTILITY
from minipic.span_contract.env import HOLES_PER_STEP_ENV
from minipic.span_contract.errors import EngineIntegrationError
from minipic.span_contract.span_config import spans_opted_in

RECENT = 512  # finished prefills kept for the stats utility
# Measurement switch: "one" restores one hole per engine step (the schedule before this module),
# so benchmarks can put both side by side in one run; "all" (default) is the product.
PER_STEP_ENV = HOLES_PER_STEP_ENV
_STATE = {"all_holes": True}


def all_holes_per_step() -> bool:
    """Whether a step takes every hole that fits (read once, at install)."""
    return _STATE["all_holes"]


@dataclass
class StepHoles:
    """A multi-hole step of one request: planned at the chunk clip, realized at allocation."""

    computed: int  # the request's computed tokens when planned
    holes: list[tuple[int, int]]  # (start, end) token ranges, ascending
    attached: int = 0  # cached tokens attached between the holes
    realized: bool = False

    @property
    def tokens(self) -> int:
        return sum(end - start for start, end in self.holes)


def plan_holes(runs: list[tuple[int, list[Any]]], computed: int, budget: int,
               num_tokens: int, block_size: int) -> list[tuple[int, int]]:
    """Holes a step computes from ``computed`` on, within ``budget`` tokens.

    ``runs``: the pinned cached runs ``(first block, blocks)`` after the computed prefix,
    ascending. Each hole ends where the next run begins (the last one at ``num_tokens``); the
    last hole taken is cut where the budget ends. Empty when a run starts at ``computed``.
    """
    holes: list[tuple[int, int]] = []
    pos, left = computed, budget
    for first, blocks in runs:
        start, end = first * block_size, (first + len(blocks)) * block_size
        if end <= pos:
            continue
        if start <= pos:
            if not holes:
                return []  # a run at the computed prefix: the jump attaches it first
            pos = end
            continue
        take = min(start - pos, left)
        holes.append((pos, pos + take))
        left -= take
        if left == 0 or take < start - pos:
            return holes
        pos = end
    if left > 0 and pos < num_tokens:
        holes.append((pos, pos + min(num_tokens - pos, left)))
    return holes


def allocate_later_holes(kv_cache_manager: Any, request: Any, manager: Any, pending: Any,
                         plan: StepHoles) -> list[Any]:
    """After vLLM allocated the first hole: attach each run and allocate each later hole.

    Returns the blocks added to the request, in table order (attached runs and new blocks).
    Holes that do not fit the free blocks are dropped from ``plan`` (with the runs before
    them), so the step computes a shorter, still contiguous-per-hole plan.
    """
    block_size = manager.block_size
    rid = request.request_id
    coordinator = kv_cache_manager.coordinator
    added: list[Any] = []
    kept = plan.holes[:1]
    for start, end in plan.holes[1:]:
        first, blocks = pending.runs[0]
        req_blocks = manager.req_to_blocks[rid]
        if first * block_size + len(blocks) * block_size != start or \
                len(req_blocks) != first:
            raise EngineIntegrationError(
                f"minipic: request {rid}'s block list does not end where its cached run "
                f"begins (blocks {len(req_blocks)}, run at block {first}, hole at token "
                f"{start}); refusing a step whose table would be out of order")
        needed = -(-end // block_size) - (first + len(blocks))
        if needed > kv_cache_manager.block_pool.get_num_free_blocks():
            break  # this hole and later ones wait for a later step
        pending.runs.pop(0)
        req_blocks.extend(blocks)
        manager.num_cached_block[rid] = len(req_blocks)
        added.extend(blocks)
        plan.attached += len(blocks) * block_size
        new = coordinator.allocate_new_blocks(rid, end, end, 0)
        added.extend(new[0])
        coordinator.cache_blocks(request, min(end, request.num_tokens))
        kept.append((start, end))
    plan.holes = kept
    plan.realized = True
    return added


def _shift_output_computed(output: Any, rid: str, shift: int) -> None:
    """The worker learns ``C + A`` as the request's computed tokens (new or cached data)."""
    for data in output.scheduled_new_reqs:
        if data.req_id == rid:
            data.num_computed_tokens += shift
            return
    cached = output.scheduled_cached_reqs
    for i, cid in enumerate(cached.req_ids):
        if cid == rid:
            cached.num_computed_tokens[i] += shift
            return
    raise EngineIntegrationError(f"minipic: holed request {rid} is not in the scheduler output")


class PrefillSteps:
    """Engine steps per prompt, counted by the scheduler (the step-count tests, the bench)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.histogram: collections.Counter[int] = collections.Counter()
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT)
        self.freed_mid_holes: collections.Counter[str] = collections.Counter()
        self.multi_hole_steps = 0  # engine steps in which some request computed >1 hole
        self.shared_multi_hole_steps = 0  # ... together with other requests' tokens

    def freed(self, request: Any, pending: Any) -> None:
        """A request freed while its prompt's holes were not all computed (preempted,
        aborted): what the leak tests look for."""
        if request.num_computed_tokens >= request.num_prompt_tokens:
            return
        if not (pending.runs or pending.attached_tokens):
            return
        kind = "preempted" if str(request.status).endswith("RUNNING") else "finished"
        with self.lock:
            self.freed_mid_holes[kind] += 1

    def record(self, request: Any, steps: int, hole_tokens: int) -> None:
        with self.lock:
            self.histogram[steps] += 1
            self.recent.append({"request_id": request.request_id, "steps": steps,
                                "prompt_tokens": request.num_prompt_tokens,
                                "computed_tokens": hole_tokens})

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {"histogram": {str(k): v for k, v in sorted(self.histogram.items())},
                    "recent": list(self.recent),
                    "freed_mid_holes": dict(self.freed_mid_holes),
                    "multi_hole_steps": self.multi_hole_steps,
                    "shared_multi_hole_steps": self.shared_multi_hole_steps}


PREFILL_STEPS = PrefillSteps()


def settle(scheduler: Any, output: Any) -> None:
    """Before vLLM advances the step's requests: move holed requests over their attached runs,
    tell the worker their holes, and count prefill steps of opted-in requests."""
    holes_out: dict[str, tuple[tuple[int, int], ...]] = {}
    for rid, count in list(output.num_scheduled_tokens.items()):
        request = scheduler.requests.get(rid)
        if request is None:
            continue
        pending = request.__dict__.get(CACHED_RUNS_ATTR)
        plan: StepHoles | None = getattr(pending, "step", None) if pending else None
        computed = request.num_computed_tokens
        if plan is not None and plan.realized:
            pending.step = None
            tokens = plan.tokens
            if tokens != count:  # holes dropped at allocation: fewer tokens this step
                output.num_scheduled_tokens[rid] = tokens
                output.total_num_scheduled_tokens -= count - tokens
                count = tokens
            if plan.attached:
                pending.attached_tokens += plan.attached
                request.num_computed_tokens += plan.attached
                _shift_output_computed(output, rid, plan.attached)
                _count_cached(request, plan.attached)
            if len(plan.holes) > 1:  # (one hole left: an ordinary contiguous chunk)
                holes_out[rid] = tuple((s, e - s) for s, e in plan.holes)
        elif plan is not None:
            pending.step = None  # planned, never allocated (not scheduled after all)
        if computed < request.num_prompt_tokens and spans_opted_in(
                getattr(request, "sampling_params", None)):
            steps = request.__dict__.get(PREFILL_STEPS_ATTR, (0, 0))
            steps = (steps[0] + 1, steps[1] + count)
            request.__dict__[PREFILL_STEPS_ATTR] = steps
            if request.num_computed_tokens + count >= request.num_prompt_tokens:
                PREFILL_STEPS.record(request, *steps)
                del request.__dict__[PREFILL_STEPS_ATTR]
    if holes_out:
        setattr(output, HOLES_ATTR, holes_out)
        with PREFILL_STEPS.lock:
            PREFILL_STEPS.multi_hole_steps += 1
            PREFILL_STEPS.shared_multi_hole_steps += len(output.num_scheduled_tokens) > 1


def _count_cached(request: Any, tokens: int) -> None:
    """Attached tokens are cached tokens (prefill stats feed HTTP ``cached_tokens``)."""
    stats = getattr(request, "prefill_stats", None)
    if stats is not None and request.num_preemptions <= 0:
        stats.num_cached_tokens += tokens
        stats.num_local_cached_tokens += tokens
        stats.num_computed_tokens -= tokens


def step_ranges(request: Any, scheduled: int) -> list[tuple[int, int]]:
    """Token ranges the current step computes for ``request`` (while the scheduler builds the
    step, before vLLM advances it): its holes when it has a realized multi-hole plan, else one
    contiguous chunk (what KV connectors must save)."""
    pending = request.__dict__.get(CACHED_RUNS_ATTR)
    plan: StepHoles | None = getattr(pending, "step", None) if pending else None
    if plan is not None and plan.realized:
        return list(plan.holes)
    start = request.num_computed_tokens
    return [(start, start + scheduled)]


def _hole_stats(engine_core: Any) -> dict[str, Any]:
    """Step counts, plus the block pool's free count and the opted-in prompts mid-prefill."""
    scheduler = engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    active = {}
    for request in scheduler.running:
        if (request.num_computed_tokens < request.num_prompt_tokens
                and spans_opted_in(getattr(request, "sampling_params", None))):
            active[request.request_id] = {"computed": request.num_computed_tokens,
                                          "prompt": request.num_prompt_tokens}
    return {**PREFILL_STEPS.snapshot(), "free_blocks": pool.get_num_free_blocks(),
            "total_blocks": pool.num_gpu_blocks, "active": active}


def install() -> None:
    """Read the per-step switch; make the step counts an EngineCore utility call
    (idempotent)."""
    from vllm.v1.engine.core import EngineCore

    from minipic.engine_ext.vllm_surface import patches

    raw = os.environ.get(PER_STEP_ENV, "all").strip().lower()
    if raw not in ("all", "one"):
        raise EngineIntegrationError(f"{PER_STEP_ENV}={raw!r}: expected 'all' or 'one'")
    _STATE["all_holes"] = raw == "all"

    core = f"{EngineCore.__module__}:EngineCore"
    patches.add("holes", {f"{core}.{HOLE_STATS_UTILITY}": _hole_stats})
