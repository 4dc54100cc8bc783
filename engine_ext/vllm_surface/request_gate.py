"""A span request on a model that is not position-free is refused in the front-end, never run.

Why here: the worker is where it is known that a layer keeps rotated keys, and it can only stop
the engine when such a request arrives (``integration_guard``: a wrong answer is worse), which
vLLM turns into ``EngineDeadError`` for every user of the server. So the worker's verdict
(``integration_guard.worker_model_support``) is asked of the engine once, by name
(:data:`~minipic.span_contract.model_support.MODEL_SUPPORT_UTILITY`, an EngineCore utility that
asks every worker with ``collective_rpc``), and the front-end's ``add_request`` (``AsyncLLM`` for
servers and the embedded orchestrator, ``LLMEngine`` for ``LLM``: every vLLM front-end goes through
one of them) refuses an opted-in request with :class:`vllm.exceptions.VLLMValidationError`, which
vLLM's server answers with HTTP 400 and ``LLM`` raises to its caller. Plain requests are never
asked about: they are stock vLLM on any model.

The verdict is asked at the first opted-in request and kept on the engine object (the model does
not change under a running engine); minipic's launchers ask it at start too (:func:`fetch`), so
they can say it in their start-up line.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from minipic.engine_ext.vllm_surface.added_names import MODEL_SUPPORT_ATTR
from minipic.span_contract.model_support import MODEL_SUPPORT_UTILITY, ModelSupport
from minipic.span_contract.span_config import spans_opted_in

logger = logging.getLogger("minipic.request_gate")

ASYNC_TARGET = "vllm.v1.engine.async_llm:AsyncLLM.add_request"
SYNC_TARGET = "vllm.v1.engine.llm_engine:LLMEngine.add_request"
UTILITY_TARGET = f"vllm.v1.engine.core:EngineCore.{MODEL_SUPPORT_UTILITY}"


def _engine_model_support(engine_core: Any, sink_gap: int | None = None) -> dict[str, Any]:
    """EngineCore utility: the verdict of every worker, combined (the first refusal wins).
    ``sink_gap``: ask about another sink gap than the engine's (what an operator would get
    with it; not kept)."""
    from minipic.engine_ext.vllm_surface import integration_guard

    if sink_gap is not None:
        ranks = engine_core.model_executor.collective_rpc(
            integration_guard.worker_model_support, kwargs={"sink_gap": sink_gap})
        return ModelSupport.combine(list(ranks)).to_dict()
    cached = engine_core.__dict__.get(MODEL_SUPPORT_ATTR)
    if cached is None:
        ranks = engine_core.model_executor.collective_rpc(integration_guard.worker_model_support)
        cached = ModelSupport.combine(list(ranks)).to_dict()
        engine_core.__dict__[MODEL_SUPPORT_ATTR] = cached
    return cached


def _remember(engine: Any, raw: Any) -> ModelSupport:
    support = ModelSupport.from_dict(raw) or ModelSupport(
        False, f"the engine answered {MODEL_SUPPORT_UTILITY} with {raw!r}")
    engine.__dict__[MODEL_SUPPORT_ATTR] = support
    if not support.position_free:
        logger.warning("minipic: %s", support.summary())
    return support


def fetch_sync(engine: Any) -> ModelSupport:
    """The verdict of an ``LLMEngine`` (asked once; cached on it)."""
    known = engine.__dict__.get(MODEL_SUPPORT_ATTR)
    if known is not None:
        return known
    client = engine.engine_core
    if hasattr(client, "call_utility"):
        raw = client.call_utility(MODEL_SUPPORT_UTILITY)
    else:  # in-process client: the EngineCore itself
        raw = getattr(client.engine_core, MODEL_SUPPORT_UTILITY)()
    return _remember(engine, raw)


async def fetch(engine: Any) -> ModelSupport:
    """The verdict of an ``AsyncLLM`` (asked once; cached on it)."""
    known = engine.__dict__.get(MODEL_SUPPORT_ATTR)
    if known is not None:
        return known
    raw = await engine.engine_core.call_utility_async(MODEL_SUPPORT_UTILITY)
    return _remember(engine, raw)


def _gated(engine: Any) -> bool:
    """Whether this engine runs position-free attention, so has a verdict to ask: the features
    it was started with (minipic's launchers put them in vLLM's ``additional_config``), else this
    process's plugin features. An engine without them (stock, or span hashing alone) is left as
    its configuration makes it: a process may hold several engines, and the wrapper is
    process-wide."""
    from minipic.span_contract.engine_config import ADDITIONAL_CONFIG_KEY
    from minipic.span_contract.span_config import enabled_features

    extra = getattr(getattr(engine, "vllm_config", None), "additional_config", None) or {}
    features = (extra.get(ADDITIONAL_CONFIG_KEY) or {}).get("features") if isinstance(
        extra, dict) else None
    return "rope" in (features if features is not None else enabled_features())


def _refuse(support: ModelSupport) -> None:
    from vllm.exceptions import VLLMValidationError

    raise VLLMValidationError(support.refusal(), parameter="vllm_xargs")


def install() -> None:
    """Add the utility (EngineCore) and wrap both front-ends' ``add_request`` (idempotent; rows
    of the patch table)."""
    from minipic.engine_ext.vllm_surface import patches

    patches.add("rope", {UTILITY_TARGET: _engine_model_support})

    def async_factory(stock: Any) -> Any:
        @functools.wraps(stock)
        async def add_request(self: Any, request_id: str, prompt: Any, params: Any,
                              *args: Any, **kwargs: Any) -> Any:
            if spans_opted_in(params) and _gated(self):
                support = await fetch(self)
                if not support.position_free:
                    _refuse(support)
            return await stock(self, request_id, prompt, params, *args, **kwargs)

        return add_request

    def sync_factory(stock: Any) -> Any:
        @functools.wraps(stock)
        def add_request(self: Any, request_id: str, prompt: Any, params: Any,
                        *args: Any, **kwargs: Any) -> Any:
            if spans_opted_in(params) and _gated(self):
                support = fetch_sync(self)
                if not support.position_free:
                    _refuse(support)
            return stock(self, request_id, prompt, params, *args, **kwargs)

        return add_request

    patches.apply("rope", {ASYNC_TARGET: async_factory, SYNC_TARGET: sync_factory})
