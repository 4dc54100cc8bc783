"""Position-free attention backend for CUDA: unrotated keys, RoPE applied in the Triton kernel.

Registered as vLLM's ``CUSTOM`` backend by ``engine_ext.attention.cpu_backend.install``; a GPU
engine selects it with ``attention_config={"backend": "CUSTOM"}`` (``--attention-backend
CUSTOM``). Without that selection CUDA picks FLASH_ATTN etc.,
``engine_ext.attention.unrotated_keys`` sees a backend that is not position-free and leaves keys
rotated (stock behaviour, no span reuse at new offsets).

Where RoPE is applied: queries by the model (``QueryOnlyRotary``); keys inside
``kernels.triton_paged_attention.paged_attention_rope_triton``, which rotates each key tile by
the keys' logical positions (key ``j`` of a request at position ``j``) with the model's own
``cos_sin_cache`` right after loading it. The cache is written unrotated and never rewritten.

Cache layout: vLLM's logical per-layer view ``[num_blocks, kv_heads, block_size, 2 * D]`` with
K~ in ``[..., :D]`` and V in ``[..., D:]``; the kernel reads both through strided
``[num_blocks, block_size, kv_heads, D]`` views, so any physical KV layout works.

This module must import on CPU-only machines (the plugin imports its parent module everywhere);
Triton is imported only on the first forward. Its write/view/launch glue is tested on CPU through
Triton's interpreter (``tests/engine/test_position_free.py``); it has not run on a GPU or inside a
GPU engine yet.
Span isolation and rule 1: the builder asks ``engine_ext.attention.span_isolation`` for the
step's span view (one host computation per step): each query token's first visible key
(``key_start``; the kernel masks keys before it) and, for requests that hold layout tokens, each
key's logical position (the kernel rotates keys there and hides layout keys from every other
query) and each query's shift from the physical position the model rotated it at (applied here
before the kernel). When spans carry their sink (a private copy of the model's opening), the
view also marks the sink keys and the queries that may read them (those inside a span); the
kernel hides the sink from every other query. A request whose step computes several holes
(``engine_ext/holes/worker_positions.py``) becomes one kernel row per hole (:func:`hole_rows`),
each ending at its hole's last token.

Compilation and CUDA graphs. torch.compile is safe: minipic's settings and a hash of its engine
code travel in vLLM's ``additional_config``, which is part of vLLM's compile-cache key
(``span_contract.engine_config``). CUDA graphs: the builder declares no support (``NEVER``), so
vLLM captures piecewise graphs around attention and attention runs eagerly between them — the
model's linear layers, norms and MLPs still replay from graphs. Declaring ``UNIFORM_BATCH`` /
``ALWAYS`` would need: (1) persistent device buffers for every per-step tensor the kernel reads
(``key_start`` sized to the largest captured batch, filled in place; today it is allocated per
step), (2) a launch grid independent of the step's query lengths (a fixed grid over the
captured token count with early exit, instead of ``num_tokens // block_q + num_reqs``), and
(3) no host sync in ``build`` (``key_start`` is computed on the host from the runner's token ids;
under capture it must come from a pre-filled buffer). Not done: no GPU has run this backend yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)


class MinipicCudaAttentionBackend(AttentionBackend):
    """CUSTOM backend: paged attention with RoPE on keys inside the kernel."""

    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @staticmethod
    def get_impl_cls() -> type[MinipicCudaAttentionImpl]:
        return MinipicCudaAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[MinipicCudaMetadataBuilder]:
        return MinipicCudaMetadataBuilder

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


@dataclass
class MinipicCudaMetadata:
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool = True
    key_start: torch.Tensor | None = None  # [num_tokens] span isolation (None: causal only)
    key_positions: torch.Tensor | None = None  # [rows, W] rule 1 (None: no layout token)
    masked_rows: torch.Tensor | None = None  # [T] query rows of requests with layout tokens
    query_shift: torch.Tensor | None = None  # [T] logical - physical position of those rows
    key_sink: torch.Tensor | None = None  # [rows, W] sink keys (None: no sink in the step)
    query_isolated: torch.Tensor | None = None  # [num_tokens] queries that may read a sink


class MinipicCudaMetadataBuilder(AttentionMetadataBuilder[MinipicCudaMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> MinipicCudaMetadata:
        cm = common_attn_metadata
        if not isinstance(cm.causal, bool):
            raise NotImplementedError("minipic CUSTOM backend: per-request causality")
        from minipic.engine_ext.attention.span_isolation import step_positions, step_span_view

        # The span view needs host copies of the step's lengths (one sync per step, shared by
        # all layers); the result goes to the device once.
        qsl_cpu = cm.query_start_loc_cpu[: cm.num_reqs + 1]
        seq_lens_cpu = cm.seq_lens[: cm.num_reqs].cpu()
        view = step_span_view(qsl_cpu, seq_lens_cpu, self.kv_cache_spec.block_size)
        key_start = view.key_start
        query_start_loc = cm.query_start_loc[: cm.num_reqs + 1]
        seq_lens = cm.seq_lens[: cm.num_reqs]
        block_table = cm.block_table_tensor[: cm.num_reqs]
        max_query_len = cm.max_query_len
        key_positions = masked_rows = query_shift = key_sink = query_isolated = None
        if view.any_masked:
            assert view.masked is not None and view.key_positions is not None
            assert view.query_shift is not None
            width = max(int(seq_lens_cpu.max()), view.key_positions.shape[1])
            key_positions = torch.arange(width).repeat(cm.num_reqs, 1)
            key_positions[view.masked, : view.key_positions.shape[1]] = (
                view.key_positions[view.masked])
            if view.key_sink is not None:  # a plain request's row holds no sink
                assert view.query_isolated is not None
                key_sink = torch.zeros(cm.num_reqs, width, dtype=torch.bool)
                key_sink[view.masked, : view.key_sink.shape[1]] = view.key_sink[view.masked]
                query_isolated = view.query_isolated.to(self.device)
            masked_rows = (view.query_shift != 0).nonzero().flatten()
            query_shift = view.query_shift[masked_rows].to(self.device)
            masked_rows = masked_rows.to(self.device)
        positions = step_positions(qsl_cpu, seq_lens_cpu)
        if positions is not None:  # several holes of a request: one kernel row per hole
            query_start_loc, seq_lens, block_table, max_query_len, rows_of = hole_rows(
                qsl_cpu, positions, block_table, query_start_loc.dtype, seq_lens.dtype)
            if key_positions is not None:
                key_positions = key_positions[rows_of]
            if key_sink is not None:  # query_isolated, per query row, needs no reindexing
                key_sink = key_sink[rows_of]
        return MinipicCudaMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            max_query_len=max_query_len,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            key_start=None if key_start is None else key_start.to(self.device),
            key_positions=None if key_positions is None else key_positions.to(self.device),
            masked_rows=masked_rows,
            query_shift=query_shift,
            key_sink=None if key_sink is None else key_sink.to(self.device),
            query_isolated=query_isolated,
            block_table=block_table,
            slot_mapping=cm.slot_mapping,
            causal=cm.causal,
        )


def hole_rows(qsl_cpu: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
              qsl_dtype: torch.dtype, lens_dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Kernel rows of a step in which some request computes several holes: one row per hole
    (``engine_ext/step_plan.gap_rows``), each with its request's table, on the table's device.
    Returns ``(query_start_loc, seq_lens, block_table, max_query_len, request of each row)``
    (the last on the host)."""
    from minipic.engine_ext.attention.step_plan import gap_rows

    row_qsl, row_lens, rows_of = gap_rows(qsl_cpu, positions)
    device = block_table.device
    return (row_qsl.to(device, dtype=qsl_dtype), row_lens.to(device, dtype=lens_dtype),
            block_table[rows_of.to(device)], int((row_qsl[1:] - row_qsl[:-1]).max()), rows_of)


class MinipicCudaAttentionImpl(AttentionImpl[MinipicCudaMetadata]):
    """Writes K~ / V into the paged cache, attends with RoPE applied to keys in the kernel."""

    minipic_rope: torch.nn.Module | None = None
    position_free_capable: ClassVar[bool] = True

    def __init__(self, num_heads: int, head_size: int, scale: float,
                 num_kv_heads: int | None = None, alibi_slopes: list[float] | None = None,
                 sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, **extra: Any) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.unsupported = [
            what for what, bad in (
                ("ALiBi", alibi_slopes is not None),
                ("sliding window", sliding_window is not None),
                ("logits soft-cap", bool(logits_soft_cap)),
                ("attention sinks", extra.get("sinks") is not None),
                (f"kv_cache_dtype={kv_cache_dtype}", kv_cache_dtype != "auto"),
                ("cross-layer KV sharing", kv_sharing_target_layer_name is not None),
                (f"attention type {attn_type}", attn_type != AttentionType.DECODER),
            ) if bad
        ]
        if self.unsupported:
            raise NotImplementedError(
                f"minipic CUSTOM backend does not support {', '.join(self.unsupported)}"
            )

    def rope_unsupported_reason(self, rope: torch.nn.Module) -> str | None:
        if getattr(rope, "head_size", self.head_size) != self.head_size:
            return f"rotary head_size {rope.head_size} != {self.head_size}"
        return None

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: MinipicCudaMetadata | None,
                output: torch.Tensor, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if attn_metadata is None:  # profiling run
            return output
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported")
        rope = self.minipic_rope
        if rope is None:
            raise RuntimeError(
                "minipic CUSTOM backend selected but this layer's keys are not unrotated "
                "(model not supported by engine_ext.attention.unrotated_keys); use the stock "
                "backend"
            )
        from minipic.kernels.triton_paged_attention import paged_attention_rope_triton

        n = attn_metadata.num_actual_tokens
        d = self.head_size
        if key is not None and value is not None:
            slots = attn_metadata.slot_mapping[:n].long()
            keep = slots >= 0
            block_size = kv_cache.shape[2]
            blk = torch.div(slots[keep], block_size, rounding_mode="floor")
            off = slots[keep] - blk * block_size
            kv_cache[blk, :, off, :d] = key[:n][keep].to(kv_cache.dtype)
            kv_cache[blk, :, off, d:] = value[:n][keep].to(kv_cache.dtype)
        key_cache = kv_cache[..., :d].transpose(1, 2)  # [blocks, bs, kv_heads, D], strided
        value_cache = kv_cache[..., d:].transpose(1, 2)
        query = query[:n]
        if attn_metadata.masked_rows is not None:  # rule 1: queries at their logical positions
            from minipic.kernels import rotate_by_offset

            rows = attn_metadata.masked_rows
            query = query.clone()
            query[rows] = rotate_by_offset(query[rows], attn_metadata.query_shift,
                                           rope.cos_sin_cache, rope.rotary_dim,
                                           rope.is_neox_style)
        paged_attention_rope_triton(
            query, key_cache, value_cache, attn_metadata.block_table,
            attn_metadata.seq_lens, attn_metadata.query_start_loc, rope.cos_sin_cache,
            rope.rotary_dim, rope.is_neox_style, self.scale, attn_metadata.causal,
            out=output[:n], max_query_len=attn_metadata.max_query_len,
            key_start=attn_metadata.key_start, key_positions=attn_metadata.key_positions,
            key_sink=attn_metadata.key_sink, query_isolated=attn_metadata.query_isolated,
        )
        return output
