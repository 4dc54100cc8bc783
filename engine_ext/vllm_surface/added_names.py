"""Every attribute minipic sets on vLLM's objects, in one place, with the object it sits on.

Why one module: these names are how minipic's features keep per-request and per-step state on
vLLM's own objects (a ``Request``, the ``SchedulerOutput`` of a step, the model runner) where no
extension point carries it. A name spelled in two modules could drift apart silently, and a
vLLM release that adds an attribute of the same name would be overwritten unnoticed; listed
here, each is spelled once, ``tests/engine/test_vllm_surface.py`` checks that no other module
spells a ``_minipic_`` name of its own, and the methods minipic adds to vLLM *classes* are rows
of kind "adds" in the patch table (``engine_ext/vllm_surface/patches.py``), checked against
vLLM like the wrapped methods.

Each name is set on instances (``obj.__dict__`` or ``setattr`` on one object), never on a vLLM
class, so stock objects of the same class are untouched.
"""

from __future__ import annotations

# -- hashing (engine_ext/hashing) ----------------------------------------------------------------
FULL_CHAIN_ATTR = "_minipic_full_chain"  # Request: the stock full-prefix hash of each block

# -- holes, scheduler side (engine_ext/holes) -----------------------------------------------------
CACHED_RUNS_ATTR = "_minipic_cached_runs"  # Request: cached runs pinned past its prefix
PREFILL_STEPS_ATTR = "_minipic_prefill_steps"  # Request: engine steps that computed its prompt
HOLES_ATTR = "minipic_holes"  # SchedulerOutput: {req_id: ((start, length), ...)} of this step
SPAN_STORE_ATTR = "_minipic_span_store"  # KVCacheManager: the span store's scheduler half

# -- holes, worker side --------------------------------------------------------------------------
STEP_HOLES_ATTR = "_minipic_step_holes"  # GPUModelRunner: (total tokens, {row: holes}) now
PENDING_HOLES_ATTR = "_minipic_pending_holes"  # GPUModelRunner: holes for the next arange

# -- attention (engine_ext/attention) -------------------------------------------------------------
# attention layer: why its module keeps stock rotated keys (unrotated_keys.convert_model)
ROTATED_KEYS_REASON_ATTR = "_minipic_rotated_keys_reason"
ROPE_ATTR = "minipic_rope"  # attention impl: the model's rotary module, keys rotated inside
OFFSET_TABLES_ATTR = "_minipic_offset_tables"  # rotary module: cos/sin per slot offset
KEPT_BLOCKS_ATTR = "_minipic_kept_blocks"  # Request: {group: [KVCacheBlock]} of its kept copy
KEPT_GROUPS_ATTR = "_minipic_kept_groups"  # KVCacheManager: [(group, block size)] with copies
KEPT_PAGES_ATTR = "minipic_kept_pages"  # SchedulerOutput: {req_id: (block ids per group)}

# -- recurrent checkpoints (engine_ext/recurrent) -------------------------------------------------
CHECKPOINT_PLAN_ATTR = "_minipic_ckpt_plan"  # Request: its checkpoint plan (None: stock)
CHECKPOINT_SEEN_ATTR = "_minipic_ckpt_seen"  # Request: overlap depth already recorded
CHECKPOINT_POLICY_ATTR = "_minipic_ckpt"  # Scheduler and its KVCacheManager: the policy

# -- the vLLM surface itself ----------------------------------------------------------------------
PATCH_MARK_ATTR = "_minipic_patches"  # a wrapper or added method: frozenset "feature:target"
PATCH_STOCK_ATTR = "_minipic_stock"  # a wrapper: vLLM's own value it wraps
# EngineCore, AsyncLLM and LLMEngine: the model's position-free verdict (request_gate)
MODEL_SUPPORT_ATTR = "_minipic_model_support"
GUARD_ATTR = "_minipic_guard"  # GPUModelRunner/Worker: the integration guard of this worker
PROFILE_MARK_ATTR = "_minipic_step_profile"  # a profiled function: its timer is installed

ALL = {name: value for name, value in dict(globals()).items() if name.endswith("_ATTR")}
