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

The sink (the model's opening copied after a span's SSEP, :func:`span_sinks`) and the copy of a
head computed in context before the span (:func:`span_hidden`) live inside their span's segment,
so this rule also keeps every other segment from them; rule 1 hides them from the rows outside
any span.

**Markers are prompt tokens.** The client lays out the prompt, never the answer: a token the
model generates is a real token whatever its id (docs/design.md §2). So a block whose first
token was generated is never a marker block (``num_prompt_tokens``), and a generated token is
never isolated: it attends causally to every real key before it, as the question does
(:func:`query_segments`), even when the prompt ended inside a span. Were a generated SSEP at a
block start a marker, the model could open a span of its own, whose KV the span hash would then
name as if it were position independent.
"""

from __future__ import annotations

import numpy as np


def block_key_starts(block_first_tokens: np.ndarray, ssep_id: int, pdep_id: int,
                     block_size: int, num_prompt_tokens: int | None = None) -> np.ndarray:
    """``key_start`` (a token index) for every block, given the first token of each block.

    ``block_first_tokens[b]`` is token ``b * block_size`` of the request. Returns int64 of the
    same length: the first key a query inside block ``b`` may attend to (a prompt token's: a
    generated one's is 0, :func:`query_segments`). ``num_prompt_tokens``: the request's prompt
    length, when the blocks reach past it (None: every token is prompt).
    """
    return block_segments(block_first_tokens, ssep_id, pdep_id, block_size,
                          num_prompt_tokens)[0]


def block_segments(block_first_tokens: np.ndarray, ssep_id: int, pdep_id: int,
                   block_size: int, num_prompt_tokens: int | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """``(key_start, isolated)`` per block: :func:`block_key_starts`, and whether the block's
    (prompt) tokens belong to an SSEP-led segment (they attend only within it; ``key_start``
    alone cannot say so for a segment that starts at token 0). A block that starts at or after
    ``num_prompt_tokens`` starts with a generated token, which is never a marker."""
    led_by_ssep, last_marker = _segments(block_first_tokens, ssep_id, pdep_id, block_size,
                                         num_prompt_tokens)
    return np.where(led_by_ssep, last_marker * block_size, 0), led_by_ssep


def query_segments(block_key_start: np.ndarray, block_isolated: np.ndarray,
                   positions: np.ndarray, block_size: int, num_prompt_tokens: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """``(key_start, isolated)`` per query at ``positions``, from :func:`block_segments`.

    A prompt token takes its block's; a generated token (position ``>= num_prompt_tokens``) is
    never isolated: it attends to every real key before it, as the question does, even after a
    prompt that ended inside a span (docs/design.md §2). Why not the span's isolation: a span's
    rule exists so that its KV depends on the span alone and can be reused anywhere; what the
    model generates is no span anyone laid out or reuses, and the reference definition
    (``minipic/tune/layout.py``) isolates only the spans of the prompt."""
    blocks = positions // block_size
    generated = positions >= num_prompt_tokens
    return (np.where(generated, 0, block_key_start[blocks]),
            np.where(generated, False, block_isolated[blocks]))


def _segments(block_first_tokens: np.ndarray, ssep_id: int, pdep_id: int, block_size: int,
              num_prompt_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(led_by_ssep, last_marker)`` per block: whether the segment holding it is SSEP-led,
    and the block index of its last marker at or before it (-1: none). Only a block that
    starts inside the prompt (before ``num_prompt_tokens``) can be a marker block."""
    firsts = np.asarray(block_first_tokens)
    idx = np.arange(firsts.shape[0], dtype=np.int64)
    in_prompt = (idx * block_size < num_prompt_tokens if num_prompt_tokens is not None
                 else np.ones(idx.shape, dtype=bool))
    is_ssep = (firsts == ssep_id) & in_prompt
    is_marker = is_ssep | ((firsts == pdep_id) & in_prompt)
    last_marker = np.maximum.accumulate(np.where(is_marker, idx, -1)) if idx.size else idx
    led_by_ssep = (last_marker >= 0) & is_ssep[np.maximum(last_marker, 0)]
    return led_by_ssep, last_marker


def span_hidden(tokens: np.ndarray, block_size: int, ssep_id: int, pdep_id: int, pad_id: int,
                sink_ids: tuple[int, ...], in_sink: np.ndarray | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """Per token: ``(index, length)`` of its place in a span's hidden run (-1, 0: none).

    A span's hidden run (docs/design.md §2) is what follows its SSEP and only the span itself
    sees: its sink (:func:`span_sinks`), then its **head's copy**. A span whose text, after the
    sink, begins with exactly the real tokens of the PDEP-led segment right before its SSEP (a
    head the prompt computes in context, ``selective@B``) hides those tokens: they are the
    cached span's own opening, which its later tokens saw when the span was computed alone, and
    which no other query must see twice; the in-context head before it holds their positions.
    The hidden run sits on the positions just before the span's first shown token. A prompt
    without heads hides its sinks only, as before.

    ``tokens`` must be the whole prompt, and only it (as :func:`span_sinks`). ``in_sink``:
    :func:`span_sinks` ``>= 0`` for the same arguments, when the caller has it already.
    """
    index = np.full(tokens.shape[0], -1, dtype=np.int64)
    length = np.zeros(tokens.shape[0], dtype=np.int64)
    firsts = tokens[::block_size]
    if in_sink is None:
        in_sink = span_sinks(tokens, block_size, ssep_id, sink_ids) >= 0
    _, last_marker = _segments(firsts, ssep_id, pdep_id, block_size, tokens.shape[0])
    for block in np.flatnonzero(firsts == ssep_id):
        start = int(block) * block_size
        lead = len(sink_ids) if start + 1 < tokens.shape[0] and in_sink[start + 1] else 0
        head = _head_before(tokens, block, last_marker, block_size, pdep_id, pad_id, ssep_id)
        after = start + 1 + lead
        if head.size and not np.array_equal(tokens[after:after + head.size], head):
            head = head[:0]
        run = lead + head.size
        index[start + 1:start + 1 + run] = np.arange(run)
        length[start + 1:start + 1 + run] = run
    return index, length


def _head_before(tokens: np.ndarray, block: int, last_marker: np.ndarray, block_size: int,
                 pdep_id: int, pad_id: int, ssep_id: int) -> np.ndarray:
    """The real tokens of the PDEP-led segment that ends at SSEP block ``block``: its PDEP, then
    real tokens, then PADs only (empty when the segment before is no such head)."""
    if block == 0 or last_marker[block - 1] < 0:
        return tokens[:0]
    first = int(last_marker[block - 1]) * block_size
    segment = tokens[first:int(block) * block_size]
    if segment[0] != pdep_id:
        return tokens[:0]
    body = segment[1:]
    real = int(np.flatnonzero(body != pad_id)[-1]) + 1 if (body != pad_id).any() else 0
    head = body[:real]
    if np.isin(head, (pdep_id, pad_id, ssep_id)).any():
        return tokens[:0]
    return head


def span_sinks(tokens: np.ndarray, block_size: int, ssep_id: int,
               sink_ids: tuple[int, ...]) -> np.ndarray:
    """Per token: its index within a span's sink, or -1.

    A span's sink (docs/design.md §2) is the model's opening right after an SSEP at a block
    start: the ``len(sink_ids)`` tokens there, when they are exactly ``sink_ids``. A span without
    them simply has no sink. ``tokens`` must be the whole prompt, and only it: every chunk of a
    request then sees the same sinks, and none is ever made of generated tokens (a generated
    SSEP followed by the opening is no span, its tokens are real).
    """
    out = np.full(tokens.shape[0], -1, dtype=np.int64)
    size = len(sink_ids)
    if size == 0:
        return out
    sink = np.asarray(sink_ids)
    for start in np.flatnonzero(tokens[::block_size] == ssep_id) * block_size:
        run = tokens[start + 1: start + 1 + size]
        if run.shape[0] == size and np.array_equal(run, sink):
            out[start + 1: start + 1 + size] = np.arange(size)
    return out

