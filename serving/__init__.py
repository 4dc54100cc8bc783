"""Serving minipic: one supervised server, or N replicas behind one URL on Ray Serve.

Where things are, in the order a request passes them in a cluster (``minipic serve --replicas``):

- ``cluster_app``: the Ray Serve application (``build_app``) and its driver (``run_cluster``)
- ``ingress``: the one URL: OpenAI routes, ``/minipic/config``, ``/minipic/cluster``, retries
- ``request_blocks``: a request's block hashes, computed with the engine's own hasher
- ``span_router``: where the replica is chosen (span blocks held anywhere in the prompt)
- ``block_index`` / ``kv_events``: what each replica holds, from vLLM's KV events
- ``replica``: one replica: the server ``minipic serve`` runs, with KV events on
- ``supervise``: server processes that die with their owner (SIGKILL included)

Names are imported on first use: the guard process (``python -m minipic.serving.supervise``) and
``minipic serve`` without replicas must not pay for importing Ray.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "BlockIndex": "minipic.serving.block_index",
    "ClusterIngress": "minipic.serving.ingress",
    "EngineReplica": "minipic.serving.replica",
    "EventSource": "minipic.serving.kv_events",
    "GuardedProcess": "minipic.serving.supervise",
    "HashSetup": "minipic.serving.request_blocks",
    "KvEventSubscriber": "minipic.serving.kv_events",
    "RequestBlockHasher": "minipic.serving.request_blocks",
    "RoundRobinRouter": "minipic.serving.span_router",
    "RoutedRequest": "minipic.serving.request_blocks",
    "SpanAffinityRouter": "minipic.serving.span_router",
    "build_app": "minipic.serving.cluster_app",
    "run_cluster": "minipic.serving.cluster_app",
    "supervise": "minipic.serving.supervise",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'serving' has no attribute {name!r}")
