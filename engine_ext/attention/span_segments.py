"""Which keys a token may attend to: the span-isolation rule, in one place.

docs/design.md §2: the tokens of an SSEP-led segment (from an SSEP-led block up to the next
SSEP- or PDEP-led block) attend only within that segment; every other token (the leading system
blocks, PDEP-led blocks and the blocks chained after them, generated tokens after a question)
attends causally to everything before it. So for a request that opted in to span semantics,
query position ``t`` sees exactly the keys ``key_start(t) ..= t`` — one contiguous range — with

    key_start(t) = s * block_size   if the last marker block s <= t // block_size is SSEP-led
                   0                otherwise

The rule depends only on the request's tokens at block starts, so the EngineCore (hashing,
lookup) and the worker (attention) derive the same segments from the same tokens, and a span's
keys/values depend only on the span, whichever request computes it: its own span prefill, a hole
in a final prompt, or a final prompt sent cold. That is what makes a span-local hash a sound
cache key (``engine_ext/hashing/span_hashing.py``) and lets the lookup attach cached blocks after a
miss (``engine_ext/holes/scheduler_lookup.py``).
"""

from __future__ import annotations

import numpy as np


def block_key_starts(block_first_tokens: np.ndarray, ssep_id: int, pdep_id: int,
                     block_size: int) -> np.ndarray:
    """``key_start`` (a token index) for every block, given the first token of each block.

    ``block_first_tokens[b]`` is token ``b * block_size`` of the request. Returns int64 of the
    same length: the first key a query inside block ``b`` may attend to.
    """
    firsts = np.asarray(block_first_tokens)
    n = firsts.shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    idx = np.arange(n, dtype=np.int64)
    is_ssep = firsts == ssep_id
    is_marker = is_ssep | (firsts == pdep_id)
    last_marker = np.maximum.accumulate(np.where(is_marker, idx, -1))
    led_by_ssep = (last_marker >= 0) & is_ssep[np.maximum(last_marker, 0)]
    return np.where(led_by_ssep, last_marker * block_size, 0)

