"""Sparse recurrent-state checkpoints inside vLLM's EngineCore (the ``ckpt`` plugin feature).

Why hooks are needed (vLLM 0.32, ``mamba_cache_mode="align"``): a hybrid model's recurrent layers
(GDN / Mamba) can resume a request only from a state that (a) was *materialised* — vLLM writes the
state only at the end of a prefill chunk — and (b) was *kept and hashed* in the prefix cache.
Stock vLLM decides both by itself: chunk ends fall where the token budget and a few mandatory
stops (the prompt tail, a Marconi-style shared-prefix junction) put them, and with
``prefix_cache_retention_interval=0`` only those stops are kept. Neither follows a plan, so a
plan from ``checkpoint_planner`` (docs/design.md §4) could not be realised without these hooks.

All hooks run in the **EngineCore** process (where the scheduler and KV cache manager live);
the worker is untouched. They act only on requests that have a plan (see
``engine_ext.recurrent.policy``); everything else keeps stock behaviour.

``Scheduler.__init__``
    attaches a ``CheckpointPolicy`` built from ``MINIPIC_CKPT_CONFIG``, the engine's recurrent
    block size and ``max_model_len`` — only when the engine really runs align-mode hybrid caching.
``Scheduler._mamba_block_aligned_split``  (materialise)
    clips a prefill chunk at the first planned position inside it, so the state at every planned
    position is written. In strict mode (``keep_tail=False``) it also lifts the stock stop at the
    prompt tail in the prompt's final chunk, a stop that only existed to cache a state the plan
    does not keep.
``KVCacheManager.get_computed_blocks``  (observe)
    records the request's overlap depth — the longest prefix the *dense* attention KV has cached,
    i.e. the reconciled hit plus vLLM's "uncached common prefix" — for the learned plan; in strict
    mode it also drops the shared-prefix junction so vLLM neither stops nor keeps state there.
``MambaManager.cache_blocks``  (keep)
    passes the planned positions as the ``replay_boundaries`` with retention 0, so
    ``reachable_block_mask`` hashes the state blocks at exactly those positions; the rest become
    unhashed scratch and return to the free pool. Attention groups are never touched: their KV
    stays dense.
``MambaManager._cache_partial_tail_block``
    in strict mode refuses the prompt-tail re-key unless the tail is a planned position.
``EngineCore.minipic_ckpt_stats`` / ``minipic_ckpt_configure``
    utility methods (called through ``EngineCoreClient.call_utility``, so they work with the
    EngineCore in its own process): retained state blocks and bytes, the positions along a token
    sequence that hold state, the current plan; and swapping the policy at run time.

A request's plan is resolved once, at its first scheduling, and stored on the request, so a
re-plan never changes the checkpoints of a request half-way through its prefill.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from typing import Any

from minipic.engine_ext.recurrent.policy import (
    OVERRIDE_KEY,
    SERVER,
    CheckpointConfig,
    CheckpointPolicy,
    RequestPlan,
    override_of,
    parse_override,
    positions_in,
)
from minipic.engine_ext.vllm_surface.added_names import (
    CHECKPOINT_PLAN_ATTR,
    CHECKPOINT_POLICY_ATTR,
    CHECKPOINT_SEEN_ATTR,
)
from minipic.span_contract.engine_utilities import (
    CHECKPOINT_CONFIGURE_UTILITY,
    CHECKPOINT_STATS_UTILITY,
)

logger = logging.getLogger("minipic.ckpt")

_UNSET = object()


# --------------------------------------------------------------------------------------------
# per-request plan


def plan_of(policy: CheckpointPolicy, request: Any) -> RequestPlan | None:
    """The request's plan, resolved on first use and then fixed for the request's lifetime."""
    plan = request.__dict__.get(CHECKPOINT_PLAN_ATTR, _UNSET)
    if plan is _UNSET:
        try:
            override = override_of(request.sampling_params)
        except ValueError as exc:  # the front-end validates; this is a client it did not see
            logger.warning("request %s: ignoring bad %s (%s)", request.request_id,
                           OVERRIDE_KEY, exc)
            override = SERVER
        plan = policy.resolve(override)
        request.__dict__[CHECKPOINT_PLAN_ATTR] = plan
    return plan


def _attached_plan(request: Any) -> RequestPlan | None:
    """The plan a scheduler hook already stored (managers have no policy of their own)."""
    plan = request.__dict__.get(CHECKPOINT_PLAN_ATTR)
    return plan if isinstance(plan, RequestPlan) else None


# --------------------------------------------------------------------------------------------
# hooks


def _recurrent_block_size(kv_cache_config: Any) -> int:
    """Tokens per recurrent-state block: the only positions where align mode can keep state."""
    from vllm.v1.kv_cache_interface import MambaSpec

    sizes = {g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups
             if isinstance(g.kv_cache_spec, MambaSpec)}
    if len(sizes) != 1:
        raise RuntimeError(f"minipic ckpt expects one recurrent block size, got {sorted(sizes)}")
    return sizes.pop()


def _attach_policy(scheduler: Any) -> None:
    """Give a freshly built scheduler (and its KV cache manager) the checkpoint policy."""
    cache_config = scheduler.cache_config
    if not getattr(scheduler, "need_mamba_block_aligned_split", False):
        logger.warning(
            "minipic ckpt: inactive — the engine has no recurrent layers cached in align mode "
            "(needs a hybrid model with prefix caching on)"
        )
        return
    # The groups' specs are authoritative: cache_config.mamba_block_size can still hold the
    # requested size when the hybrid alignment enlarged the block (32 -> 544 here).
    block_size = _recurrent_block_size(scheduler.kv_cache_config)
    policy = CheckpointPolicy(_engine_checkpoint_config(scheduler), block_size,
                              scheduler.max_model_len)
    scheduler.__dict__[CHECKPOINT_POLICY_ATTR] = policy
    scheduler.kv_cache_manager.__dict__[CHECKPOINT_POLICY_ATTR] = policy
    logger.warning(
        "minipic ckpt active: recurrent block %d tokens, max_model_len %d, budget %d, method %s, "
        "plan %s (%s), learn=%s, keep_tail=%s, retention_interval=%s",
        block_size, scheduler.max_model_len, policy.config.budget, policy.config.method,
        list(policy.server_plan), policy.plan_source, policy.config.learn,
        policy.config.keep_tail, cache_config.prefix_cache_retention_interval,
    )


def _wrap_scheduler_init(stock: Any) -> Any:
    @functools.wraps(stock)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        stock(self, *args, **kwargs)
        _attach_policy(self)

    return __init__


def _wrap_split(stock: Any) -> Any:
    @functools.wraps(stock)
    def _mamba_block_aligned_split(
        self: Any,
        request: Any,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        n = stock(self, request, num_new_tokens, num_new_local_computed_tokens,
                  num_external_computed_tokens)
        policy = self.__dict__.get(CHECKPOINT_POLICY_ATTR)
        if policy is None:
            return n
        plan = plan_of(policy, request)
        if plan is None:
            return n
        start = (request.num_computed_tokens + num_new_local_computed_tokens
                 + num_external_computed_tokens)
        prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        if start >= prefill_end:
            return n
        end = start + n
        if (
            plan.strict
            and n < num_new_tokens
            and start + num_new_tokens >= prefill_end
            and not self.mamba_has_prefill_checkpoint_blocks
            and not self.mamba_partial_cache_hit
        ):
            # The prompt's final chunk, cut short by stock stops. Without internal checkpoint
            # blocks or sub-block hits the only such stops are the prompt-tail checkpoint
            # (dropped in strict mode) and the next boundary of a mid-block start (kept: the
            # slot invariant needs it). The junction stop is gone: get_computed_blocks zeroed it.
            end = start + num_new_tokens
            block = self.cache_config.block_size
            if start % block:
                end = min(end, (start // block + 1) * block)
        stops = positions_in(plan.positions, start, end)
        if stops:
            end = stops[0]
        return max(end - start, 0)

    return _mamba_block_aligned_split


def _wrap_get_computed_blocks(stock: Any) -> Any:
    @functools.wraps(stock)
    def get_computed_blocks(self: Any, request: Any, *args: Any, **kwargs: Any
                            ) -> tuple[Any, int, int]:
        # *args: vLLM 0.33's max_cache_hit_length, honoured by the stock lookup itself
        blocks, num_hit, junction = stock(self, request, *args, **kwargs)
        policy = self.__dict__.get(CHECKPOINT_POLICY_ATTR)
        if policy is None:
            return blocks, num_hit, junction
        plan = plan_of(policy, request)
        if (not request.__dict__.get(CHECKPOINT_SEEN_ATTR)
                and self.prefix_cache_lookup_enabled(request)):
            request.__dict__[CHECKPOINT_SEEN_ATTR] = True
            # junction = reconciled hit + prefix only the dense attention KV has; 0 if none.
            policy.observe(max(num_hit, junction))
        if plan is not None and plan.strict:
            junction = 0
        return blocks, num_hit, junction

    return get_computed_blocks


def _wrap_mamba_cache_blocks(stock: Any) -> Any:
    @functools.wraps(stock)
    def cache_blocks(
        self: Any,
        request: Any,
        num_tokens: int,
        retention_interval: int | None = None,
        *,
        replay_boundaries: Any,
    ) -> None:
        plan = _attached_plan(request)
        if plan is None or self.mamba_cache_mode != "align":
            return stock(self, request, num_tokens, retention_interval,
                         replay_boundaries=replay_boundaries)
        boundaries = (plan.positions if plan.strict
                      else (*replay_boundaries, *plan.positions))
        return stock(self, request, num_tokens, 0, replay_boundaries=boundaries)

    return cache_blocks


def _wrap_partial_tail(stock: Any) -> Any:
    @functools.wraps(stock)
    def _cache_partial_tail_block(
        self: Any, request: Any, num_tokens: int, retention_interval: int | None
    ) -> Any:
        plan = _attached_plan(request)
        if (
            plan is not None
            and plan.strict
            and request.request_id not in getattr(self, "_checkpoints", {})  # Mamba2 internal
            and num_tokens not in plan.positions
        ):
            return None
        return stock(self, request, num_tokens, retention_interval)

    return _cache_partial_tail_block


def _wrap_validate_params(stock: Any) -> Any:
    """Front-end check of the override, so a bad value is a 400 and not a silent fallback."""

    @functools.wraps(stock)
    def _validate_params(self: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        result = stock(self, params, *args, **kwargs)
        extra = getattr(params, "extra_args", None) or {}
        if OVERRIDE_KEY in extra:
            from vllm.exceptions import VLLMValidationError

            try:
                parse_override(extra[OVERRIDE_KEY])
            except ValueError as exc:
                raise VLLMValidationError(str(exc), parameter="vllm_xargs") from None
        return result

    return _validate_params


# --------------------------------------------------------------------------------------------
# EngineCore utility methods (run in the EngineCore process)


def _state_bytes(spec: Any) -> int:
    """Bytes of recurrent state one block of a Mamba group holds per layer, without padding."""
    import math

    import torch

    return sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size()
               for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True))


def engine_stats(core: Any, token_ids: list[int] | None = None) -> dict[str, Any]:
    """What the prefix cache holds: retained state blocks (and bytes) per recurrent group, cached
    attention blocks, and — for ``token_ids`` — the positions along that sequence whose state
    (resp. KV block) is cached. The sequence is hashed as a plain prompt (no salt, LoRA or
    multimodal keys)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_group_id, hash_block_tokens
    from vllm.v1.kv_cache_interface import MambaSpec

    scheduler = core.scheduler
    pool = scheduler.kv_cache_manager.coordinator.block_pool
    groups = scheduler.kv_cache_config.kv_cache_groups
    per_group = Counter(get_group_id(b.block_hash) for b in pool.blocks
                        if b.block_hash is not None and not b.is_null)
    mamba = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec)]
    other = [i for i in range(len(groups)) if i not in mamba]
    state_bytes = {i: _state_bytes(groups[i].kv_cache_spec) * len(groups[i].layer_names)
                   for i in mamba}
    page_bytes = {i: groups[i].kv_cache_spec.page_size_bytes * len(groups[i].layer_names)
                  for i in range(len(groups))}
    policy = scheduler.__dict__.get(CHECKPOINT_POLICY_ATTR)
    stats: dict[str, Any] = {
        "active": policy is not None,
        "policy": policy.stats() if policy is not None else None,
        "block_size": scheduler.cache_config.block_size,
        # vLLM's CPU platform keeps recurrent state in the model dtype unless the CPU has
        # AVX-512 BF16, where it resets it to float32; the block size follows from this.
        "ssm_state_dtype": str(scheduler.cache_config.mamba_ssm_cache_dtype),
        "hash_block_size": pool.hash_block_size,
        "retention_interval": scheduler.cache_config.prefix_cache_retention_interval,
        "mamba_groups": mamba,
        "attention_groups": other,
        "state_blocks": {str(i): per_group.get(i, 0) for i in mamba},
        "state_blocks_total": sum(per_group.get(i, 0) for i in mamba),
        "state_bytes_per_block": {str(i): state_bytes[i] for i in mamba},
        "page_bytes_per_block": {str(i): page_bytes[i] for i in range(len(groups))},
        "state_bytes_total": sum(per_group.get(i, 0) * state_bytes[i] for i in mamba),
        "state_page_bytes_total": sum(per_group.get(i, 0) * page_bytes[i] for i in mamba),
        "attention_blocks": {str(i): per_group.get(i, 0) for i in other},
    }
    if token_ids is not None:
        hash_fn = get_hash_fn_by_name(core.vllm_config.cache_config.prefix_caching_hash_algo)
        hbs = pool.hash_block_size
        hashes: list[Any] = []
        parent = None
        for start in range(0, len(token_ids) - hbs + 1, hbs):
            parent = hash_block_tokens(hash_fn, parent, token_ids[start:start + hbs], None)
            hashes.append(parent)

        def cached_positions(gid: int) -> list[int]:
            bs = groups[gid].kv_cache_spec.block_size
            return [p for p in range(bs, len(token_ids) + 1, bs)
                    if pool.get_cached_block(hashes[p // hbs - 1], [gid]) is not None]

        by_group = {i: cached_positions(i) for i in range(len(groups))}
        stats["state_positions"] = {str(i): by_group[i] for i in mamba}
        # a resumable position needs the state of every recurrent group
        stats["resumable_positions"] = sorted(set.intersection(
            *(set(by_group[i]) for i in mamba))) if mamba else []
        stats["attention_positions"] = {str(i): by_group[i] for i in other}
    return stats


def _checkpoint_stats(self: Any, token_ids: list[int] | None = None) -> dict[str, Any]:
    return engine_stats(self, list(token_ids) if token_ids is not None else None)


def _configure_checkpoints(self: Any, config_json: str | None = None) -> dict[str, Any]:
    """Replace the policy (fresh learner); ``None`` = back to ``MINIPIC_CKPT_CONFIG``.

    For benchmarks and tests that compare plans on one engine, and for an operator who wants a
    new histogram without a restart. Requests already scheduled keep their plan."""
    scheduler = self.scheduler
    if CHECKPOINT_POLICY_ATTR not in scheduler.__dict__:
        raise RuntimeError("minipic ckpt is not active in this engine")
    config = (CheckpointConfig.model_validate_json(config_json) if config_json
              else CheckpointConfig.from_env())
    old: CheckpointPolicy = scheduler.__dict__[CHECKPOINT_POLICY_ATTR]
    policy = CheckpointPolicy(config, old.block_size, old.max_model_len)
    scheduler.__dict__[CHECKPOINT_POLICY_ATTR] = policy
    scheduler.kv_cache_manager.__dict__[CHECKPOINT_POLICY_ATTR] = policy
    return engine_stats(self)


# --------------------------------------------------------------------------------------------
# install / client helpers


def install() -> None:
    """Patch vLLM's classes (idempotent). Safe in every process: the scheduler hooks only act in
    the EngineCore, the validation hook only in the front-end."""
    from vllm.v1.engine.core import EngineCore

    from minipic.engine_ext.vllm_surface import patches

    sched = "vllm.v1.core.sched.scheduler:Scheduler"
    mamba = "vllm.v1.core.single_type_kv_cache_manager:MambaManager"
    patches.apply("ckpt", {
        f"{sched}.__init__": _wrap_scheduler_init,
        f"{sched}._mamba_block_aligned_split": _wrap_split,
        "vllm.v1.core.kv_cache_manager:KVCacheManager.get_computed_blocks":
            _wrap_get_computed_blocks,
        f"{mamba}.cache_blocks": _wrap_mamba_cache_blocks,
        f"{mamba}._cache_partial_tail_block": _wrap_partial_tail,
        "vllm.v1.engine.input_processor:InputProcessor._validate_params":
            _wrap_validate_params,
    })
    # Utility methods the front-end calls by name (EngineCore utilities: an extension point).
    core = f"{EngineCore.__module__}:EngineCore"
    patches.add("ckpt", {f"{core}.{CHECKPOINT_STATS_UTILITY}": _checkpoint_stats,
                         f"{core}.{CHECKPOINT_CONFIGURE_UTILITY}": _configure_checkpoints})


def _engine_checkpoint_config(scheduler: Any) -> CheckpointConfig:
    """The policy from vLLM's ``additional_config`` (what its config hash covers); the
    environment only for engines started without it (eager engines of other launchers)."""
    minipic = (getattr(scheduler.vllm_config, "additional_config", None) or {}).get("minipic")
    if minipic and minipic.get("ckpt") is not None:
        return CheckpointConfig.model_validate(minipic["ckpt"])
    return CheckpointConfig.from_env()


def call_engine(llm: Any, method: str, *args: Any) -> Any:
    """Call an EngineCore utility method of a ``vllm.LLM``, in-process or across processes."""
    client = llm.llm_engine.engine_core
    if hasattr(client, "call_utility"):
        return client.call_utility(method, *args)
    return getattr(client.engine_core, method)(*args)  # InprocClient


def checkpoint_stats(llm: Any, token_ids: list[int] | None = None) -> dict[str, Any]:
    """``engine_stats`` of the engine behind ``llm`` (see there)."""
    return call_engine(llm, CHECKPOINT_STATS_UTILITY, token_ids)


def configure_checkpoints(llm: Any, config: CheckpointConfig | None) -> dict[str, Any]:
    """Swap the engine's checkpoint policy; None restores the one it was started with."""
    return call_engine(llm, CHECKPOINT_CONFIGURE_UTILITY,
                       config.model_dump_json() if config else None)
