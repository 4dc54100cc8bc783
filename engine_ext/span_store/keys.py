"""What a span-store entry is stored under: block hash + a fingerprint of everything else.

A span block's hash (``engine_ext/hashing/span_hashing.py``) names its tokens, its span chain, the
tenant's ``cache_salt`` and LoRA keys -- everything its KV depends on *inside one engine*. Outside
the engine the same hash could have been computed by other weights, another dtype or block
size, other SSEP/PDEP ids, or another page layout (the CPU kernel packs pages per ISA). The
config fingerprint names those; entries carry it in their header (a foreign entry is never
read) and the key mixes it with the block hash and vLLM's root hash ``NONE_HASH`` (random per
process for non-cryptographic hash functions without ``PYTHONHASHSEED``: then entries of another
process are simply never found).
"""

from __future__ import annotations

import hashlib

# The config fingerprint lives with the store's settings (span_contract), where the SDK can
# compute it too (orchestrator/span_index.py); re-exported here for the engine side.
from minipic.span_contract.span_store_config import (
    LAYOUT_VERSION,
    config_fingerprint,
    page_layout,
)

__all__ = ["LAYOUT_VERSION", "config_fingerprint", "entry_key", "page_layout", "rank_key"]


def entry_key(fingerprint: str, block_hash: bytes) -> str:
    """Store key of one block: its hash, the config fingerprint and the engine's root hash."""
    from vllm.v1.core import kv_cache_utils as kcu

    digest = hashlib.blake2b(digest_size=20)
    digest.update(fingerprint.encode())
    digest.update(bytes(kcu.NONE_HASH or b""))
    digest.update(bytes(block_hash))
    return digest.hexdigest()


def rank_key(key: str, rank: int, ranks: int) -> str:
    """The key of one tensor-parallel rank's part of an entry: with TP each rank holds the KV
    heads of its shard, so each writes and reads its own file, and a block is loaded only when
    every rank found its part (``scheduler_side``). Unchanged without TP."""
    return key if ranks == 1 else f"{key}-r{rank}"
