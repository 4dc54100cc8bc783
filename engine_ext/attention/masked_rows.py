"""Rule 1 on the CPU: attention for the requests that hold layout tokens, with a key mask.

docs/design.md §2: a span request's SSEP, PDEP and PAD are attended by no query but their own
and take no RoPE position. vLLM's C++ CPU kernel attends every key of a row's range and takes
no mask, so these rows (``step_plan.MaskedBatch``) are attended here, with
``torch.nn.functional.scaled_dot_product_attention`` and a boolean mask.

Why the work is split the way it is: everything that depends only on the step — where each key
and value a row reads sits in a layer's cache (one flat index per element, through the page
layout vLLM's writer uses, ``cpu_kv_layout``), the move of each key from its home position (where
the cache holds it rotated) to its logical one, each query's move from the physical position the
model rotated it at, and the mask — is the same in every layer, so :func:`prepare` builds it
once per step (the first layer), and a layer does only its own part: one gather of its keys and
values, one call of the model's rotary op on each (moves by an offset table, as the key shadow
does, ``cpu_backend.move_keys``), one attention call per row. The arithmetic is
``kernels.paged_attention_rope_ref`` with ``key_positions``, which the tests hold the engine to.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

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
    key_index: torch.Tensor  # [n, heads, D] int64: each key element in a layer's flat cache
    value_index: torch.Tensor  # [n, heads, D] int64: each value element
    key_moves: torch.Tensor  # [n] int64: logical minus home position of each key
    query_moves: torch.Tensor  # [q] int64: logical minus physical position of each query
    mask: torch.Tensor  # [q, n] bool: what each query sees


def prepare(batch: MaskedBatch, home_slots: torch.Tensor, layout: PageLayout,
            num_kv_heads: int) -> list[PreparedRow]:
    """The step's part of the masked rows' attention (cached on ``batch`` for every layer).

    A layer's cache is ``[blocks, kv_heads, 2 * block_size, D]`` contiguous: per (block, head) a
    page of ``block_size * D`` keys, then as many values, each in ``layout``'s order."""
    cached = batch.derived.get(_PREPARED)
    if cached is not None:
        return cached
    bs, d = layout.block_size, layout.head_size
    page = 2 * bs * d
    key_at = layout.key_gather.view(bs, d).long()  # [o, dim] -> place in the key half-page
    value_at = layout.value_gather.view(bs, d).long() + bs * d
    heads = torch.arange(num_kv_heads).view(1, -1, 1) * page
    lens = batch.seq_lens.tolist()
    qsl = batch.query_start_loc.tolist()
    rows = []
    for r, seq_len in enumerate(lens):
        j = torch.arange(seq_len)
        blocks = batch.block_table[r].long()[j // bs]
        offset = j % bs
        base = (blocks * num_kv_heads * page).view(-1, 1, 1) + heads
        home_pos = home_slots[blocks].long().clamp(min=0) * bs + offset  # unwritten: unread
        logical = batch.key_positions[r, :seq_len]
        q0, q1 = qsl[r], qsl[r + 1]
        q_index = torch.arange(seq_len - (q1 - q0), seq_len)  # each query's own key
        rows.append(PreparedRow(
            queries=batch.rows[q0:q1], key_index=base + key_at[offset].unsqueeze(1),
            value_index=base + value_at[offset].unsqueeze(1),
            key_moves=logical.clamp(min=0) - home_pos, query_moves=batch.query_shift[q0:q1],
            mask=_mask(q_index, logical, None if batch.key_start is None
                       else batch.key_start[q0:q1])))
    batch.derived[_PREPARED] = rows
    return rows


def _mask(q_index: torch.Tensor, key_positions: torch.Tensor,
          key_start: torch.Tensor | None) -> torch.Tensor:
    """``[q, n]``: causal, from ``key_start``, and rule 1 — a layout key (negative position) is
    seen only by its own query, a layout query sees only itself."""
    j = torch.arange(key_positions.numel())
    real = key_positions >= 0
    allowed = j[None, :] <= q_index[:, None]
    if key_start is not None:
        allowed &= j[None, :] >= key_start[:, None]
    allowed &= real[None, :] & real[q_index][:, None]
    allowed |= j[None, :] == q_index[:, None]
    return allowed


def attend(rows: list[PreparedRow], query: torch.Tensor, kv_flat: torch.Tensor,
           rotate: Rotate, scale: float, output: torch.Tensor) -> None:
    """One layer: ``kv_flat`` is its cache, flat; ``output`` rows of every prepared row."""
    heads = query.shape[1]
    for row in rows:
        k = kv_flat[row.key_index]  # [n, kv_heads, D], a fresh tensor
        rotate(k, row.key_moves)
        q = query[row.queries]  # a fresh tensor
        rotate(q, row.query_moves)
        v = kv_flat[row.value_index]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=row.mask,
            scale=scale, enable_gqa=heads != k.shape[1])
        output[row.queries] = out.transpose(0, 1).to(output.dtype)
