"""Rule 1 on the CPU: attention for the requests that hold layout tokens, with a key mask.

docs/design.md §2: a span request's SSEP, PDEP and PAD are attended by no query but their own
and take no RoPE position. vLLM's C++ CPU kernel attends every key of a row's range and takes
no mask, so these rows (``step_plan.MaskedBatch``) are attended here, with
``torch.nn.functional.scaled_dot_product_attention`` and a boolean mask.

Why the work is split the way it is: everything that depends only on the step — which cached
tokens each row reads, the rotation that moves each key from its home position (where the cache
holds it rotated) to its logical position, each query's move from its physical position (where
the model rotated it) to its logical one, and the mask — is the same in every layer, so
:func:`prepare` builds it once per step (the first layer) and every layer does only the
per-layer part: gather its pages, one rotation of the keys read, one attention call per row.
The arithmetic equals ``kernels.paged_attention_rope_ref`` with ``key_positions`` (keys rotated
once from home to logical, in fp32, and attention in fp32), which the tests hold the engine to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minipic.engine_ext.attention.step_plan import MaskedBatch
from minipic.kernels import apply_rotation, offset_rotation

_PREPARED = "masked_rows"  # key of the per-step preparation in MaskedBatch.derived


@dataclass
class PreparedRow:
    """One kernel row of a masked request, ready for any layer."""

    queries: torch.Tensor  # [q] int64: the row's query rows in the step
    keys: torch.Tensor  # [n] int64: where each of its keys sits among the gathered tokens
    key_cos: torch.Tensor  # [n, rot/2] fp32: home -> logical move of each key
    key_sin: torch.Tensor
    query_cos: torch.Tensor  # [q, rot/2] fp32: physical -> logical move of each query
    query_sin: torch.Tensor
    mask: torch.Tensor  # [q, n] bool: what each query sees


@dataclass
class Prepared:
    blocks: torch.Tensor  # [U] int64: the physical blocks the rows read, gathered once a layer
    rows: list[PreparedRow]


def prepare(batch: MaskedBatch, home_slots: torch.Tensor, block_size: int,
            cos_sin_cache: torch.Tensor, rotary_dim: int) -> Prepared:
    """The step's part of the masked rows' attention (cached on ``batch`` for every layer)."""
    cached = batch.derived.get(_PREPARED)
    if cached is not None:
        return cached
    lens = batch.seq_lens.tolist()
    qsl = batch.query_start_loc.tolist()
    width = -(-max(lens) // block_size)
    blocks, index = torch.unique(batch.block_table[:, :width].long(), return_inverse=True)
    home = home_slots[blocks].long().clamp(min=0)  # a block never written is never read
    rows = []
    for r, seq_len in enumerate(lens):
        j = torch.arange(seq_len)
        slot = j // block_size
        page = index[r, slot]
        home_pos = home[page] * block_size + j % block_size
        logical = batch.key_positions[r, :seq_len]
        key_cos, key_sin = offset_rotation(cos_sin_cache, logical.clamp(min=0) - home_pos,
                                           rotary_dim)
        q0, q1 = qsl[r], qsl[r + 1]
        shift = batch.query_shift[q0:q1]
        query_cos, query_sin = offset_rotation(cos_sin_cache, shift, rotary_dim)
        q_index = torch.arange(seq_len - (q1 - q0), seq_len)  # index of each query's own key
        rows.append(PreparedRow(
            queries=batch.rows[q0:q1], keys=page * block_size + j % block_size,
            key_cos=key_cos, key_sin=key_sin, query_cos=query_cos, query_sin=query_sin,
            mask=_mask(q_index, logical, None if batch.key_start is None
                       else batch.key_start[q0:q1])))
    prepared = Prepared(blocks=blocks, rows=rows)
    batch.derived[_PREPARED] = prepared
    return prepared


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


def attend(prepared: Prepared, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           rotary_dim: int, is_neox: bool, scale: float, output: torch.Tensor) -> None:
    """One layer: ``keys`` / ``values`` ``[U * block_size, kv_heads, D]`` are the gathered
    blocks' tokens (keys as cached, rotated at home); ``output`` rows of every prepared row."""
    heads = query.shape[1]
    for row in prepared.rows:
        k = apply_rotation(keys[row.keys], row.key_cos, row.key_sin, rotary_dim, is_neox)
        q = apply_rotation(query[row.queries], row.query_cos, row.query_sin, rotary_dim,
                           is_neox)
        v = values[row.keys].float()
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=row.mask,
            scale=scale, enable_gqa=heads != k.shape[1])
        output[row.queries] = out.transpose(0, 1).to(output.dtype)
