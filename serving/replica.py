"""One replica of the cluster: the very server ``minipic serve`` runs, owned by a Ray Serve actor.

Why a server process rather than an engine object: a replica must answer exactly as one
``minipic serve`` does (vLLM's OpenAI routes, error bodies, streaming, ``cached_tokens``,
``GET /minipic/config``), so it runs that server, from the same ``EngineSettings.server_argv``,
and passes request bodies through unchanged. Ray Serve owns the rest: placement, health checks,
replacing a dead replica, and the request router that picks it.

What a replica adds to the stock server:

* vLLM's KV events on (``--kv-events-config``: a PUB socket and a replay socket on free ports of
  this node), announced with the server address and the hash setup through Ray Serve's routing
  stats (``record_routing_stats``), which is how ``serving.span_router`` finds them;
* its server dies with it: the server runs under ``serving.supervise.GuardedProcess``, so a
  replica actor killed outright leaves no API server, EngineCore or worker behind;
* on CPU, replicas of one node split its cores (``VLLM_CPU_OMP_THREADS_BIND``) instead of each
  binding every core;
* the identity of the span store it was pointed at (``store_id``, ``serving.store_identity``), so
  that the router treats the store as shared only when every replica reached the same one.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from minipic.engine_ext.endpoints import CACHE_RESET_ENV
from minipic.serving.request_blocks import HashSetup, RoutedRequest, none_hash_seed
from minipic.serving.store_identity import STAT_KEY, ReplicaStore
from minipic.serving.supervise import GuardedProcess
from minipic.span_contract.engine_config import EngineSettings

START_TIMEOUT_S = 900.0
ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def core_binding(local_rank: int, per_node: int) -> str | None:
    """This replica's share of the node's cores (vLLM CPU binds OpenMP threads to a list)."""
    cores = sorted(os.sched_getaffinity(0))
    if per_node <= 1 or not cores:
        return None
    share = max(1, len(cores) // per_node)
    start = (local_rank * share) % len(cores)
    return ",".join(str(c) for c in cores[start:start + share])


class EngineReplica:
    """A Ray Serve deployment class (``serving.cluster_app`` wraps it with ``serve.deployment``)."""

    def __init__(self, settings_json: str, served_name: str, *, replicas_per_node: int = 1,
                 enable_cache_reset: bool = False) -> None:
        import ray
        from ray import serve

        settings = EngineSettings.model_validate_json(settings_json)
        self.settings = settings
        self.host = ray.util.get_node_ip_address()
        self.http_port = free_port()
        pub, replay = free_port(), free_port()
        kv_events = {"enable_kv_cache_events": True, "publisher": "zmq",
                     "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}"}
        argv = settings.server_argv(self.host, self.http_port, served_name)
        argv += ["--kv-events-config", json.dumps(kv_events)]
        env = {**os.environ, **settings.plugin_env(),
               CACHE_RESET_ENV: "1" if enable_cache_reset else "0",
               "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "1"}
        try:
            rank = serve.get_replica_context().rank
            local_rank = rank.local_rank if hasattr(rank, "local_rank") else int(rank)
        except Exception:
            local_rank = 0
        binding = core_binding(local_rank, replicas_per_node)
        if binding and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            env["VLLM_CPU_OMP_THREADS_BIND"] = binding
        algo = str(settings.extra.get("prefix_caching_hash_algo", "sha256"))
        self.hash_setup = HashSetup(settings.span_config, algo, none_hash_seed(algo, env))
        self.log_path = tempfile.mkstemp(prefix="minipic-replica-", suffix=".log")[1]
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the server
        self.server = GuardedProcess(argv, env, stdout=self._log, stderr=self._log)
        self.base_url = f"http://{self.host}:{self.http_port}"
        self.stats = {
            "http": self.base_url,
            "kv_events": f"tcp://{self.host}:{pub}",
            "kv_replay": f"tcp://{self.host}:{replay}",
            "hash_fingerprint": self.hash_setup.fingerprint(),
            "server_pid": self.server.pid,
            "replica_pid": os.getpid(),
        }
        self._client = httpx.AsyncClient(base_url=self.base_url, timeout=httpx.Timeout(
            None, connect=10.0))
        self._wait_ready()
        # after the server is up: its store tier made the folder with the tier's modes first
        self.store = ReplicaStore.of_settings(settings)
        self.store.identity()

    def _log_tail(self, lines: int = 40) -> str:
        with open(self.log_path, "rb") as f:
            return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if not self.server.alive():
                raise RuntimeError(f"minipic replica: the vLLM server exited "
                                   f"(status {self.server.process.returncode}) during start-up; "
                                   f"its log ({self.log_path}) ends:\n{self._log_tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.server.stop(5)
        raise RuntimeError(f"minipic replica: the vLLM server was not healthy after "
                           f"{START_TIMEOUT_S:.0f} s; its log ends:\n{self._log_tail()}")

    # -- Ray Serve hooks ------------------------------------------------------------------------

    def record_routing_stats(self) -> dict[str, Any]:
        # the store identity again each time: a store folder deleted and recreated is another
        # store (one lstat unless the id file changed)
        return {**self.stats, STAT_KEY: self.store.identity()}

    async def check_health(self) -> None:
        if not self.server.alive():
            raise RuntimeError(f"the vLLM server exited; its log ends:\n{self._log_tail(10)}")
        response = await self._client.get("/health", timeout=10)
        if response.status_code != 200:
            raise RuntimeError(f"the vLLM server answers /health with {response.status_code}")

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.stop(10)

    # -- requests -------------------------------------------------------------------------------

    async def forward(self, request: RoutedRequest) -> AsyncIterator[Any]:
        """Pass one request to the server. Yields a head ``{"status", "media_type"}``, then the
        body's bytes; or a head ``{"retry": reason}`` when this replica's server is unreachable
        before anything was produced (the ingress then tries another replica)."""
        path = ROUTES[request.route]
        try:
            async with self._client.stream("POST", path, json=request.body) as response:
                yield {"status": response.status_code,
                       "media_type": response.headers.get("content-type", "application/json"),
                       "replica": self.stats["http"]}
                async for chunk in response.aiter_raw():
                    yield chunk
        except httpx.TransportError as exc:
            yield {"retry": f"replica {self.base_url}: {type(exc).__name__}: {exc}"}

    async def get(self, request: RoutedRequest) -> tuple[int, Any]:
        """``GET request.body["path"]`` on this replica's server (models, health, config)."""
        response = await self._client.get(request.body["path"], timeout=30)
        if not response.content:
            return response.status_code, {}
        try:
            return response.status_code, response.json()
        except ValueError:
            return response.status_code, {"error": response.text}
