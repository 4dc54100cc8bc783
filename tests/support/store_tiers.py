"""Names the span store's tier tests share: the store's logger and fresh random entry keys."""

from __future__ import annotations

import random

LOGGER = "vllm.minipic.span_store"


def key_for(rng: random.Random, prefix: str | None = None) -> str:
    """A fresh entry key (64 hex digits); ``prefix`` replaces its first characters (a shard)."""
    key = rng.randbytes(32).hex()
    return key if prefix is None else prefix + key[len(prefix):]
