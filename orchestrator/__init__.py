"""The client-side runtime: span prefills, ISPS scheduling, warmth tracking, and the RAG SDK.

Start with ``Orchestrator.embedded()`` (in-process vLLM) or ``Orchestrator.connect(url)``
(``minipic serve``), then ``await orc.answer(question, documents=[...])``; sync code uses
``SyncOrchestrator`` with the same methods. Modules, in the order a request passes them:

- ``client`` / ``sync_client``: the SDK surface (``Orchestrator``, ``SyncOrchestrator``)
- ``scheduler``: where the schedule is decided (ISPS or barrier, de-dup, retries, re-warm)
- ``warmth``: what is believed warm, and the check of that belief against cached-token counts
- ``slots``: bounded in-flight engine requests, oldest question first
- ``backends`` / ``embedded_backend`` / ``http_backend``: the engine interface and its two forms
- ``errors``, ``results``, ``retry``: what callers catch, read and tune
- ``streaming``: one question's answer token by token (spans warmed first, final sent once)
- ``loop_bridge``: running the SDK from sync code and from another event loop (the framework
  integrations in ``integrations/`` use it)
- ``corpus``: the offline Wikipedia corpus and question set

LangChain and LlamaIndex live beside the SDK, in ``integrations/``.
"""

from __future__ import annotations

from minipic.orchestrator.backends import BackendInfo, Completion, EngineBackend, Sampling
from minipic.orchestrator.client import Orchestrator, Question
from minipic.orchestrator.errors import (
    BadInputError,
    CacheMismatchError,
    ConfigMismatchError,
    EngineError,
    EngineIntegrationError,
    EngineUnreachableError,
    MinipicError,
    RequestTimeoutError,
    SpanTooLongError,
    UnavailableError,
)
from minipic.orchestrator.results import Answer, SpanStatus
from minipic.orchestrator.retry import RetryPolicy
from minipic.orchestrator.scheduler import SchedulerEvent, SchedulerOptions
from minipic.orchestrator.sync_client import SyncOrchestrator
from minipic.orchestrator.warmth import WarmthRegistry

__all__ = [
    "Answer",
    "BackendInfo",
    "BadInputError",
    "CacheMismatchError",
    "Completion",
    "ConfigMismatchError",
    "EngineBackend",
    "EngineError",
    "EngineIntegrationError",
    "EngineUnreachableError",
    "MinipicError",
    "Orchestrator",
    "Question",
    "RequestTimeoutError",
    "RetryPolicy",
    "Sampling",
    "SchedulerEvent",
    "SchedulerOptions",
    "SpanStatus",
    "SpanTooLongError",
    "SyncOrchestrator",
    "UnavailableError",
    "WarmthRegistry",
]
