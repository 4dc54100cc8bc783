"""The Ray Serve application: ``ClusterIngress`` -> ``engine`` (N ``EngineReplica``) + a router.

``build_app`` only describes the application; ``run_cluster`` starts Ray (or joins a running
cluster with ``address``), deploys it, and keeps it up until a stop signal. ``minipic serve
--replicas N`` calls ``run_cluster``; on a multi-node cluster the same application is deployed
from any node with ``--ray-address`` (``docs/scale_out.md``).

Routers (``--router``): ``span`` (``serving.span_router.SpanAffinityRouter``, the default),
``prefix`` (Ray's ``PrefixCacheAffinityRouter``), ``round_robin``, ``pow2`` (Ray's default).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import uuid
from typing import Any

from minipic.serving.request_blocks import HashSetup, none_hash_seed
from minipic.span_contract.engine_config import EngineSettings

APP_NAME = "minipic"
ROUTERS = {
    "span": "minipic.serving.span_router.SpanAffinityRouter",
    "prefix": "ray.serve.llm.request_router.PrefixCacheAffinityRouter",
    "round_robin": "minipic.serving.span_router.RoundRobinRouter",
    "pow2": None,
}
# requests one replica takes at once: vLLM batches them itself; Ray's default (5) would queue
# the client's pipelined span prefills in front of the engine instead of inside it
MAX_ONGOING_PER_REPLICA = 64


def build_app(settings: EngineSettings, *, replicas: int, router: str = "span",
              served_name: str = "minipic", replicas_per_node: int | None = None,
              max_imbalance: int | None = None, enable_cache_reset: bool = False) -> Any:
    """The application for resolved ``settings`` (the ones ``minipic serve`` would run).

    ``max_imbalance`` (span router): None decides it at run time by whether the replicas really
    share one span store (each reports its store's identity, ``serving.store_identity``), not by
    whether a shared directory is configured: the same path on several nodes is often a local
    disk on each."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from minipic.serving.ingress import ClusterIngress
    from minipic.serving.replica import EngineReplica

    if router not in ROUTERS:
        raise ValueError(f"unknown router {router!r}; choose one of {sorted(ROUTERS)}")
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    algo = str(settings.extra.get("prefix_caching_hash_algo", "sha256"))
    setup = HashSetup(settings.span_config, algo, none_hash_seed(algo))
    options: dict[str, Any] = dict(
        name="engine", num_replicas=replicas, max_ongoing_requests=MAX_ONGOING_PER_REPLICA,
        # the engine's threads are vLLM's own; a logical CPU per replica would only make Ray
        # refuse a second replica on a small machine
        ray_actor_options={"num_cpus": 0},
        health_check_period_s=5, health_check_timeout_s=60, graceful_shutdown_timeout_s=30,
    )
    router_cls = ROUTERS[router]
    if router_cls is not None:  # an import path: Ray imports it where each handle lives
        kwargs = {"hash_fingerprint": setup.fingerprint(), "max_imbalance": max_imbalance} \
            if router == "span" else {}
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=router_cls, request_router_kwargs=kwargs,
            request_routing_stats_period_s=1.0)
    engine = serve.deployment(EngineReplica).options(**options).bind(
        settings.model_dump_json(), served_name,
        replicas_per_node=replicas_per_node or replicas,
        enable_cache_reset=enable_cache_reset)
    ingress = serve.deployment(ClusterIngress).options(
        name="ingress", max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine, settings.model_dump_json(), instance=uuid.uuid4().hex,
                        replicas=replicas, router=router, hash_setup=setup)


def run_cluster(settings: EngineSettings, *, replicas: int, host: str, port: int,
                router: str = "span", served_name: str = "minipic", address: str | None = None,
                replicas_per_node: int | None = None, enable_cache_reset: bool = False) -> int:
    """Start (or join) Ray, deploy the app at ``http://host:port``, serve until a stop signal."""
    import ray
    from ray import serve

    from minipic.serving.documents.bodies import Limits

    logging.getLogger("ray").setLevel(logging.WARNING)
    # LD_PRELOAD is for the vLLM servers only: each replica computes it again for its own
    # server (EngineReplica), and Ray's worker processes keep their own allocator.
    # The request limits (--max-body-mib ...) go to every process of the job, on every node:
    # the ingress applies the body limit as the replicas' servers do (serving.body_limit);
    # inheriting this process's environment would reach only processes Ray starts from it
    env_vars = {k: v for k, v in settings.plugin_env().items() if k != "LD_PRELOAD"}
    runtime_env = {"env_vars": {**env_vars, **Limits.from_env().env()}}
    if address is None:
        ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False,
                 runtime_env=runtime_env, logging_level=logging.WARNING)
    else:
        ray.init(address=address, runtime_env=runtime_env, logging_level=logging.WARNING)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        app = build_app(settings, replicas=replicas, router=router, served_name=served_name,
                        replicas_per_node=replicas_per_node,
                        enable_cache_reset=enable_cache_reset)
        serve.run(app, name=APP_NAME, route_prefix="/")
        print(f"minipic serve: {replicas} replica(s), router={router} -> "
              f"http://{host}:{port} (pid {os.getpid()})", file=sys.stderr, flush=True)
        stop.wait()
        print("minipic serve: stopping the cluster", file=sys.stderr, flush=True)
        return 0
    finally:
        try:
            serve.delete(APP_NAME)
            if address is None:
                serve.shutdown()
        finally:
            ray.shutdown()


def main(argv: list[str]) -> int:
    """``python -m minipic.serving.cluster_app JSON``: the Ray driver ``minipic serve
    --replicas`` runs under its supervisor (so a SIGKILLed ``minipic serve`` takes Ray's own
    processes down too).
    JSON: ``run_cluster``'s keyword arguments, with ``settings`` as EngineSettings JSON."""
    import json

    params = json.loads(argv[0])
    settings = EngineSettings.model_validate_json(params.pop("settings"))
    return run_cluster(settings, **params)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
