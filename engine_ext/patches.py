"""Every place minipic changes vLLM, in one table, checked against the vLLM it runs on.

minipic prefers vLLM's extension points and uses them where they exist: ``register_backend``
(the position-free attention backends, ``engine_ext/rope_attention_backend.py``,
``engine_ext/cuda_backend.py``), the ``vllm.general_plugins`` entry point (``engine_ext.plugin``),
``SamplingParams.extra_args`` / ``vllm_xargs`` (per-request opt-in and checkpoint plans), stat
loggers and ``collective_rpc`` (reporting). What no extension point covers is wrapped here —
:data:`PATCH_POINTS` says what, for which feature, with the stock signature it was written
against and why there is no extension point for it.

At load (``engine_ext.plugin.register``, every vLLM process) :func:`apply` refuses to patch
anything unless the installed vLLM is the version the table was checked against
(:data:`VLLM_CHECKED`) and every target of the feature exists with the recorded parameters. A
mismatch raises :class:`EngineIntegrationError` naming the feature, the targets and both
versions, and vLLM's start-up stops with it: the plugin never falls back to stock behaviour
silently (span hashing without position-free attention gives wrong answers).
``MINIPIC_ALLOW_VLLM_VERSION=<version>`` accepts one other version after you have checked it;
signatures are checked whatever the version.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

VLLM_CHECKED = "0.32.0"
ALLOW_VERSION_ENV = "MINIPIC_ALLOW_VLLM_VERSION"
MARK = "_minipic_patches"  # frozenset of "feature:target" on each wrapper


from span_contract.errors import EngineIntegrationError  # noqa: E402  (re-exported)


@dataclass(frozen=True)
class PatchPoint:
    feature: str  # plugin feature that installs it (hash, rope, holes, ckpt)
    target: str  # "module:attribute" or "module:Class.method"
    params: tuple[str, ...]  # parameter names of the stock callable, in order
    why: str  # why no vLLM extension point covers it
    platform: str | None = None  # only on this vLLM platform ("cpu"); None: everywhere

    def applies_here(self) -> bool:
        if self.platform is None:
            return True
        from vllm.platforms import current_platform

        return self.platform == "cpu" and current_platform.is_cpu()


_SCHED = "vllm.v1.core.sched.scheduler:Scheduler"
_KVM = "vllm.v1.core.kv_cache_manager:KVCacheManager"
_MAMBA = "vllm.v1.core.single_type_kv_cache_manager:MambaManager"

PATCH_POINTS: tuple[PatchPoint, ...] = (
    # -- hash: SSEP/PDEP block hashing (engine_ext/span_hashing.py), EngineCore
    PatchPoint("hash", "vllm.v1.core.kv_cache_utils:get_request_block_hasher",
               ("hash_block_size", "caching_hash_fn"),
               "the request block hasher is a module function, not configurable"),
    PatchPoint("hash", "vllm.v1.engine.core:get_request_block_hasher",
               ("hash_block_size", "caching_hash_fn"),
               "EngineCore imported the hasher factory by name"),
    PatchPoint("hash", f"{_SCHED}.__init__",
               ("self", "vllm_config", "kv_cache_config", "structured_output_manager",
                "block_size", "hash_block_size", "mm_registry", "include_finished_set",
                "log_stats"),
               "records the engine's config for the hasher factory, which vLLM calls with a "
               "block size and a hash function only (EngineCore builds the scheduler first)"),
    # -- holes: lookup past misses, compute only the holes (engine_ext/hole_lookup.py)
    PatchPoint("holes", f"{_KVM}.get_computed_blocks", ("self", "request"),
               "the prefix lookup stops at the first miss; no lookup hook"),
    PatchPoint("holes", f"{_KVM}.allocate_slots",
               ("self", "request", "num_new_tokens", "num_new_computed_tokens",
                "new_computed_blocks", "num_lookahead_tokens", "num_external_computed_tokens",
                "delay_cache_blocks", "num_encoder_tokens", "full_sequence_must_fit",
                "reserved_blocks", "has_scheduled_reqs", "skip_zeroing_group_ids"),
               "attached cached blocks must reach the worker as the request's new blocks"),
    PatchPoint("holes", f"{_KVM}.free", ("self", "request"),
               "pinned cached runs must be released with the request"),
    PatchPoint("holes", f"{_SCHED}.schedule", ("self", "throttle_prefills"),
               "jumping a running request over a cached run; a scheduler_cls subclass would "
               "have to be named in every launcher's engine args and would exclude other "
               "scheduler plugins, for a two-line hook"),
    PatchPoint("holes", f"{_SCHED}._reserve_prefill_lookahead",
               ("self", "request", "num_computed_tokens", "num_new_tokens"),
               "the last chunk clip before allocation on both scheduling paths"),
    # -- rope: position-free attention + span isolation + the rotated pool, worker
    PatchPoint("rope", "vllm.model_executor.model_loader.base_loader:initialize_model",
               ("vllm_config", "prefix", "model_class", "model_config"),
               "keys must reach the cache unrotated in every supported model class; a model "
               "class override per architecture would copy vLLM's forwards"),
    PatchPoint("rope", "vllm.v1.worker.gpu_model_runner:GPUModelRunner._build_attention_metadata",
               ("self", "num_tokens", "num_reqs", "max_query_len", "num_tokens_padded",
                "num_reqs_padded", "ubatch_slices", "logits_indices", "max_num_sampled_tokens",
                "use_spec_decode", "for_cudagraph_capture", "num_scheduled_tokens",
                "slot_mappings"),
               "attention metadata carries no token ids; span isolation needs the block-start "
               "tokens the runner holds"),
    PatchPoint("rope", "vllm.v1.worker.cpu_worker:CPUWorker.determine_available_memory",
               ("self",),
               "the rotated-block pool's share must come out of the configured KV space",
               platform="cpu"),
    # -- ckpt: sparse recurrent checkpoints for hybrids (engine_ext/recurrent_checkpoints.py)
    PatchPoint("ckpt", f"{_SCHED}.__init__",
               ("self", "vllm_config", "kv_cache_config", "structured_output_manager",
                "block_size", "hash_block_size", "mm_registry", "include_finished_set",
                "log_stats"),
               "the checkpoint policy is built from the engine's config"),
    PatchPoint("ckpt", f"{_SCHED}._mamba_block_aligned_split",
               ("self", "request", "num_new_tokens", "num_new_local_computed_tokens",
                "num_external_computed_tokens"),
               "recurrent state exists only at chunk ends: chunks must stop at planned points"),
    PatchPoint("ckpt", f"{_KVM}.get_computed_blocks", ("self", "request"),
               "overlap depths are observed at lookup"),
    PatchPoint("ckpt", f"{_MAMBA}.cache_blocks",
               ("self", "request", "num_tokens", "retention_interval", "replay_boundaries"),
               "which recurrent states are kept is decided inside the Mamba manager"),
    PatchPoint("ckpt", f"{_MAMBA}._cache_partial_tail_block",
               ("self", "request", "num_tokens", "retention_interval"),
               "the prompt-tail checkpoint is re-keyed inside the Mamba manager"),
    PatchPoint("ckpt", "vllm.v1.engine.input_processor:InputProcessor._validate_params",
               ("self", "params", "supported_tasks"),
               "a bad per-request plan must be a 400 in the front-end, not an engine error"),
    # -- route: not patched, but called outside the engine by the cluster router, which must
    # hash requests exactly as the EngineCore does (serving/request_blocks.py)
    PatchPoint("route", "vllm.v1.request:Request.__init__",
               ("self", "request_id", "prompt_token_ids", "sampling_params", "pooling_params",
                "client_index", "arrival_time", "prompt_embeds", "prompt_is_token_ids",
                "mm_features", "lora_request", "cache_salt", "priority", "trace_headers",
                "block_hasher", "resumable", "session_id", "reasoning_ended",
                "reasoning_parser_kwargs", "abort_immediately", "kv_hints"),
               "a request's block hashes are computed by building the engine's Request"),
    PatchPoint("route", "vllm.v1.core.kv_cache_utils:init_none_hash", ("hash_fn",),
               "the root of every hash chain, derived from the replicas' seed"),
    PatchPoint("route", "vllm.v1.core.kv_cache_utils:maybe_convert_block_hash", ("hash_bytes",),
               "KV events carry hashes converted by this function"),
)


def points(feature: str) -> tuple[PatchPoint, ...]:
    """The feature's patch points that apply on this platform."""
    return tuple(p for p in PATCH_POINTS if p.feature == feature and p.applies_here())


def _resolve(target: str) -> tuple[Any, str, Any]:
    """``(owner, attribute, current value)`` of a target; raises LookupError when missing."""
    module_name, _, path = target.partition(":")
    try:
        owner: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise LookupError(f"module {module_name} cannot be imported ({exc})") from None
    *parents, attr = path.split(".")
    for name in parents:
        if not hasattr(owner, name):
            raise LookupError(f"{module_name} has no {name}")
        owner = getattr(owner, name)
    if not hasattr(owner, attr):
        raise LookupError(f"{path} does not exist")
    return owner, attr, getattr(owner, attr)


def _params(fn: Any) -> tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


def problems(feature: str, vllm_version: str | None = None) -> list[str]:
    """What does not match for ``feature`` (empty: safe to patch)."""
    found: list[str] = []
    if vllm_version is None:
        import vllm

        vllm_version = vllm.__version__
    allowed = {VLLM_CHECKED, os.environ.get(ALLOW_VERSION_ENV, "").strip()} - {""}
    if vllm_version.split("+")[0] not in allowed:
        found.append(f"vLLM {vllm_version} is installed; minipic's patches were checked "
                     f"against vLLM {VLLM_CHECKED} (set {ALLOW_VERSION_ENV}={vllm_version} "
                     f"after checking them)")
    for point in points(feature):
        try:
            _, _, current = _resolve(point.target)
        except LookupError as exc:
            found.append(f"{point.target}: {exc}")
            continue
        got = _params(current)
        if got != point.params:
            found.append(f"{point.target}: parameters {got}, written against {point.params}")
    return found


def apply(feature: str, factories: dict[str, Callable[[Any], Any]]) -> None:
    """Check ``feature`` against this vLLM, then wrap each given target with
    ``factories[target](stock)``.

    Every target of the feature is checked (not only the given ones), so a feature whose
    modules install their parts separately fails on its first part. Idempotent per feature and
    target (vLLM may load the plugin more than once per process). Raises
    :class:`EngineIntegrationError` before changing anything if something does not match.
    """
    expected = {p.target for p in points(feature)}
    unknown = set(factories) - expected
    if unknown or not factories:
        raise EngineIntegrationError(
            f"minipic feature {feature!r}: wrappers for {sorted(unknown) or 'nothing'} are not "
            f"in the patch table ({sorted(expected)})")
    issues = problems(feature)
    if issues:
        raise EngineIntegrationError(
            f"minipic feature {feature!r} cannot be installed on this vLLM; the engine will not "
            f"start with it (no silent stock fallback):\n  - " + "\n  - ".join(issues))
    for target, factory in factories.items():
        owner, attr, stock = _resolve(target)
        mark = f"{feature}:{target}"
        marks = frozenset(getattr(stock, MARK, ()))
        if mark in marks:
            continue
        patched = factory(stock)
        setattr(patched, MARK, marks | {mark})
        setattr(owner, attr, patched)


def verify_installed(feature: str) -> None:
    """Every target of ``feature`` carries its wrapper (called by the plugin after installing)."""
    missing = []
    for point in points(feature):
        _, _, current = _resolve(point.target)
        if f"{feature}:{point.target}" not in getattr(current, MARK, ()):
            missing.append(point.target)
    if missing:
        raise EngineIntegrationError(
            f"minipic feature {feature!r} left {missing} unpatched; refusing a partial install")


def table() -> list[dict[str, str]]:
    """The table as rows (README, ``minipic serve`` start-up log, tests)."""
    return [{"feature": p.feature, "target": p.target, "checked_against": VLLM_CHECKED,
             "why": p.why} for p in PATCH_POINTS]
