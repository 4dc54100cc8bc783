"""HTTP routes minipic adds to vLLM's OpenAI server (``vllm.endpoint_plugins`` entry point).

``GET /minipic/config`` states the span configuration and plugin features the server runs with,
so a client can refuse to talk to a server whose SSEP/PDEP ids or block size differ from its own
(a mismatch would not fail loudly: spans would just never hit, or hit wrongly).
"""

from __future__ import annotations

from argparse import Namespace
from typing import Any

from minipic.span_config import SpanConfig, enabled_features

CONFIG_PATH = "/minipic/config"


def current_config() -> dict[str, Any]:
    span = SpanConfig.from_env()
    return {
        "enabled": span is not None,
        "features": sorted(enabled_features()),
        "span_config": span.model_dump() if span else None,
    }


class MinipicEndpoints:
    name = "minipic"
    required_tasks = None

    def attach_router(self, app: Any) -> None:
        from fastapi.responses import JSONResponse

        async def minipic_config() -> JSONResponse:
            return JSONResponse(current_config())

        app.add_api_route(CONFIG_PATH, minipic_config, methods=["GET"])

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        return None
