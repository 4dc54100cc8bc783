"""The pages of a span request's kept copy, reserved with the request in vLLM's own block
accounting (scheduler side; the worker side is ``engine_ext/attention/kept_pool.py``).

A span request's question and the tokens it decodes run vLLM's kernel over a compact copy of
the request's real keys at their logical positions, kept from step to step. Where that copy
lives decides what happens under load:

* in memory of its own, sized by a share (the first design), nothing tied the number of copies
  to the number of running requests: at 32 span requests decoding together most found no room
  and rebuilt their copy in every layer and every step (0.29x a plain prompt's decode);
* here the copy's pages are **KV-cache blocks**, taken from vLLM's block pool with the
  request's own. vLLM's admission then covers them like any block: ``allocate_slots`` is asked
  to leave the copy's blocks free (its ``reserved_blocks``), so a request is scheduled only when
  its blocks *and* its copy's fit, and otherwise waits or preempts as any request short of KV
  space does; the copy's blocks go back to the pool with the request's (finish, abort,
  preemption) in ``KVCacheManager.free``. No memory outside the configured KV space, and every
  running span request holds its copy.

Which requests: opted-in ones that decode (``max_tokens`` above one) from the step that reaches
the end of their prompt (the question's last chunk) on. A span prefill (one token out) and the
earlier chunks of a prompt have no copy: their few plain queries, if any, get a copy built for
the step (the same result, ``masked_rows.StepCopy``). The reservation counts every token, not
only real keys (layout and sink tokens are not copied): a few percent more than the copy holds,
for a count the scheduler gets without reading the layout.

A request that could not fit the KV cache alone with its copy runs without one (vLLM would
otherwise never schedule it): the copy is a speed-up, never a condition of an answer.

The blocks reach the worker on the scheduler output (:data:`KEPT_PAGES_ATTR`,
``{request id: (block ids of group 0, of group 1, ...)}``, every scheduled request that holds
any), read by :func:`deliver` in ``Worker.execute_model``.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from minipic.engine_ext.vllm_surface.added_names import (
    KEPT_BLOCKS_ATTR,
    KEPT_GROUPS_ATTR,
    KEPT_PAGES_ATTR,
)
from minipic.span_contract.span_config import spans_opted_in

_RESERVED = "reserved_blocks"


def wants_copy(request: Any, end: int) -> bool:
    """Whether ``request`` holds a kept copy once it has computed ``end`` tokens."""
    params = getattr(request, "sampling_params", None)
    if params is None or not spans_opted_in(params):
        return False
    max_tokens = getattr(params, "max_tokens", None)
    return (max_tokens is None or max_tokens > 1) and end >= request.num_prompt_tokens


def copy_groups(kv_cache_manager: Any) -> list[tuple[int, int]]:
    """``(group id, block size)`` of every KV-cache group whose layers attend (a recurrent
    group's state is not a key sequence: no copy)."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    cached = kv_cache_manager.__dict__.get(KEPT_GROUPS_ATTR)
    if cached is None:
        groups = kv_cache_manager.kv_cache_config.kv_cache_groups
        cached = [(g, group.kv_cache_spec.block_size) for g, group in enumerate(groups)
                  if isinstance(group.kv_cache_spec, AttentionSpec)]
        kv_cache_manager.__dict__[KEPT_GROUPS_ATTR] = cached
    return cached


def _held(request: Any) -> dict[int, list[Any]]:
    return request.__dict__.setdefault(KEPT_BLOCKS_ATTR, {})


def _missing(kv_cache_manager: Any, request: Any, end: int) -> dict[int, int]:
    """Blocks each group's copy lacks for ``end`` tokens."""
    held = request.__dict__.get(KEPT_BLOCKS_ATTR, {})
    missing = {}
    for group, block_size in copy_groups(kv_cache_manager):
        need = -(-end // block_size) - len(held.get(group, ()))
        if need > 0:
            missing[group] = need
    return missing


def _wrap_allocate_slots(stock: Any) -> Any:
    signature = inspect.signature(stock)

    @functools.wraps(stock)
    def allocate_slots(self: Any, request: Any, num_new_tokens: int, *args: Any,
                       **kwargs: Any) -> Any:
        if not wants_copy(request, request.num_prompt_tokens):  # a plain request: stock
            return stock(self, request, num_new_tokens, *args, **kwargs)
        bound = signature.bind(self, request, num_new_tokens, *args, **kwargs)
        bound.apply_defaults()
        params = bound.arguments
        end = (request.num_computed_tokens + params["num_new_computed_tokens"]
               + params["num_external_computed_tokens"] + num_new_tokens)
        missing = _missing(self, request, end) if wants_copy(request, end) else {}
        extra = sum(missing.values())
        # alone with its copy the request would not fit: it runs without one
        usable = self.block_pool.num_gpu_blocks - 1  # the null block
        if extra and 2 * sum(-(-end // size) for _, size in copy_groups(self)) > usable:
            extra = 0
        if not extra:
            return stock(*bound.args, **bound.kwargs)
        params[_RESERVED] = params[_RESERVED] + extra  # vLLM leaves the copy's blocks free
        new_blocks = stock(*bound.args, **bound.kwargs)
        if new_blocks is None:
            return None  # vLLM preempts or waits, as for any request short of blocks
        if self.block_pool.get_num_free_blocks() >= extra:  # a later hole of the step took some
            taken = self.block_pool.get_new_blocks(extra)
            held = _held(request)
            for group, count in missing.items():
                held.setdefault(group, []).extend(taken[:count])
                taken = taken[count:]
        return new_blocks

    return allocate_slots


def _wrap_free(stock: Any) -> Any:
    @functools.wraps(stock)
    def free(self: Any, request: Any) -> None:
        held = request.__dict__.pop(KEPT_BLOCKS_ATTR, None)
        if held:
            self.block_pool.free_blocks(block for blocks in held.values() for block in blocks)
        stock(self, request)

    return free


def _wrap_update_after_schedule(stock: Any) -> Any:
    @functools.wraps(stock)
    def _update_after_schedule(self: Any, scheduler_output: Any) -> None:
        pages = {}
        for rid in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(rid)
            held = request.__dict__.get(KEPT_BLOCKS_ATTR) if request is not None else None
            if held:
                width = max(held) + 1
                pages[rid] = tuple([b.block_id for b in held.get(g, ())] for g in range(width))
        setattr(scheduler_output, KEPT_PAGES_ATTR, pages)
        stock(self, scheduler_output)

    return _update_after_schedule


def _wrap_execute_model(stock: Any) -> Any:
    @functools.wraps(stock)
    def execute_model(self: Any, scheduler_output: Any) -> Any:
        deliver(scheduler_output, getattr(self, "model_runner", None))
        return stock(self, scheduler_output)

    return execute_model


def deliver(scheduler_output: Any, runner: Any) -> None:
    """Hand the step's reservations to this worker's kept pools (one per KV-cache group)."""
    from minipic.engine_ext.attention import kept_pool

    groups = getattr(getattr(runner, "kv_cache_config", None), "kv_cache_groups", None) or []
    kept_pool.set_step_reservations(getattr(scheduler_output, KEPT_PAGES_ATTR, None) or {},
                                    [list(group.layer_names) for group in groups])


def install() -> None:
    """Wrap the scheduler's allocation, free and step hand-off, and the worker's step
    (idempotent; rows of feature ``kept`` in ``engine_ext/vllm_surface/patches.py``)."""
    from minipic.engine_ext.vllm_surface import patches

    kvm = "vllm.v1.core.kv_cache_manager:KVCacheManager"
    sched = "vllm.v1.core.sched.scheduler:Scheduler"
    patches.apply("kept", {
        f"{kvm}.allocate_slots": _wrap_allocate_slots,
        f"{kvm}.free": _wrap_free,
        f"{sched}._update_after_schedule": _wrap_update_after_schedule,
        "vllm.v1.worker.gpu_worker:Worker.execute_model": _wrap_execute_model,
    })
