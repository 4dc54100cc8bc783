"""Proof, in the worker, that the hooks an opted-in request's answer depends on actually run.

The patch table (``engine_ext/vllm_surface/patches.py``) proves a wrapper is *installed*; it cannot
prove vLLM *calls* it. vLLM has more than one path through a step: its V2 model runner
(``vllm/v1/worker/gpu/``, the CUDA default in 0.32) has no
``GPUModelRunner._build_attention_metadata``, so span isolation
(``engine_ext/attention/span_isolation.py``) would sit installed and unused while span hashing and
the lookup past misses run in the EngineCore: cold finals computed in context, cached under
span-local hashes, answers that depend on what ran before. A model whose attention layers got
another backend (a loader that bypasses ``initialize_model``, a backend chosen by name) would store
rotated keys and reuse them at new offsets: wrong answers, no error.

So at every step that computes tokens of an opted-in request the worker checks, before the
forward pass, and stops the engine with :class:`EngineIntegrationError` when any fails:

1. **static, once per worker:** the running model runner's class builds attention metadata
   through the wrapped ``GPUModelRunner._build_attention_metadata`` (not an override, not the V2
   runner), and every decoder attention layer of the model has minipic's position-free impl with
   its rotary module attached (``engine_ext/attention/unrotated_keys.py`` converted it);
2. **dynamic, every such step:** the position-free metadata builder asks for span isolation
   inside the isolation hook (``span_isolation.step_span_view`` raises when it is called
   outside the hook while an opted-in step is expected), and at least one such builder ran in
   the step (a builder that never asks is a foreign backend).

Plain requests are never checked: they are stock vLLM whatever the path. The entry is
``Worker.execute_model``, the one call every runner (V1, V2, CPU) goes through with the step's
``SchedulerOutput`` (a row of the patch table).
"""

from __future__ import annotations

import functools
from typing import Any

from minipic.engine_ext.vllm_surface.added_names import GUARD_ATTR, ROPE_ATTR
from minipic.span_contract.errors import EngineIntegrationError
from minipic.span_contract.model_support import ModelSupport
from minipic.span_contract.span_config import spans_opted_in

TARGET = "vllm.v1.worker.gpu_worker:Worker.execute_model"
V1_RUNNER_HINT = ("vLLM's V2 model runner does not call it; minipic's launchers set "
                  "VLLM_USE_V2_MODEL_RUNNER=0, set it yourself when starting vLLM another way")


class StepGuard:
    """Per-worker record of opted-in requests and of whether the static checks passed."""

    def __init__(self) -> None:
        self.opted: set[str] = set()
        self.static_ok = False

    def observe(self, scheduler_output: Any) -> bool:
        """Track opted-in requests; True if this step computes tokens of one of them."""
        for new in getattr(scheduler_output, "scheduled_new_reqs", ()):
            if spans_opted_in(getattr(new, "sampling_params", None)):
                self.opted.add(new.req_id)
        for rid in getattr(scheduler_output, "finished_req_ids", ()):
            self.opted.discard(rid)
        if not self.opted:
            return False
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", {}) or {}
        return any(scheduled.get(rid, 0) > 0 for rid in self.opted)

    def check_static(self, worker: Any) -> None:
        if self.static_ok:
            return
        problems = runner_problems(getattr(worker, "model_runner", None))
        problems += layer_problems(worker.vllm_config)
        if problems:
            raise EngineIntegrationError(
                "minipic cannot serve a span-opted-in request on this worker: the hooks its "
                "answer depends on would not run (no silent stock fallback):\n  - "
                + "\n  - ".join(problems))
        self.static_ok = True


def runner_problems(runner: Any) -> list[str]:
    """Why this model runner would skip span isolation (empty: it goes through the hook)."""
    from minipic.engine_ext.attention import span_isolation
    from minipic.engine_ext.vllm_surface import patches

    if runner is None:
        return ["the worker has no model runner"]
    method = getattr(type(runner), "_build_attention_metadata", None)
    mark = f"rope:{span_isolation.TARGET}"
    if method is None:
        return [f"model runner {type(runner).__module__}.{type(runner).__name__} has no "
                f"_build_attention_metadata, where span isolation learns each step's block "
                f"starts ({V1_RUNNER_HINT})"]
    if mark not in getattr(method, patches.PATCH_MARK_ATTR, ()):
        return [f"model runner {type(runner).__name__} overrides _build_attention_metadata, "
                f"so the span-isolation wrapper on GPUModelRunner never runs"]
    return []


def _kv_attention_layers(vllm_config: Any) -> dict[str, Any]:
    """The model's decoder attention layers that cache keys (every kind: MLA too; recurrent
    layers hold state, not keys)."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.v1.attention.backend import AttentionType

    layers = vllm_config.compilation_config.static_forward_context
    return {name: layer for name, layer in layers.items()
            if isinstance(layer, AttentionLayerBase) and not isinstance(layer, MambaBase)
            and getattr(layer, "attn_type", AttentionType.DECODER) == AttentionType.DECODER}


def _layer_reasons(vllm_config: Any) -> tuple[int, dict[str, str]]:
    """``(attention layers, {layer: why it is not position-free})``."""
    from minipic.engine_ext.attention import unrotated_keys

    layers = _kv_attention_layers(vllm_config)
    bad = {}
    for name, layer in layers.items():
        impl = getattr(layer, "impl", None)
        why = unrotated_keys.refusal(layer)
        if not getattr(impl, "position_free_capable", False):
            bad[name] = (f"{type(layer).__name__} with attention impl {type(impl).__name__}, "
                         f"not minipic's position-free backend" + (f" ({why})" if why else ""))
        elif getattr(impl, ROPE_ATTR, None) is None:
            bad[name] = why or ("keys are stored rotated (the module owning this layer was not "
                                "converted to unrotated keys)")
    return len(layers), bad


def layer_problems(vllm_config: Any) -> list[str]:
    """Decoder attention layers that would not read keys position-free (empty: all do)."""
    _, bad = _layer_reasons(vllm_config)
    if bad:
        first = next(iter(bad.items()))
        return [f"{len(bad)} attention layer(s) not position-free, first: {first[0]}: {first[1]}"]
    return []


def worker_model_support(worker: Any, sink_gap: int | None = None) -> ModelSupport:
    """This worker's verdict: position-free iff its runner goes through the isolation hook and
    every attention layer stores unrotated keys (what :meth:`StepGuard.check_static` demands of
    an opted-in step, asked before any request instead of at one), and the rotary table holds
    every position a span request can reach (:func:`position_room`; ``sink_gap``: the gap to
    ask about, None: the engine's own)."""
    worker = getattr(worker, "worker", worker)  # collective_rpc hands callables the wrapper
    count, bad = _layer_reasons(worker.vllm_config)
    problems = runner_problems(getattr(worker, "model_runner", None))
    if problems:
        return ModelSupport(False, problems[0], count, count - len(bad))
    if not count:
        return ModelSupport(False, "the model has no attention layer that caches keys")
    if bad:
        name, why = next(iter(bad.items()))
        return ModelSupport(False, f"{len(bad)} of {count} attention layers keep rotated keys; "
                                   f"first {name}: {why}", count, count - len(bad))
    short = position_room(worker.vllm_config, sink_gap)
    if short:
        return ModelSupport(False, short, count, count)
    return ModelSupport(True, None, count, count)


def position_room(vllm_config: Any, sink_gap: int | None = None) -> str | None:
    """Why a span request could reach a position past the model's rotary table (None: it
    cannot).

    A span request's positions are its real tokens' count plus the sink's length and
    ``SpanConfig.sink_gap``; the sink's tokens and the layout take none, so the last position
    stays below ``max_model_len + sink_gap``. A table shorter than that would make the rotary
    op index past its end inside a step, which stops the engine for every user: refused here,
    where span requests get the reason and plain ones run on.
    """
    from minipic.span_contract.span_config import SpanConfig

    gap = sink_gap
    if gap is None:
        config = SpanConfig.from_env()
        gap = config.sink_gap if config is not None else 0
    if not gap:
        return None
    limit = vllm_config.model_config.max_model_len + gap
    for name, layer in _kv_attention_layers(vllm_config).items():
        rope = getattr(getattr(layer, "impl", None), ROPE_ATTR, None)
        rows = getattr(rope, "cos_sin_cache", None)
        if rows is not None and rows.shape[0] < limit:
            return (f"sink_gap={gap} moves span positions up to {limit - 1}, past the rotary "
                    f"table of {rows.shape[0]} positions ({name}); lower --max-model-len to "
                    f"{rows.shape[0] - gap} or the sink gap")
    return None


def install() -> None:
    """Wrap ``Worker.execute_model`` (worker processes; idempotent; in the patch table)."""
    from minipic.engine_ext.attention import span_isolation
    from minipic.engine_ext.vllm_surface import patches

    def factory(stock: Any) -> Any:
        @functools.wraps(stock)
        def execute_model(self: Any, scheduler_output: Any) -> Any:
            guard: StepGuard | None = self.__dict__.get(GUARD_ATTR)
            if guard is None:
                guard = self.__dict__[GUARD_ATTR] = StepGuard()
            if not guard.observe(scheduler_output):
                return stock(self, scheduler_output)
            guard.check_static(self)
            with span_isolation.expect_isolated_step() as seen:
                output = stock(self, scheduler_output)
            if not seen.builds:
                raise EngineIntegrationError(
                    "minipic: a step computed span-opted-in tokens but no position-free "
                    "attention metadata builder ran in it (a foreign attention backend); the "
                    "engine stops before answering")
            return output

        return execute_model

    patches.apply("rope", {TARGET: factory})
