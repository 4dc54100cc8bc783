"""Storage tiers of the span store: a bounded host-RAM LRU in front of persistent directory tiers.

The store holds KV blocks as opaque payloads (~0.1-2 MB) under string keys that already name
everything the KV depends on (block hash + config fingerprint; the connector builds them), each
with a small JSON metadata dict. Nothing here knows about vLLM or tensors.

* :class:`RamTier` (``ram``) — a thread-safe, byte-bounded LRU in host memory.
* :class:`DirTier` (``directory``) — one file per entry in a directory, bounded, LRU-evicting
  and crash-safe. It is the embedded default (a local disk) and also the shared tier for
  several replicas or nodes (the same directory on a shared mount); its docstring says why a
  shared directory and not Redis, and what crash safety and sharing mean.
* :class:`TieredStore` (``store``) — RAM first, then the persistent tiers in order. Writes to
  persistent tiers run on one background thread per tier (``writer``) behind a bounded queue,
  so a caller (the engine's step) never waits for a disk; when a queue is full the write is
  dropped and counted, never blocked on.

The rest: ``base`` (:class:`Entry`, the key rule, the reasons a read misses), ``format`` (the
entry file's bytes: the only writer and reader of them), ``files`` (file modes, no-follow
opens, the MAC), ``secret`` (the store's secret: created, read, rotated, kept through a bad
look), ``backoff`` (when writes resume after a fault), ``folder_usage`` (the folder-wide byte
ledger that makes the bound hold per folder, the free-space floor), ``dir_index`` (what a
directory tier knows of its folder without asking it: ``has``, scans, eviction).
"""

from minipic.engine_ext.span_store.tiers.base import (
    KEPT_REASONS,
    RAM_SOURCE,
    REMOVED_REASONS,
    Entry,
    check_key,
)
from minipic.engine_ext.span_store.tiers.directory import DirTier
from minipic.engine_ext.span_store.tiers.format import (
    FORMAT_VERSION,
    HASHED_HEADER_BYTES,
    HEADER,
    MAGIC,
    SUFFIX,
    TEMP_PREFIX,
)
from minipic.engine_ext.span_store.tiers.ram import RamTier
from minipic.engine_ext.span_store.tiers.store import TieredStore
from minipic.engine_ext.span_store.tiers.writer import TierWriter

__all__ = [
    "FORMAT_VERSION",
    "HASHED_HEADER_BYTES",
    "HEADER",
    "KEPT_REASONS",
    "MAGIC",
    "RAM_SOURCE",
    "REMOVED_REASONS",
    "SUFFIX",
    "TEMP_PREFIX",
    "DirTier",
    "Entry",
    "RamTier",
    "TierWriter",
    "TieredStore",
    "check_key",
]
