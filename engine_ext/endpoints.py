"""HTTP routes minipic adds to vLLM's OpenAI server (``vllm.endpoint_plugins`` entry point).

``GET /minipic/config`` states the span configuration and plugin features the server runs with
(and, when configured, the span store's counters: tokens loaded per tier, blocks saved),
so a client can refuse to talk to a server whose SSEP/PDEP ids or block size differ from its own
(a mismatch would not fail loudly: spans would just never hit, or hit wrongly).

``POST /minipic/reset_prefix_cache`` empties the engine's prefix cache, for tests, benchmarks and
an operator who needs a cold start without a restart. vLLM's own ``/reset_prefix_cache`` comes
only with its development mode (``VLLM_SERVER_DEV_MODE=1``, which opens other routes too); this
one is off unless the operator starts ``minipic serve --enable-cache-reset``, answers 403 with
that hint otherwise, and asks for the server's API key when one is set (vLLM guards only
``/v1``-style paths with it).
"""

from __future__ import annotations

import logging
import os
import uuid
from argparse import Namespace
from typing import Any

from minipic.engine_ext.vllm_surface.added_names import MODEL_SUPPORT_ATTR
from minipic.span_contract.engine_utilities import (
    CHECKPOINT_STATS_UTILITY,
    HOLE_STATS_UTILITY,
    SPAN_STORE_STATS_UTILITY,
)
from minipic.span_contract.env import CACHE_RESET_ENV
from minipic.span_contract.model_support import ModelSupport
from minipic.span_contract.span_config import SpanConfig, enabled_features

logger = logging.getLogger("vllm.minipic.serve")  # vLLM's log configuration applies

CONFIG_PATH = "/minipic/config"
RESET_PATH = "/minipic/reset_prefix_cache"
# set to 1 by `minipic serve --enable-cache-reset` in the API server's environment
CACHE_RESET_ENV = CACHE_RESET_ENV


def cache_reset_enabled(environ: dict[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get(CACHE_RESET_ENV, "0").lower() in ("1", "true", "yes")


# One id per API-server process: a client that sees it change knows the server restarted (and
# its prefix cache is empty), however the connection loss looked from its side.
INSTANCE_ID = uuid.uuid4().hex


def current_config() -> dict[str, Any]:
    span = SpanConfig.from_env()
    return {
        "instance": INSTANCE_ID,
        "enabled": span is not None,
        "features": sorted(enabled_features()),
        "span_config": span.model_dump() if span else None,
        "cache_reset": cache_reset_enabled(),
    }


def _error(status: int, message: str, kind: str) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                        status_code=status)


async def _ckpt_summary(request: Any) -> dict[str, Any] | None:
    """The engine's recurrent block and plan, asked of the EngineCore (only the engine knows
    them: vLLM sizes a hybrid model's block from its recurrent state, whose dtype depends on the
    CPU, e.g. 288 tokens for the tiny test model without AVX-512 BF16 and 544 with it)."""
    engine = getattr(request.app.state, "engine_client", None)
    core = getattr(engine, "engine_core", None)
    if core is None or not hasattr(core, "call_utility_async"):
        return None

    stats = await core.call_utility_async(CHECKPOINT_STATS_UTILITY, None)
    policy = stats.get("policy") or {}
    return {"active": stats["active"], "block_size": stats["block_size"],
            "ssm_state_dtype": stats["ssm_state_dtype"],
            "server_plan": policy.get("server_plan"), "plan_source": policy.get("plan_source")}


async def _span_store_summary(request: Any) -> dict[str, Any] | None:
    """The span store's counters (tokens loaded per tier, blocks saved, failed fills), asked
    of the EngineCore; None when the server runs no store."""
    engine = getattr(request.app.state, "engine_client", None)
    core = getattr(engine, "engine_core", None)
    if core is None or not hasattr(core, "call_utility_async"):
        return None

    return await core.call_utility_async(SPAN_STORE_STATS_UTILITY)


async def _prefill_steps_summary(request: Any) -> dict[str, Any] | None:
    """Engine steps per opted-in prompt (histogram), asked of the EngineCore."""
    engine = getattr(request.app.state, "engine_client", None)
    core = getattr(engine, "engine_core", None)
    if core is None or not hasattr(core, "call_utility_async"):
        return None

    stats = await core.call_utility_async(HOLE_STATS_UTILITY)
    return {"histogram": stats["histogram"], "multi_hole_steps": stats["multi_hole_steps"]}


async def served_model_support(engine_client: Any) -> ModelSupport | None:
    """The engine's position-free verdict (None: the plugin runs without position-free
    attention, so there is nothing to ask), logged once at start as the server's line about its
    model (``engine_ext/vllm_surface/request_gate.py``)."""
    if engine_client is None or "rope" not in enabled_features():
        return None
    from minipic.engine_ext.vllm_surface import request_gate

    known = engine_client.__dict__.get(MODEL_SUPPORT_ATTR)
    support = await request_gate.fetch(engine_client)
    if known is None:
        model = getattr(getattr(engine_client, "model_config", None), "model", "?")
        logger.warning("minipic serve: model %s is %s", model, support.summary())
    return support


class MinipicEndpoints:
    name = "minipic"
    required_tasks = None

    def __init__(self) -> None:
        self._api_tokens: list[str] = []

    def attach_router(self, app: Any) -> None:
        from fastapi import Request
        from fastapi.responses import JSONResponse

        async def minipic_config(request: Request) -> JSONResponse:
            denied = self.unauthorized(request)
            if denied is not None:
                return denied
            config = current_config()
            support = await served_model_support(getattr(request.app.state, "engine_client", None))
            if support is not None:
                config["model_support"] = support.to_dict()
            if "ckpt" in config["features"]:
                config["ckpt"] = await _ckpt_summary(request)
            if "holes" in config["features"]:
                config["span_store"] = await _span_store_summary(request)
                config["prefill_steps"] = await _prefill_steps_summary(request)
            return JSONResponse(config)

        async def reset_prefix_cache(request: Request) -> JSONResponse:
            return await self._reset(request)

        # FastAPI reads these to inject the request; as strings (future annotations) they
        # would be looked up in this module's globals, where the lazily imported names are not
        reset_prefix_cache.__annotations__ = {"request": Request, "return": JSONResponse}
        minipic_config.__annotations__ = {"request": Request, "return": JSONResponse}

        app.add_api_route(CONFIG_PATH, minipic_config, methods=["GET"])
        app.add_api_route(RESET_PATH, reset_prefix_cache, methods=["POST"])

    async def _reset(self, request: Any) -> Any:
        from fastapi.responses import JSONResponse

        if not cache_reset_enabled():
            return _error(403, "prefix-cache reset is disabled on this server; start it with "
                               "`minipic serve --enable-cache-reset` to allow it",
                          "ForbiddenError")
        denied = self.unauthorized(request)
        if denied is not None:
            return denied
        engine = getattr(request.app.state, "engine_client", None)
        if engine is None:
            return _error(503, "no engine behind this server", "ServiceUnavailableError")
        if not await engine.reset_prefix_cache():
            return _error(409, "the engine refused to reset its prefix cache: blocks are held "
                               "by running requests; retry when they are done", "ConflictError")
        return JSONResponse({"success": True})

    def unauthorized(self, request: Any) -> Any:
        """A 401 unless the request carries the server's API key (when one is set). vLLM
        guards only ``/v1``-style paths; minipic's routes tell the store's fingerprint, paths,
        weights digest and counters, which are the operator's, not every caller's."""
        if not self._api_tokens:
            return None
        from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

        if AuthenticationMiddleware(None, self._api_tokens).verify_token(request.headers):
            return None
        return _error(401, "Unauthorized: send the server's API key as a Bearer token",
                      "AuthenticationError")

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        from vllm import envs

        keys = getattr(args, "api_key", None) or [envs.VLLM_API_KEY]
        self._api_tokens = [key for key in keys if key]
