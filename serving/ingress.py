"""The cluster's front door: one URL with the routes of ``minipic serve``, in front of N replicas.

A client (``Orchestrator.connect(url)``, the ``openai`` client, curl) cannot tell it from one
``minipic serve``: the same OpenAI routes, bodies and errors, and ``GET /minipic/config`` with the
replicas' span config. What differs is said in that config's ``cluster`` entry; its ``instance``
is the cluster's, not a replica's, because a replica restarting loses only its own cache.

Per request the ingress computes the prompt's block hashes (``serving.request_blocks``: the
engine's hasher), hands the request to the engine deployment through Ray, whose request router
(``serving.span_router``) picks the replica, and relays the answer. A replica that dies before it
produced anything is retried on another (``MAX_ATTEMPTS``, with backoff): its questions are
answered elsewhere, none is lost. A stream cut after its first bytes ends with an explicit error
event, never silently.

A request body passes ``serving.body_limit`` before anything else reads it: the limit a server
applies (``minipic serve --max-body-mib``, ``Limits`` from this process's environment) and its
413, applied here too, so that an oversized body is refused before the ingress holds, parses or
hashes it, not only later inside a replica.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError

from minipic.engine_ext.endpoints import RESET_PATH
from minipic.serving.body_limit import BodyLimitMiddleware, error_body
from minipic.serving.request_blocks import HashSetup, RequestBlockHasher, RoutedRequest
from minipic.span_contract.engine_config import EngineSettings

MAX_ATTEMPTS = 3
RETRY_BACKOFF_S = 0.5
REPLICA_HEADER = "x-minipic-replica"
ENGINE_DEPLOYMENT = "engine"

app = FastAPI(title="minipic cluster")
# added before ``serve.ingress`` below takes its copy of the app (later changes would not reach
# the deployment); outermost of the app's own layers, so no route sees an unbounded body
app.add_middleware(BodyLimitMiddleware)


def _error(status: int, message: str, kind: str = "BadRequestError") -> Response:
    """vLLM's error body, so clients parse cluster errors as they parse a server's."""
    return Response(error_body(status, message, kind), status_code=status,
                    media_type="application/json")


class _ReplicaLost(Exception):
    pass


def running_replicas(app_name: str = "minipic") -> int:
    overview = serve.status().applications.get(app_name)
    engine = overview.deployments.get(ENGINE_DEPLOYMENT) if overview else None
    if engine is None:
        return 0
    return sum(n for state, n in engine.replica_states.items()
               if str(getattr(state, "value", state)) == "RUNNING")


@serve.ingress(app)
class ClusterIngress:
    def __init__(self, engine: Any, settings_json: str, *, instance: str, replicas: int,
                 router: str, hash_setup: HashSetup) -> None:
        settings = EngineSettings.model_validate_json(settings_json)
        self.engine = engine
        self.instance = instance
        # only the span router reads block hashes and routes prefills by their final
        self.cluster = {"replicas": replicas, "router": router,
                        "route_hints": router == "span"}
        self.hasher = RequestBlockHasher(hash_setup, settings.model, settings.max_model_len)
        self.retries = 0
        self._running_at, self._running_count = 0.0, 0
        self.hash_ms = 0.0  # the router's cost in this process: hashing each request's blocks
        self.hashed = 0

    # -- OpenAI routes --------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._serve("completions", request)

    @app.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        return await self._serve("chat", request)

    @app.get("/v1/models")
    async def models(self) -> Response:
        return await self._get("/v1/models")

    @app.get("/health")
    async def health(self) -> Response:
        """200 while at least one replica runs (a cluster with a replica down still answers);
        how many of them run is in ``GET /minipic/config`` (``cluster.running``)."""
        if await self._running() == 0:
            return _error(503, "no engine replica is running yet", "ServiceUnavailableError")
        return await self._get("/health")

    @app.get("/minipic/config")
    async def config(self) -> Response:
        running = await self._running()
        if running == 0:
            return _error(503, "no engine replica is running yet", "ServiceUnavailableError")
        status, body = await self._replica_get("/minipic/config")
        if status == 200 and isinstance(body, dict):
            body = {**body, "instance": self.instance,
                    "cluster": {**self.cluster, "running": running}, "cache_reset": False}
        return JSONResponse(body, status_code=status)

    async def _running(self) -> int:
        """Running engine replicas, from Serve's controller (cached for a second): answering
        "no replica" at once beats a request queued until one starts."""
        now = time.monotonic()
        if now - self._running_at > 1.0:
            self._running_at = now
            self._running_count = await asyncio.to_thread(running_replicas)
        return self._running_count

    @app.post(RESET_PATH)
    async def reset(self) -> Response:
        return _error(501, "a cluster has no single prefix cache to reset: each replica keeps "
                           "its own (restart the deployment to start cold)", "NotImplemented")

    # -- the router's view ------------------------------------------------------------------------

    @app.get("/minipic/cluster")
    async def cluster_state(self) -> Response:
        router = self._router()
        state = router.state() if router is not None else {"router": self.cluster["router"],
                                                           "replicas": {}}
        return JSONResponse({**state, "cluster": self.cluster, "ingress_retries": self.retries,
                             "requests": self.hashed,
                             "hash_ms_mean": self.hash_ms / self.hashed if self.hashed else 0.0})

    @app.post("/minipic/cluster/held")
    async def held(self, request: Request) -> Response:
        """What the router believes each replica holds of this (completion) body's blocks:
        ``stored`` from the engines' KV events alone, ``held`` with its recent sends too."""
        body = await self._body(request)
        if isinstance(body, Response):
            return body
        router = self._router()
        if router is None:
            return _error(404, f"router {self.cluster['router']!r} keeps no block index",
                          "NotFound")
        routed = self.hasher.routed("chat" if "messages" in body else "completions", body)
        return JSONResponse({"block_hashes": len(routed.block_hashes),
                             "held": router.held_by(routed.block_hashes),
                             "stored": router.held_by(routed.block_hashes, False)})

    def _router(self) -> Any:
        from minipic.serving import router_registry

        return router_registry.lookup(serve.get_replica_context().app_name)

    # -- plumbing -------------------------------------------------------------------------------

    async def _body(self, request: Request) -> dict[str, Any] | Response:
        raw = await request.body()  # within the limit: BodyLimitMiddleware read it first
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, ValueError) as exc:
            return _error(400, f"the request body is not JSON: {exc}")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        return body

    async def _serve(self, route: str, request: Request) -> Response:
        body = await self._body(request)
        if isinstance(body, Response):
            return body
        routed = await asyncio.to_thread(self.hasher.routed, route, body,
                                         hash_blocks=self.cluster["route_hints"])
        self.hash_ms += routed.hash_ms
        self.hashed += 1
        reason = "no replica answered"
        for attempt in range(MAX_ATTEMPTS):
            if attempt:
                self.retries += 1
                await asyncio.sleep(RETRY_BACKOFF_S * attempt)
            try:
                return await self._attempt(routed)
            except _ReplicaLost as exc:
                reason = str(exc)
        return _error(503, f"the request failed on {MAX_ATTEMPTS} replicas; last: {reason}",
                      "ServiceUnavailableError")

    async def _attempt(self, routed: RoutedRequest) -> Response:
        stream = self.engine.options(stream=True).forward.remote(routed)
        try:
            head = await stream.__anext__()
        except (RayActorError, ActorUnavailableError) as exc:
            raise _ReplicaLost(f"{type(exc).__name__}: {exc}") from None
        if "retry" in head:
            raise _ReplicaLost(head["retry"])
        headers = {REPLICA_HEADER: str(head.get("replica", ""))}
        if not routed.body.get("stream"):
            chunks = []
            try:
                async for chunk in stream:
                    if isinstance(chunk, dict):
                        raise _ReplicaLost(chunk.get("retry", "replica lost"))
                    chunks.append(chunk)
            except (RayActorError, ActorUnavailableError) as exc:
                raise _ReplicaLost(f"{type(exc).__name__}: {exc}") from None
            return Response(b"".join(chunks), status_code=head["status"],
                            media_type=head["media_type"], headers=headers)
        return StreamingResponse(self._relay(stream), status_code=head["status"],
                                 media_type=head["media_type"], headers=headers)

    async def _relay(self, stream: Any) -> AsyncIterator[bytes]:
        try:
            async for chunk in stream:
                if isinstance(chunk, dict):
                    raise _ReplicaLost(chunk.get("retry", "replica lost"))
                yield chunk
        except (RayActorError, ActorUnavailableError, _ReplicaLost) as exc:
            error = {"error": {"message": f"the replica was lost mid-stream: {exc}",
                               "type": "ServiceUnavailableError", "code": 503}}
            yield f"data: {json.dumps(error)}\n\n".encode()

    async def _replica_get(self, path: str) -> tuple[int, Any]:
        for attempt in range(MAX_ATTEMPTS):
            try:
                # a RoutedRequest like every call through the handle: routers read its fields
                # (Ray's prefix router fails on arguments without a non-empty ``prompt``)
                return await self.engine.get.remote(
                    RoutedRequest(route="get", body={"path": path}, prompt=path))
            except (RayActorError, ActorUnavailableError):
                await asyncio.sleep(RETRY_BACKOFF_S * (attempt + 1))
        return 503, {"error": {"message": "no replica answered", "code": 503}}

    async def _get(self, path: str) -> Response:
        status, body = await self._replica_get(path)
        return JSONResponse(body, status_code=status)
