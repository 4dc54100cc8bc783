"""minipic: span-aware, position-independent KV caching for RAG and agent prompts on vLLM.

One import name for everything: the app (CLI, serve, demo, bench, index, eval, tune) lives in this
package's own modules, and the layers below it are its sub-packages -- ``minipic.orchestrator``
(the SDK), ``minipic.integrations`` (LangChain, LlamaIndex), ``minipic.serving``,
``minipic.prompt_builder``, ``minipic.engine_ext`` (the vLLM plugin), ``minipic.span_contract``,
``minipic.kernels`` and ``minipic.checkpoint_planner``. In a checkout they are links to the
repository's top-level folders; an installed wheel holds them as folders.

The SDK's names are attributes here (``from minipic import Orchestrator``), loaded on first use:
``import minipic`` stays light, because vLLM's engine processes import it to load the plugin and
must not pull in the SDK, LangChain or LlamaIndex.

Importing the package imports ``minipic.engine_logs`` (stdlib only, cheap) on purpose: vLLM's
engine processes are spawned, re-import the parent's ``__main__`` — ``minipic.cli`` or an example
script, both of which import this package — and so install the known-noise log filter that
``quiet_engine_logs`` asked for before they import vLLM (see ``minipic/engine_logs.py``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from minipic import engine_logs as _engine_logs  # noqa: F401  (see the docstring)

# public name -> the module that defines it (docs/api.md lists them)
_LAZY = {
    **dict.fromkeys(
        ("Answer", "BackendInfo", "Completion", "EngineBackend", "Orchestrator", "Question",
         "RetryPolicy", "Sampling", "SchedulerEvent", "SchedulerOptions", "SpanStatus",
         "SyncOrchestrator", "WarmthRegistry"), "minipic.orchestrator"),
    **dict.fromkeys(
        ("BadInputError", "CacheMismatchError", "ConfigMismatchError", "EngineError",
         "EngineIntegrationError", "EngineUnreachableError", "MinipicError",
         "RequestTimeoutError", "SpanTooLongError", "UnavailableError"),
        "minipic.span_contract.errors"),
    **dict.fromkeys(("PromptBuilder", "Span", "Mode", "BudgetPolicy"),
                    "minipic.prompt_builder"),
    "SpanConfig": "minipic.span_contract.span_config",
    "EngineSettings": "minipic.span_contract.engine_config",
    "SpanStoreConfig": "minipic.span_contract.span_store_config",
}

__all__ = [
    "Answer",
    "BackendInfo",
    "BadInputError",
    "BudgetPolicy",
    "CacheMismatchError",
    "Completion",
    "ConfigMismatchError",
    "EngineBackend",
    "EngineError",
    "EngineIntegrationError",
    "EngineSettings",
    "EngineUnreachableError",
    "MinipicError",
    "Mode",
    "Orchestrator",
    "PromptBuilder",
    "Question",
    "RequestTimeoutError",
    "RetryPolicy",
    "Sampling",
    "SchedulerEvent",
    "SchedulerOptions",
    "Span",
    "SpanConfig",
    "SpanStatus",
    "SpanStoreConfig",
    "SpanTooLongError",
    "SyncOrchestrator",
    "UnavailableError",
    "WarmthRegistry",
]

if TYPE_CHECKING:  # what editors and type checkers see; at run time __getattr__ loads them
    from minipic.orchestrator import (
        Answer,
        BackendInfo,
        Completion,
        EngineBackend,
        Orchestrator,
        Question,
        RetryPolicy,
        Sampling,
        SchedulerEvent,
        SchedulerOptions,
        SpanStatus,
        SyncOrchestrator,
        WarmthRegistry,
    )
    from minipic.prompt_builder import BudgetPolicy, Mode, PromptBuilder, Span
    from minipic.span_contract.engine_config import EngineSettings
    from minipic.span_contract.errors import (
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
    from minipic.span_contract.span_config import SpanConfig
    from minipic.span_contract.span_store_config import SpanStoreConfig


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'minipic' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
