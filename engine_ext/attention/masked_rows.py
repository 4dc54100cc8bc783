"""Rule 1 on the CPU: attention for the requests that hold layout tokens, with a key mask.

docs/design.md §2: a span request's SSEP, PDEP and PAD are attended by no query but their own
and take no RoPE position. vLLM's C++ CPU kernel attends every key of a row's range and takes
no mask, so these rows (``step_plan.MaskedBatch``) are attended here, with
``torch.nn.functional.scaled_dot_product_attention`` and a boolean mask.

Why the work is split the way it is: everything that depends only on the step — the blocks a row
reads in table order, the move of each key from its home position (where the cache holds it
rotated) to its logical one, each query's move from the physical position the model rotated it
at, and the mask — is the same in every layer, so :func:`prepare` builds it once per step (the
first layer), and a layer does only its own part: one copy of the row's pages, keys and values
brought to token order through the page layout vLLM's writer uses (``cpu_kv_layout``), one call
of the model's rotary op on each (moves by an offset table, as the key shadow does,
``cpu_backend.move_keys``), and attention as two ``einsum`` and a softmax in fp32. Measured per
layer on the 2-core box (960 keys, SmolLM2 heads): gathering pages then reordering them 0.13 ms
against 4.0 ms for one element-wise gather; ``einsum`` 0.10 ms against 0.42 ms for
``scaled_dot_product_attention`` with a boolean mask and grouped heads at one query. The
arithmetic is ``kernels.paged_attention_rope_ref`` with ``key_positions``, which the tests hold
the engine to.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from minipic.engine_ext.attention.cpu_kv_layout import PageLayout
from minipic.engine_ext.attention.step_plan import MaskedBatch

_PREPARED = "masked_rows"  # key of the per-step preparation in MaskedBatch.derived

# rotate(x [n, heads, D] in place, offsets [n]): the model's rotary op moving each row by its
# offset (positions into an offset table)
Rotate = Callable[[torch.Tensor, torch.Tensor], None]


@dataclass
class PreparedRow:
    """One kernel row of a masked request, ready for any layer of the group."""

    queries: torch.Tensor  # [q] int64: the row's query rows in the step
    blocks: torch.Tensor  # [ceil(n / bs)] int64: the physical blocks it reads, in table order
    keys: int  # n: its keys are tokens 0 .. n - 1 of those blocks
    key_moves: torch.Tensor  # [n] int64: logical minus home position of each key
    query_moves: torch.Tensor  # [q] int64: logical minus physical position of each query
    mask: torch.Tensor  # [q, n] bool: what each query sees


def prepare(batch: MaskedBatch, home_slots: torch.Tensor, block_size: int
            ) -> list[PreparedRow]:
    """The step's part of the masked rows' attention (cached on ``batch`` for every layer)."""
    cached = batch.derived.get(_PREPARED)
    if cached is not None:
        return cached
    lens = batch.seq_lens.tolist()
    qsl = batch.query_start_loc.tolist()
    rows = []
    for r, seq_len in enumerate(lens):
        blocks = batch.block_table[r, : -(-seq_len // block_size)].long()
        j = torch.arange(seq_len)
        # a block never written is never read (its keys are masked or absent)
        home_pos = home_slots[blocks].long().clamp(min=0)[j // block_size] * block_size
        logical = batch.key_positions[r, :seq_len]
        q0, q1 = qsl[r], qsl[r + 1]
        q_index = torch.arange(seq_len - (q1 - q0), seq_len)  # each query's own key
        sink = None if batch.key_sink is None else batch.key_sink[r, :seq_len]
        isolated = None if batch.query_isolated is None else batch.query_isolated[q0:q1]
        rows.append(PreparedRow(
            queries=batch.rows[q0:q1], blocks=blocks, keys=seq_len,
            key_moves=logical.clamp(min=0) - home_pos - j % block_size,
            query_moves=batch.query_shift[q0:q1],
            mask=_mask(q_index, logical, None if batch.key_start is None
                       else batch.key_start[q0:q1], sink, isolated)))
    batch.derived[_PREPARED] = rows
    return rows


def _mask(q_index: torch.Tensor, key_positions: torch.Tensor, key_start: torch.Tensor | None,
          sink: torch.Tensor | None = None, isolated: torch.Tensor | None = None
          ) -> torch.Tensor:
    """``[q, n]``: causal, from ``key_start``, and rule 1 — a layout key (negative position) is
    seen only by its own query, a layout query sees only itself; a sink key is seen only by
    the queries inside a span (``isolated``: ``key_start`` keeps them inside their own)."""
    j = torch.arange(key_positions.numel())
    shown = key_positions >= 0  # a query whose own key is shown is no layout query
    allowed = j[None, :] <= q_index[:, None]
    if key_start is not None:
        allowed &= j[None, :] >= key_start[:, None]
    if sink is None or isolated is None:
        allowed &= shown[None, :]
    else:
        allowed &= (shown & ~sink)[None, :] | (sink[None, :] & isolated[:, None])
    allowed &= shown[q_index][:, None]
    allowed |= j[None, :] == q_index[:, None]
    return allowed


def token_rows(layout: PageLayout, pages: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys, values)`` ``[blocks * bs, heads, D]`` in token order, from a layer's pages
    ``[blocks, heads, 2 * bs, D]`` (keys then values per page, in ``layout``)."""
    blocks, heads, _, d = pages.shape
    bs = layout.block_size
    key_pages, value_pages = pages[:, :, :bs], pages[:, :, bs:]
    if layout.column_major_keys():  # the vector kernels' [D, bs] pages: a transpose
        keys = key_pages.reshape(blocks, heads, d, bs).permute(0, 3, 1, 2)
    else:
        keys = layout.plain_keys(key_pages).transpose(1, 2)
    values = layout.plain_values(value_pages).transpose(1, 2)
    return keys.reshape(-1, heads, d), values.reshape(-1, heads, d)


def attend(rows: list[PreparedRow], query: torch.Tensor, kv_cache: torch.Tensor,
           layout: PageLayout, rotate: Rotate, scale: float, output: torch.Tensor) -> None:
    """One layer: ``kv_cache`` ``[blocks, heads, 2 * bs, D]`` is its cache; writes the
    ``output`` rows of every prepared row."""
    heads = query.shape[1]
    for row in rows:
        keys, values = token_rows(layout, kv_cache.index_select(0, row.blocks))
        k = keys[: row.keys].contiguous()
        rotate(k, row.key_moves)
        q = query[row.queries]  # a fresh tensor
        rotate(q, row.query_moves)
        kv_heads, d = k.shape[1], k.shape[2]
        q = q.float().view(-1, kv_heads, heads // kv_heads, d)
        scores = torch.einsum("thgd,jhd->hgtj", q, k.float()) * scale
        probs = torch.softmax(scores.masked_fill(~row.mask, float("-inf")), dim=-1)
        out = torch.einsum("hgtj,jhd->thgd", probs, values[: row.keys].float())
        output[row.queries] = out.reshape(-1, heads, d).to(output.dtype)
