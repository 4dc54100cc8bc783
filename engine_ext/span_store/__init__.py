"""The span store: position-free KV blocks kept outside the engine's pool, so span warmth survives
evictions, restarts and replica boundaries.

``tiers`` holds the storage (a bounded host-RAM LRU in front of persistent directory tiers: the
local disk, or a directory shared by several replicas or nodes); it knows nothing of vLLM and
stores opaque payloads under string keys. The vLLM KV connector that fills and reads it lives in
``connector``.
"""

from minipic.engine_ext.span_store.tiers import DirTier, Entry, RamTier, TieredStore

__all__ = ["DirTier", "Entry", "RamTier", "TieredStore"]
