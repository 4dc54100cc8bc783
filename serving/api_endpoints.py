"""The endpoint plugin of ``minipic serve`` (``vllm.endpoint_plugins`` entry point ``minipic``).

The engine-facing routes (``GET /minipic/config``, ``POST /minipic/reset_prefix_cache``) come from
``engine_ext/endpoints.py``; this adds what a server needs above the engine: documents on the
standard OpenAI routes for any client (``serving/documents``). With the plugin off (stock
engine) a documents request gets a clear 400 instead of being answered without its documents.
"""

from __future__ import annotations

from argparse import Namespace
from typing import Any

from minipic.engine_ext.endpoints import MinipicEndpoints, current_config, served_model_support
from minipic.serving.documents import chat_render
from minipic.serving.documents.middleware import STATE_ATTR, DocumentsMiddleware
from minipic.span_contract.span_config import SpanConfig

# requests laid out, span prefills sent (a cold span shared by concurrent requests counts once)
DOCUMENTS_STATS_PATH = "/minipic/documents"


class MinipicServerEndpoints(MinipicEndpoints):
    def attach_router(self, app: Any) -> None:
        from fastapi import Request
        from fastapi.responses import JSONResponse

        super().attach_router(app)
        app.add_middleware(DocumentsMiddleware)

        async def documents_stats(request: Request) -> JSONResponse:
            denied = self.unauthorized(request)
            if denied is not None:
                return denied
            side = getattr(request.app.state, STATE_ATTR, None)
            if side is None:
                return JSONResponse({"enabled": False})
            return JSONResponse({"enabled": True, **side.stats()})

        documents_stats.__annotations__ = {"request": Request, "return": JSONResponse}
        app.add_api_route(DOCUMENTS_STATS_PATH, documents_stats, methods=["GET"])

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        await super().init_state(engine_client, state, args)
        span = SpanConfig.from_env()
        if span is None or engine_client is None or "hash" not in current_config()["features"]:
            return  # stock engine: documents requests are refused with a 400
        from minipic.serving.documents.server_side import ServerSide

        model = engine_client.model_config
        support = await served_model_support(engine_client)
        chat_render.install()
        setattr(state, STATE_ATTR, ServerSide(engine_client, str(model.model),
                                              model.max_model_len, span, support))
