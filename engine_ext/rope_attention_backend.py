"""Position-free KV cache for vLLM on CPU: unrotated keys in the cache, RoPE inside attention.

**Where RoPE is applied** (DESIGN.md section 1):

* queries: by the model, as in stock vLLM (``engine_ext/unrotated_keys.py`` swaps each supported
  attention module's ``rotary_emb`` for a query-only wrapper, so ``k`` reaches ``self.attn``
  *unrotated*);
* keys: here, in :meth:`MinipicCPUAttentionImpl.forward`, always with the model's own rotary
  module (``self.minipic_rope``: its ``cos_sin_cache``, ``rotary_dim``, neox/gptj layout, llama3 /
  yarn / linear scaling) and always at the key's *logical* position in the current request:
  key ``j`` of a request sits at block-table slot ``j // block_size``, so it is rotated by ``j``,
  whatever physical block holds it. Query ``t`` is at ``seq_len - query_len + t``.

**Cache layout.** ``customize_spec`` widens each token's per-head cell from ``2*D`` to ``3*D``
(vLLM then sizes the pool accordingly, so this costs 1.5x KV memory per block, inside the
``VLLM_CPU_KVCACHE_SPACE`` budget). Each (block, kv head) page of ``3 * block_size * D``
elements holds three regions::

    [0] K~  unrotated keys, plain [block_size, D]           <- the position-free content
    [1] V   values, in the layout of vLLM's C++ CPU kernel  (written by cpu_attn_reshape_and_cache)
    [2] K_h keys rotated at the position they were *written* at ("home" position), C++ layout

Region [2] is a write-time companion, never rewritten: a block filled by a request at block-table
slot ``s`` holds ``R_{s*bs+o} k~`` there, which is *exactly* what stock vLLM would have cached.
Reading a block at its home slot (every read when PIC is off: stock prefix hashing only shares
a block at the slot it was computed at) therefore runs vLLM's own C++ kernel
(``cpu_attention_with_kv_cache``) on regions [2]/[1] with no extra work -- bit-identical to stock.
A request that reads some block at another slot (a span reused at a new offset) is recomputed
per step from region [0]: its keys are gathered, rotated by ``arange(seq_len)`` into a transient
scratch and attended with the same C++ kernel. Nothing shared is ever copied or re-rotated in the
cache, so one physical block serves any number of requests at any offsets in the same batch.
Which physical block sits at which home slot is tracked per KV-cache group by the metadata
builder (``_HomeSlots``), once per step.

**Why this design.** Measured on the 2-core development machine (shared; 1 thread, fp32,
SmolLM2-135M attention shapes: 9 query / 3 KV heads, D=64, block 32), one layer's write + attention
in ms, min over 5-15 runs, every block read at its home slot (PIC off)::

    case                              stock C++   auto   scratch   torch
    decode 8 x 512 ctx                   0.20     0.28     9.85     6.63
    decode 32 x 256 ctx                  0.45     0.54    36.5     13.5
    prefill 1 x 512                      4.02     4.51     9.73    16.5
    2 prefills x 256 + 6 decode x 512    2.27     2.69     9.65    12.3

``torch`` is the pure-torch backend (``kernels.paged_attention_rope_ref`` per request, keys
rotated on every read); ``scratch`` rotates every request's keys into a scratch cache per step and
calls vLLM's C++ kernel; ``auto`` is this module's default (C++ kernel on region [2], scratch only
for off-home requests). Both rotate-on-every-read options cost 3-80x the stock kernel, and a
SmolLM2 step runs 30 layers, so they would multiply decode time; ``auto`` adds 0.1-0.5 ms per
layer (the extra writes and one rotary call). Whole engine, SmolLM2 fp32, PIC off, minipic /
stock wall time (``benchmarks/pic_overhead.py``, worker pinned to the quieter core; an A/A run of
two stock engines gave 1.00 / 1.01)::

    path      prefill 2 x 384   decode 8 x 64 + 64 tokens   JSON in results/
    auto          1.00              0.97 (rounds 0.92, 1.02)    pic_overhead.json
    scratch       1.09              1.27                        pic_overhead_alternatives.json
    torch         1.18              1.7 - 2.9                   pic_overhead_alternatives.json

(Contexts there are short; the per-layer table shows the gap growing with context length.)
``MINIPIC_CPU_ATTN=scratch|torch`` forces one of the alternatives for every request.

**Processes.** ``install()`` runs from the plugin in every vLLM process; it only registers class
paths (``CPU_ATTN`` -> this module, ``CUSTOM`` -> ``engine_ext.cuda_backend``) and wraps the model
loader (``engine_ext.unrotated_keys``). Both take effect only where a model is built: the worker.

Limitations: decoder self-attention only (other attention types and layers without a supported
rotary module get stock behaviour on regions [2]/[1]); no sliding window, ALiBi, sinks, fp8 KV
cache, MRoPE, DCP/PCP; speculative decoding positions are not verified.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from minipic.span_config import SpanConfig

BACKEND_PATH = "engine_ext.rope_attention_backend.MinipicCPUAttentionBackend"
CUDA_BACKEND_PATH = "engine_ext.cuda_backend.MinipicCudaAttentionBackend"
# auto: C++ kernel on home-rotated keys + scratch for requests reading blocks off their home
# slot. scratch / torch: every request through that path (the measured alternatives).
ATTN_PATH_ENV = "MINIPIC_CPU_ATTN"
ATTN_PATHS = ("auto", "scratch", "torch")
# K/V-sized regions per (block, kv head) page: K~, V, K rotated at home (module docstring).
NUM_REGIONS = 3

_STATE: dict[str, Any] = {"installed": False}


def install(config: SpanConfig) -> None:
    """Register the position-free backends and the unrotated-keys model hook (idempotent).

    Called by ``engine_ext.plugin.register`` in every vLLM process. Registration only stores
    class paths, and the model hook only fires when a model is constructed, so processes that
    never build a model (API server, EngineCore) are unaffected. ``config`` is accepted for the
    plugin's uniform ``install(config)`` call; the backend takes the block size from vLLM's KV
    cache spec, and the span ids play no part in attention.
    """
    if _STATE["installed"]:
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from engine_ext import unrotated_keys

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
    register_backend(AttentionBackendEnum.CUSTOM, CUDA_BACKEND_PATH)
    unrotated_keys.install()
    _STATE["installed"] = True


def attn_path() -> str:
    """The CPU attention path selected by ``MINIPIC_CPU_ATTN`` (default ``auto``)."""
    path = os.environ.get(ATTN_PATH_ENV, "auto").strip().lower() or "auto"
    if path not in ATTN_PATHS:
        raise ValueError(f"{ATTN_PATH_ENV}={path!r}; expected one of {ATTN_PATHS}")
    return path


# ------------------------------------------------------------------------------------------------
# vLLM classes. Imported here (not lazily) because vLLM resolves BACKEND_PATH by importing this
# module in the worker; in other processes the import costs ~0.3 s once vLLM itself is loaded.

from vllm import _custom_ops as ops  # noqa: E402
from vllm import envs  # noqa: E402
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import (  # noqa: E402
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import (  # noqa: E402
    AttentionSpec,
    FullAttentionSpec,
    KVQuantMode,
)

from kernels import paged_attention_rope_ref  # noqa: E402


def position_free_spec(spec: AttentionSpec) -> bool:
    """Whether a layer's spec gets the 3-region page (plain decoder full attention only)."""
    return (
        type(spec) is FullAttentionSpec
        and spec.sliding_window is None
        and spec.attention_chunk_size is None
        and not spec.non_causal
        and spec.kv_quant_mode == KVQuantMode.NONE
        and spec.state_content_bytes is None
        and spec.head_size == spec.head_size_v
        and spec.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


def has_position_free_pages(spec: Any) -> bool:
    """Whether ``customize_spec`` gave this (group's) spec the 3-region page."""
    if type(spec) is not FullAttentionSpec or spec.state_content_bytes is None:
        return False
    itemsize = torch.tensor([], dtype=spec.dtype).element_size()
    return spec.state_content_bytes == NUM_REGIONS * spec.head_size * itemsize


class MinipicCPUAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU attention with a position-free (unrotated-key) KV cache.

    ``get_name()`` stays ``"CPU_ATTN"``: ``Attention.__init__`` maps the name back to the enum
    member, and the CPU platform only ever selects CPU_ATTN, whose path we override.
    """

    # The write needs the step's key positions, which live in our metadata; doing it inside
    # forward() avoids a forward-context lookup per layer.
    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls() -> type[MinipicCPUAttentionImpl]:
        return MinipicCPUAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[MinipicCPUAttentionMetadataBuilder]:
        return MinipicCPUAttentionMetadataBuilder

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """Make room for the third region: ``3 * head_size`` elements per (token, kv head).

        Only when the model actually stores unrotated keys (some module was converted when it
        was built, which precedes this call): an unsupported model keeps stock pages and memory.
        """
        from engine_ext import unrotated_keys

        spec = super().customize_spec(spec)
        if not position_free_spec(spec) or unrotated_keys.converted_count() == 0:
            return spec
        itemsize = torch.tensor([], dtype=spec.dtype).element_size()
        return dataclasses.replace(
            spec, state_content_bytes=NUM_REGIONS * spec.head_size * itemsize
        )


@dataclass
class OffHomeBatch:
    """The requests of one step that read some block away from its home slot.

    They are attended from unrotated keys (region 0) rotated by logical position into a
    transient scratch cache; built once per step by the metadata builder, used by every layer.
    """

    rows: torch.Tensor  # [T] int64: query rows of these requests in the step's batch
    query_start_loc: torch.Tensor  # [S + 1] int32, local
    seq_lens: torch.Tensor  # [S] int32
    blocks: torch.Tensor  # [P] int64: physical blocks, request by request, in table order
    block_table: torch.Tensor  # [S, max_blocks] int32 into the scratch (0..P-1)
    token_slots: torch.Tensor  # [K] int64: scratch slot of each key (skips block tails)
    key_positions: torch.Tensor  # [K] int64: logical position of each key
    scheduler_metadata: torch.Tensor | None  # C++ kernel work split for this sub-batch
    global_block_table: torch.Tensor  # [S, max_blocks] int32, physical (torch path)


@dataclass
class MinipicCPUAttentionMetadata(CPUAttentionMetadata):
    plan: StepPlan | None = None  # None: layers of this group are not position-free


class _HomeSlots:
    """Block-table slot at which each physical block's region [2] was rotated (-1: never).

    One instance per KV-cache group: all layers of a group share block ids, and every layer
    writes the same tokens in the same step, so one table describes region [2] of all of them.
    """

    def __init__(self, num_blocks: int) -> None:
        self.slot = torch.full((max(num_blocks, 1),), -1, dtype=torch.int32)

    def _ensure(self, max_block: int) -> None:
        if max_block >= self.slot.numel():
            grown = torch.full((max(max_block + 1, 2 * self.slot.numel()),), -1,
                               dtype=torch.int32)
            grown[: self.slot.numel()] = self.slot
            self.slot = grown

    def record_writes(self, blocks: torch.Tensor, positions: torch.Tensor,
                      block_size: int) -> None:
        """A token at logical ``pos`` written into ``block`` puts it at table slot ``pos // bs``.

        All tokens of a block are written by one request at one table slot (only full blocks
        are shared), so the last write of a step describes the whole block.
        """
        if blocks.numel() == 0:
            return
        self._ensure(int(blocks.max()))
        self.slot[blocks] = torch.div(positions, block_size, rounding_mode="floor").to(
            torch.int32
        )

    def requests_off_home(self, block_table: torch.Tensor, seq_lens: torch.Tensor,
                          block_size: int) -> torch.Tensor:
        """Bool ``[num_reqs]``: request reads at least one block away from its home slot."""
        num_blocks = torch.div(seq_lens + block_size - 1, block_size, rounding_mode="floor")
        width = int(num_blocks.max()) if num_blocks.numel() else 0
        if width == 0:
            return torch.zeros(seq_lens.shape, dtype=torch.bool)
        table = block_table[:, :width].long()
        self._ensure(int(table.max()))
        col = torch.arange(width, dtype=torch.int32)
        at_home = self.slot[table] == col
        used = col.unsqueeze(0) < num_blocks.unsqueeze(1)
        return (used & ~at_home).any(dim=1)


@dataclass
class StepPlan:
    """What the position-free layers need per step, beyond vLLM's CPU metadata."""

    positions: torch.Tensor  # [num_tokens] int64 logical positions of the new tokens
    write_rows: torch.Tensor | None  # rows that have a cache slot (None: all rows)
    write_slots: torch.Tensor  # [W] int64 cache slots of those rows
    write_blocks: torch.Tensor  # [W] int64 physical block of each slot
    write_offsets: torch.Tensor  # [W] int64 offset in block
    write_positions: torch.Tensor  # [W] int64 logical positions of those rows
    off_home: OffHomeBatch | None  # requests that need RoPE-in-attention from region [0]


def plan_step(home: _HomeSlots, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
              block_table: torch.Tensor, slot_mapping: torch.Tensor, block_size: int,
              path: str, scheduler_metadata: Callable[[torch.Tensor, torch.Tensor],
                                                      torch.Tensor] | None) -> StepPlan:
    """Positions, home-slot bookkeeping and the off-home sub-batch of one step.

    ``query_start_loc`` / ``seq_lens`` / ``block_table`` cover exactly the step's requests and
    ``slot_mapping`` its tokens. ``scheduler_metadata(qsl, seq_lens)`` builds the C++ kernel's
    work split for the sub-batch (None for the pure-torch path).
    """
    num_reqs = seq_lens.numel()
    num_tokens = slot_mapping.numel()
    qsl = query_start_loc.long()
    lens = seq_lens.long()
    q_lens = qsl[1:] - qsl[:-1]
    # Logical position of each new token: seq_len - query_len + t (DESIGN.md section 1).
    req_of_token = torch.repeat_interleave(torch.arange(num_reqs), q_lens,
                                           output_size=num_tokens)
    positions = (lens - q_lens - qsl[:-1])[req_of_token] + torch.arange(num_tokens)
    slots = slot_mapping.long()
    write_rows, write_positions = None, positions
    if bool((slots < 0).any()):  # tokens without a cache slot are not stored
        write_rows = (slots >= 0).nonzero().flatten()
        slots, write_positions = slots[write_rows], positions[write_rows]
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    home.record_writes(blocks, write_positions, block_size)
    if path == "auto":
        off = home.requests_off_home(block_table, lens, block_size)
    else:
        off = torch.ones(num_reqs, dtype=torch.bool)
    off_home = None
    if bool(off.any()):
        off_home = _off_home_batch(off.nonzero().flatten().tolist(), qsl, lens, block_table,
                                   block_size, scheduler_metadata)
    return StepPlan(positions=positions, write_rows=write_rows, write_slots=slots,
                    write_blocks=blocks, write_offsets=slots - blocks * block_size,
                    write_positions=write_positions, off_home=off_home)


def _off_home_batch(reqs: list[int], qsl: torch.Tensor, seq_lens: torch.Tensor,
                    block_table: torch.Tensor, block_size: int,
                    scheduler_metadata: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                    | None) -> OffHomeBatch:
    starts, ends, lens = qsl[:-1].tolist(), qsl[1:].tolist(), seq_lens.tolist()
    rows, blocks, slots, positions = [], [], [], []
    local_qsl, local_tables, n_blocks = [0], [], 0
    for i in reqs:
        n = -(-lens[i] // block_size)
        rows.append(torch.arange(starts[i], ends[i]))
        local_qsl.append(local_qsl[-1] + ends[i] - starts[i])
        blocks.append(block_table[i, :n].long())
        local_tables.append(torch.arange(n_blocks, n_blocks + n, dtype=torch.int32))
        slots.append(torch.arange(lens[i]) + n_blocks * block_size)
        positions.append(torch.arange(lens[i]))
        n_blocks += n
    table = torch.zeros(len(reqs), max(t.numel() for t in local_tables), dtype=torch.int32)
    for r, t in enumerate(local_tables):
        table[r, : t.numel()] = t
    sub_seq_lens = seq_lens[reqs].to(torch.int32)
    sub_qsl = torch.tensor(local_qsl, dtype=torch.int32)
    return OffHomeBatch(
        rows=torch.cat(rows), query_start_loc=sub_qsl, seq_lens=sub_seq_lens,
        blocks=torch.cat(blocks), block_table=table, token_slots=torch.cat(slots),
        key_positions=torch.cat(positions),
        scheduler_metadata=scheduler_metadata(sub_qsl, sub_seq_lens)
        if scheduler_metadata else None,
        global_block_table=block_table[reqs],
    )


class MinipicCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """Stock CPU metadata plus the step plan (positions, off-home sub-batch)."""

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: Any,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.position_free = has_position_free_pages(kv_cache_spec)
        self.path = attn_path()
        self.home = _HomeSlots(vllm_config.cache_config.num_gpu_blocks or 0)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> MinipicCPUAttentionMetadata:
        base = super().build(common_prefix_len, common_attn_metadata, fast_build)
        md = MinipicCPUAttentionMetadata(
            **{f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        )
        if not self.position_free or self.is_cross_attention or self.is_encoder_only_attention:
            return md
        cm = common_attn_metadata
        plan = plan_step(
            self.home, cm.query_start_loc[: cm.num_reqs + 1], cm.seq_lens[: cm.num_reqs],
            cm.block_table_tensor[: cm.num_reqs], cm.slot_mapping[: cm.num_actual_tokens],
            self.block_size, self.path,
            None if self.path == "torch" else functools.partial(self._schedule, md.causal),
        )
        md.plan = plan
        return md

    def _schedule(self, causal: bool, qsl: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        return ops.cpu_attn_get_scheduler_metadata(
            num_reqs=seq_lens.numel(), num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, seq_lens=seq_lens, dtype=self.dtype, query_start_loc=qsl,
            causal=causal, sliding_window_size=-1, isa=self.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, kv_cache_dtype=self.kv_cache_dtype,
        )


class MinipicCPUAttentionImpl(CPUAttentionBackendImpl):
    """Writes unrotated keys, rotates them by logical position when attention reads them.

    ``minipic_rope`` is set by ``engine_ext.unrotated_keys`` to the model's own rotary module
    once it has made that layer's keys arrive unrotated; while it is None (unsupported model or
    layer) the layer behaves exactly like stock vLLM, using regions [2]/[1] only.
    """

    minipic_rope: torch.nn.Module | None = None
    position_free_capable: ClassVar[bool] = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.path = attn_path()

    def rope_unsupported_reason(self, rope: torch.nn.Module) -> str | None:
        """Why this layer cannot take unrotated keys with ``rope`` (None: it can)."""
        if self.attn_type != AttentionType.DECODER:
            return f"attention type {self.attn_type}"
        if self.sliding_window != -1:
            return "sliding window (early blocks are dropped; not supported)"
        if self.alibi_slopes is not None or self.sinks is not None:
            return "ALiBi / attention sinks"
        if self.kv_cache_dtype != "auto":
            return f"kv_cache_dtype={self.kv_cache_dtype}"
        if self.kv_sharing_target_layer_name is not None:
            return "cross-layer KV sharing"
        if self.logits_soft_cap and self.path == "torch":
            return "logits soft-cap with MINIPIC_CPU_ATTN=torch"
        if getattr(rope, "head_size", self.head_size) != self.head_size:
            return f"rotary head_size {rope.head_size} != {self.head_size}"
        return None

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: MinipicCPUAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if attn_metadata is None:  # profiling / warm-up run
            return output
        if kv_cache.shape[-1] != NUM_REGIONS * self.head_size:
            # Not a position-free page (non-decoder layer, sliding window...): stock path.
            if key is not None and value is not None:
                super().do_kv_cache_update(layer, key, value, kv_cache,
                                           attn_metadata.slot_mapping)
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported")

        num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
        regions = kv_cache.view(num_blocks, num_kv_heads, NUM_REGIONS, block_size,
                                self.head_size)
        k_unrot, v_cache, k_home = regions.unbind(2)  # each [blocks, kv_heads, bs, D]
        rope = self.minipic_rope
        path = self.path if rope is not None else "auto"
        n = attn_metadata.num_actual_tokens
        plan = attn_metadata.plan
        assert plan is not None, "position-free page without a step plan"

        if key is not None and value is not None:
            self._write(layer, key[:n], value[:n], k_unrot, v_cache, k_home, plan, rope, path)

        if path == "torch":
            return self._attend_torch(query, k_unrot, v_cache, plan, attn_metadata.causal,
                                      rope, output)
        # Every request, with keys rotated at their home positions: what stock vLLM computes.
        ops.cpu_attention_with_kv_cache(
            query=query[:n], key_cache=k_home, value_cache=v_cache, output=output[:n],
            query_start_loc=attn_metadata.query_start_loc, seq_lens=attn_metadata.seq_lens,
            scale=self.scale, causal=attn_metadata.causal, alibi_slopes=None,
            sliding_window=self.sliding_window, block_table=attn_metadata.block_table,
            softcap=self.logits_soft_cap, scheduler_metadata=attn_metadata.scheduler_metadata,
            s_aux=None, dynamic_causal=attn_metadata.dynamic_causal,
            k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        if rope is not None and plan.off_home is not None:
            self._attend_off_home(layer, query, k_unrot, v_cache, plan.off_home,
                                  attn_metadata.causal, rope, output)
        return output

    # -- write -------------------------------------------------------------------------------

    def _write(self, layer: Any, key: torch.Tensor, value: torch.Tensor, k_unrot: torch.Tensor,
               v_cache: torch.Tensor, k_home: torch.Tensor, plan: StepPlan,
               rope: torch.nn.Module | None, path: str) -> None:
        """Store this step's tokens: K~ (region 0), V (1), K rotated at its position (2)."""
        if plan.write_rows is not None:
            key, value = key[plan.write_rows], value[plan.write_rows]
        if rope is None:  # keys arrived rotated (stock layer): only the stock regions
            ops.cpu_attn_reshape_and_cache(key, value, k_home, v_cache, plan.write_slots,
                                           layer.isa, k_scale=layer._k_scale_float,
                                           v_scale=layer._v_scale_float,
                                           kv_cache_dtype=self.kv_cache_dtype)
            return
        k_unrot[plan.write_blocks, :, plan.write_offsets] = key
        if path == "torch":  # the pure-torch path reads plain V and never region [2]
            v_cache[plan.write_blocks, :, plan.write_offsets] = value
            return
        # RoPE on keys, at write time, with the model's own op: the key stock vLLM would cache.
        k_rot = _rotate(rope, plan.write_positions, key)
        ops.cpu_attn_reshape_and_cache(k_rot, value, k_home, v_cache, plan.write_slots,
                                       layer.isa, k_scale=layer._k_scale_float,
                                       v_scale=layer._v_scale_float,
                                       kv_cache_dtype=self.kv_cache_dtype)

    # -- read paths --------------------------------------------------------------------------

    def _attend_off_home(self, layer: Any, query: torch.Tensor, k_unrot: torch.Tensor,
                         v_cache: torch.Tensor, batch: OffHomeBatch, causal: bool,
                         rope: torch.nn.Module, output: torch.Tensor) -> None:
        """RoPE inside attention: rotate the requests' keys by logical position, then attend.

        Keys come from region 0 in table order (key ``j`` at row ``j``), are rotated by ``j``
        into a transient scratch laid out for the C++ kernel, and the kernel runs on the
        sub-batch with a scratch-local block table. Values are copied block-wise as stored.
        """
        num_kv_heads, block_size, head_size = k_unrot.shape[1:]
        num_scratch = batch.blocks.numel()
        keys = k_unrot[batch.blocks].transpose(1, 2).reshape(-1, num_kv_heads, head_size)
        keys = _rotate(rope, batch.key_positions, keys[batch.token_slots])
        scratch = torch.empty(num_scratch, num_kv_heads, 2 * block_size, head_size,
                              dtype=k_unrot.dtype)
        s_key, s_value = scratch.chunk(2, dim=2)
        # The writer stores K in the kernel's (ISA-specific) layout; it needs a value too, so
        # it gets the keys and region [1] is copied over that afterwards, layout untouched.
        ops.cpu_attn_reshape_and_cache(keys, keys, s_key, s_value, batch.token_slots,
                                       layer.isa, kv_cache_dtype=self.kv_cache_dtype)
        s_value.copy_(v_cache[batch.blocks])
        sub_out = torch.empty(batch.rows.numel(), *output.shape[1:], dtype=output.dtype)
        ops.cpu_attention_with_kv_cache(
            query=query[batch.rows], key_cache=s_key, value_cache=s_value, output=sub_out,
            query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens, scale=self.scale,
            causal=causal, alibi_slopes=None, sliding_window=-1, block_table=batch.block_table,
            softcap=self.logits_soft_cap, scheduler_metadata=batch.scheduler_metadata,
            s_aux=None, kv_cache_dtype=self.kv_cache_dtype,
        )
        output[batch.rows] = sub_out

    def _attend_torch(self, query: torch.Tensor, k_unrot: torch.Tensor, v_cache: torch.Tensor,
                      plan: StepPlan, causal: bool, rope: torch.nn.Module,
                      output: torch.Tensor) -> torch.Tensor:
        """The pure-torch alternative: the reference kernel on regions 0/1 (plain layouts)."""
        batch = plan.off_home
        assert batch is not None
        sub_out = paged_attention_rope_ref(
            query[batch.rows], k_unrot.transpose(1, 2), v_cache.transpose(1, 2),
            batch.global_block_table, batch.seq_lens, batch.query_start_loc,
            rope.cos_sin_cache, rope.rotary_dim, rope.is_neox_style, self.scale,
            causal=bool(causal),
        )
        output[batch.rows] = sub_out
        return output


def _rotate(rope: torch.nn.Module, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x`` ([tokens, heads, D]) rotated at ``positions`` by the model's own rotary module.

    The module rotates its first argument (the "query" slot) in place on CPU, so it gets a
    contiguous copy; calling the module (not re-deriving frequencies) keeps every rotary
    variant and the exact arithmetic of stock vLLM.
    """
    tokens, heads, head_size = x.shape
    flat = x.reshape(tokens, heads * head_size).clone()
    rotated, _ = rope(positions, flat, None)
    return rotated.view(tokens, heads, head_size)
