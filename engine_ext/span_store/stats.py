"""``minipic_span_store_stats``: the store's counters, asked of the EngineCore by name.

vLLM's per-source hit counters only see contiguous external hits reported through
``get_num_new_matched_tokens``, which the span store does not use (its hits become pool hits),
so it keeps its own: tokens loaded from RAM / disk / shared, blocks saved, failed fills. The
front-end (``EmbeddedBackend``, ``GET /minipic/engine_stats``) reads them with vLLM's EngineCore
utility call, an extension point.
"""

from __future__ import annotations

from typing import Any

from minipic.span_contract.engine_utilities import SPAN_STORE_STATS_UTILITY


def _span_store_stats(engine_core: Any) -> dict[str, Any] | None:
    connector = getattr(engine_core.scheduler, "connector", None)
    stats = getattr(connector, "stats", None)
    if stats is None or getattr(connector, "lookup", None) is None:
        return None  # no span store configured
    return stats()


def install() -> None:
    """Make the utility callable on the EngineCore (idempotent)."""
    from vllm.v1.engine.core import EngineCore

    from minipic.engine_ext.vllm_surface import patches

    patches.add("store", {
        f"{EngineCore.__module__}:EngineCore.{SPAN_STORE_STATS_UTILITY}": _span_store_stats})
