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
A request that reads some block at another slot (a span reused at a new offset) is attended
through the *rotated-block pool* (``RotatedBlocks``): one entry per (table slot, physical block)
it reads, holding that block's keys rotated from region [0] for that slot (or copied from region
[2] when the slot is the block's home) and its values, in the C++ kernel's layout; the same kernel
then runs on the pool. An entry depends only on the block's content and the slot, so it serves
every request and every later step that reads that block there; it is dropped when the block is
written, so a decode step rebuilds one block per request. Nothing shared is ever rewritten in the
KV cache, and one physical block serves any number of requests at any offsets in the same batch.
Which physical block sits at which home slot, and the pool's entries, are tracked per KV-cache
group by the metadata builder (``_HomeSlots``, ``RotatedBlocks``), once per step.

**Why this design.** Measured on the 2-core development machine (shared; 1 thread, fp32,
SmolLM2-135M attention shapes: 9 query / 3 KV heads, D=64, block 32), one layer's write + attention
in ms, min over 5-15 runs, every block read at its home slot (PIC off)::

    case                              stock C++   auto   scratch   torch
    decode 8 x 512 ctx                   0.20     0.28     9.85     6.63
    decode 32 x 256 ctx                  0.45     0.54    36.5     13.5
    prefill 1 x 512                      4.02     4.51     9.73    16.5
    2 prefills x 256 + 6 decode x 512    2.27     2.69     9.65    12.3

``torch`` is the pure-torch backend (``kernels.paged_attention_rope_ref`` per request, keys rotated
on every read); ``scratch`` (as first built, before the pool) rotated every request's keys into a
fresh scratch cache per step and called vLLM's C++ kernel; ``auto`` is this module's default (C++
kernel on region [2], the off-home path only for off-home requests). With the pool,
``MINIPIC_CPU_ATTN=scratch`` sends every request through the pool. Both rotate-on-every-read options
cost 3-80x the stock kernel, and a SmolLM2 step runs 30 layers, so they would multiply decode time;
``auto`` adds 0.1-0.5 ms per layer (the extra writes and one rotary call). Whole engine, SmolLM2
fp32, PIC off, minipic / stock wall time (``benchmarks/pic_overhead.py``, worker pinned to the
quieter core; an A/A run of two stock engines gave 1.00 / 1.01)::

    path      prefill 2 x 384   decode 8 x 64 + 64 tokens   JSON in results/
    auto          1.00              0.97 (rounds 0.92, 1.02)    pic_overhead.json
    scratch       1.09              1.27                        pic_overhead_alternatives.json
    torch         1.18              1.7 - 2.9                   pic_overhead_alternatives.json

(Contexts there are short; the per-layer table shows the gap growing with context length.)

Off-home reads (spans reused at new offsets, the PIC case), one layer, decode of 8 requests x 544
keys whose 512-token span sits one block off its home, median ms per step: rebuilding a rotated
scratch of every request's context each step (this module's first design) 17.2; the pool 1.1 in
the layer (0.17 of it the kernel) + 0.6 per step for the plan, shared by all layers. The pool is
as large as the biggest off-home working set of a step so far (it grows, never shrinks; ~49 KB per
entry and layer for SmolLM2 fp32), memory outside vLLM's KV budget, bounded by the running
requests' contexts (max_num_seqs x max_model_len / block_size entries).
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
# auto: C++ kernel on home-rotated keys + the rotated-block pool for requests reading blocks off
# their home slot. scratch / torch: every request through the pool / the pure-torch path.
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

from engine_ext.rotated_pool import RotatedBlocks, pool_cap_entries  # noqa: E402
from engine_ext.span_isolation import step_key_starts  # noqa: E402
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
class SubBatch:
    """Some of the step's requests, re-indexed for one call of the C++ kernel."""

    rows: torch.Tensor  # [T] int64: query rows of these requests in the step's batch
    query_start_loc: torch.Tensor  # [S + 1] int32, local
    seq_lens: torch.Tensor  # [S] int32
    block_table: torch.Tensor  # [S, max_blocks] int32 (physical, or into the rotated pool)
    scheduler_metadata: torch.Tensor | None  # C++ kernel work split for this sub-batch


@dataclass
class OffHomeBatch(SubBatch):
    """The requests of one step that read some block away from its home slot.

    ``block_table`` indexes the rotated-block pool (``RotatedBlocks``), which holds each
    (table slot, physical block) pair these requests read, keys rotated for that slot.
    """

    fill: RotatedFill | None  # pool entries to (re)build in this step, after the writes
    pool_blocks: int  # pool size every layer must have
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

    def slots_of(self, blocks: torch.Tensor) -> torch.Tensor:
        """Home slot of each of ``blocks`` (-1: never written)."""
        if blocks.numel():
            self._ensure(int(blocks.max()))
        return self.slot[blocks]

    def requests_off_home(self, block_table: torch.Tensor, seq_lens: torch.Tensor,
                          block_size: int, slot_offset: torch.Tensor | None = None
                          ) -> torch.Tensor:
        """Bool ``[num_reqs]``: request reads at least one block away from its home slot.

        ``slot_offset[i]``: the table slot that column 0 of row ``i`` stands for (a row of an
        isolated segment starts at its SSEP block; None: every row starts at slot 0).
        """
        num_blocks = torch.div(seq_lens + block_size - 1, block_size, rounding_mode="floor")
        width = int(num_blocks.max()) if num_blocks.numel() else 0
        if width == 0:
            return torch.zeros(seq_lens.shape, dtype=torch.bool)
        table = block_table[:, :width].long()
        self._ensure(int(table.max()))
        col = torch.arange(width, dtype=torch.int32).unsqueeze(0)
        if slot_offset is not None:
            col = col + slot_offset.to(torch.int32).unsqueeze(1)
        at_home = self.slot[table] == col
        used = torch.arange(width).unsqueeze(0) < num_blocks.unsqueeze(1)
        return (used & ~at_home).any(dim=1)


@dataclass
class RotatedFill:
    """Pool entries a step (re)builds: ``pool[entry] = block`` rotated for table slot ``slot``.

    Entries whose block sits at its home slot are copied from region [2] (already rotated
    there); the others are rotated from region [0], only their ``valid`` written tokens.
    """

    home_entries: torch.Tensor  # [H] int64 pool entries copied from region [2]
    home_blocks: torch.Tensor  # [H] int64 their physical blocks
    entries: torch.Tensor  # [F] int64 pool entries rotated from region [0]
    blocks: torch.Tensor  # [F] int64 their physical blocks
    token_blocks: torch.Tensor  # [K] int64 physical block of each key to rotate
    token_offsets: torch.Tensor  # [K] int64 offset in block
    token_positions: torch.Tensor  # [K] int64 logical position (slot * bs + offset)
    token_pool_slots: torch.Tensor  # [K] int64 pool slot (entry * bs + offset)


@dataclass
class StepPlan:
    """What the position-free layers need per step, beyond vLLM's CPU metadata."""

    positions: torch.Tensor  # [num_tokens] int64 logical positions of the new tokens
    write_rows: torch.Tensor | None  # rows that have a cache slot (None: all rows)
    write_slots: torch.Tensor  # [W] int64 cache slots of those rows
    write_blocks: torch.Tensor  # [W] int64 physical block of each slot
    write_offsets: torch.Tensor  # [W] int64 offset in block
    write_positions: torch.Tensor  # [W] int64 logical positions of those rows
    # requests that need RoPE-in-attention from region [0], in chunks that each fit the
    # rotated-block pool's cap (one chunk unless a step reads more than the cap)
    off_home_chunks: list[OffHomeBatch]
    home: SubBatch | None  # with off_home: the other requests (None: every request is home)
    key_start: torch.Tensor | None = None  # [num_tokens] first visible key (None: causal)
    release_pool: bool = False  # the pool was released (idle): layers free their pages

    @property
    def off_home(self) -> OffHomeBatch | None:
        """The first (usually only) off-home chunk."""
        return self.off_home_chunks[0] if self.off_home_chunks else None


ScheduleFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def plan_step(home: _HomeSlots, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
              block_table: torch.Tensor, slot_mapping: torch.Tensor, block_size: int,
              path: str, scheduler_metadata: ScheduleFn | None,
              rotated: RotatedBlocks | None = None,
              key_start: torch.Tensor | None = None) -> StepPlan:
    """Positions, home-slot bookkeeping and the off-home sub-batch of one step.

    ``query_start_loc`` / ``seq_lens`` / ``block_table`` cover exactly the step's requests and
    ``slot_mapping`` its tokens. ``scheduler_metadata(qsl, seq_lens)`` builds the C++ kernel's
    work split for a sub-batch (None for the pure-torch path). ``rotated`` is the group's
    rotated-block pool (kept across steps; a fresh one when None). ``key_start[t]`` is the first
    key token ``t`` may attend to (span isolation, ``engine_ext/span_isolation.py``; None: all
    causal): the C++ kernel has no such mask, so each run of a request's queries with one
    ``key_start`` becomes its own kernel row whose table starts at that key's block
    (:func:`_isolated_rows`); RoPE is relative and keys are rotated by their true slot, so
    the shifted row computes exactly the masked attention.
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
    rotated = rotated if rotated is not None else RotatedBlocks()
    if rotated.by_block:  # an empty pool has nothing to invalidate (every PIC-off step)
        rotated.invalidate(blocks.unique().tolist())
    offset = None
    if key_start is not None and path != "torch":
        qsl, lens, block_table, offset = _isolated_rows(qsl, lens, block_table, positions,
                                                        key_start, block_size)
    if path == "auto":
        off = home.requests_off_home(block_table, lens, block_size, offset)
    else:
        off = torch.ones(lens.numel(), dtype=torch.bool)
    chunks: list[OffHomeBatch] = []
    home_batch = None
    any_off = bool(off.any())
    released = rotated.note_step(any_off)
    if any_off or offset is not None:
        if any_off:
            chunks = _off_home_chunks(off.nonzero().flatten().tolist(), qsl, lens,
                                      block_table, block_size, home, rotated,
                                      None if path == "torch" else scheduler_metadata,
                                      None if offset is None else offset.tolist())
        home_batch = _sub_batch((~off).nonzero().flatten().tolist(), qsl, lens, block_table,
                                scheduler_metadata)
    return StepPlan(positions=positions, write_rows=write_rows, write_slots=slots,
                    write_blocks=blocks, write_offsets=slots - blocks * block_size,
                    write_positions=write_positions, off_home_chunks=chunks, home=home_batch,
                    key_start=key_start, release_pool=released)


def _off_home_chunks(reqs: list[int], qsl: torch.Tensor, seq_lens: torch.Tensor,
                     block_table: torch.Tensor, block_size: int, home: _HomeSlots,
                     rotated: RotatedBlocks, scheduler_metadata: ScheduleFn | None,
                     slot_offset: list[int] | None) -> list[OffHomeBatch]:
    """The off-home requests in chunks whose distinct ``(slot, block)`` pairs fit the pool's
    cap (``engine_ext/rotated_pool.py``); one chunk when there is no cap or it all fits."""
    if rotated.cap is None:
        return [_off_home_batch(reqs, qsl, seq_lens, block_table, block_size, home, rotated,
                                scheduler_metadata, slot_offset)]
    lens = seq_lens.tolist()
    groups: list[list[int]] = [[]]
    seen: set[tuple[int, int]] = set()
    for i in reqs:
        n = -(-lens[i] // block_size)
        shift = slot_offset[i] if slot_offset is not None else 0
        keys = {(shift + col, int(b)) for col, b in enumerate(block_table[i, :n].tolist())}
        if groups[-1] and len(seen | keys) > rotated.cap:
            groups.append([])
            seen = set()
        groups[-1].append(i)
        seen |= keys
    if len(groups) > 1:
        rotated.chunked_steps += 1
    return [_off_home_batch(g, qsl, seq_lens, block_table, block_size, home, rotated,
                            scheduler_metadata, slot_offset) for g in groups]


def _isolated_rows(qsl: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                   positions: torch.Tensor, key_start: torch.Tensor, block_size: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kernel rows for a step with isolated segments: one per run of a request's queries that
    share a ``key_start``, in token order (so query rows need no permutation).

    Row ``k`` covers keys ``key_start .. last query of the run``: its table is the request's
    table from block ``key_start // block_size`` on, its length counts from ``key_start``, and
    ``offset[k]`` says which table slot its column 0 is (home slots and rotated-pool entries
    stay keyed by the true slot). Returns ``(qsl, seq_lens, block_table, offset)``.
    """
    num_tokens = positions.numel()
    q_lens = qsl[1:] - qsl[:-1]
    req_of_token = torch.repeat_interleave(torch.arange(q_lens.numel()), q_lens,
                                           output_size=num_tokens)
    first = torch.ones(num_tokens, dtype=torch.bool)
    first[1:] = (req_of_token[1:] != req_of_token[:-1]) | (key_start[1:] != key_start[:-1])
    starts = first.nonzero().flatten()
    row_qsl = torch.cat([starts, torch.tensor([num_tokens])])
    row_req = req_of_token[starts]
    row_key_start = key_start[starts]
    row_lens = positions[row_qsl[1:] - 1] + 1 - row_key_start
    offset = torch.div(row_key_start, block_size, rounding_mode="floor")
    width = int(torch.div(row_lens + block_size - 1, block_size, rounding_mode="floor").max())
    cols = (offset.unsqueeze(1) + torch.arange(width)).clamp(max=block_table.shape[1] - 1)
    table = torch.gather(block_table[row_req].long(), 1, cols).to(block_table.dtype)
    return row_qsl, row_lens, table, offset


def _sub_batch(reqs: list[int], qsl: torch.Tensor, seq_lens: torch.Tensor,
               block_table: torch.Tensor, scheduler_metadata: ScheduleFn | None) -> SubBatch:
    """Requests ``reqs`` of the step with their own rows, lengths and (physical) tables."""
    starts, ends = qsl[:-1].tolist(), qsl[1:].tolist()
    rows = [torch.arange(starts[i], ends[i]) for i in reqs]
    local_qsl = [0]
    for i in reqs:
        local_qsl.append(local_qsl[-1] + ends[i] - starts[i])
    sub_qsl = torch.tensor(local_qsl, dtype=torch.int32)
    sub_lens = seq_lens[reqs].to(torch.int32)
    return SubBatch(
        rows=torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long),
        query_start_loc=sub_qsl, seq_lens=sub_lens, block_table=block_table[reqs],
        scheduler_metadata=scheduler_metadata(sub_qsl, sub_lens)
        if scheduler_metadata and reqs else None,
    )


def _off_home_batch(reqs: list[int], qsl: torch.Tensor, seq_lens: torch.Tensor,
                    block_table: torch.Tensor, block_size: int, home: _HomeSlots,
                    rotated: RotatedBlocks, scheduler_metadata: ScheduleFn | None,
                    slot_offset: list[int] | None = None) -> OffHomeBatch:
    """The off-home requests with a block table into the rotated pool, and what to fill.

    ``slot_offset[i]``: the true table slot of column 0 of row ``i`` (isolated rows).
    """
    base = _sub_batch(reqs, qsl, seq_lens, block_table, scheduler_metadata)
    lens = seq_lens.tolist()
    width = max(-(-lens[i] // block_size) for i in reqs)
    table = torch.zeros(len(reqs), width, dtype=torch.int32)
    table_blocks = block_table[reqs, :width].long()
    physical = table_blocks.tolist()
    home_of = home.slots_of(table_blocks).tolist()  # only the blocks read
    in_use: set[tuple[int, int]] = set()
    home_fill: list[tuple[int, int]] = []
    rot_fill: list[tuple[int, int, int, int]] = []  # entry, block, slot, valid tokens
    for r, i in enumerate(reqs):
        n = -(-lens[i] // block_size)
        shift = slot_offset[i] if slot_offset is not None else 0
        row = []
        for col in range(n):
            block, slot = physical[r][col], shift + col
            entry, fill = rotated.lookup((slot, block), in_use)
            row.append(entry)
            if fill:
                if home_of[r][col] == slot:
                    home_fill.append((entry, block))
                else:
                    valid = min(block_size, lens[i] - col * block_size)
                    rot_fill.append((entry, block, slot, valid))
        table[r, :n] = torch.tensor(row, dtype=torch.int32)
    return OffHomeBatch(
        rows=base.rows, query_start_loc=base.query_start_loc, seq_lens=base.seq_lens,
        block_table=table, scheduler_metadata=base.scheduler_metadata,
        fill=_fill(home_fill, rot_fill, block_size) if home_fill or rot_fill else None,
        pool_blocks=rotated.capacity, global_block_table=base.block_table,
    )


def _fill(home_fill: list[tuple[int, int]], rot_fill: list[tuple[int, int, int, int]],
          block_size: int) -> RotatedFill:
    def column(rows: list[tuple[int, ...]], k: int) -> torch.Tensor:
        return torch.tensor([row[k] for row in rows], dtype=torch.long)

    valid = column(rot_fill, 3)
    offsets = torch.cat([torch.arange(v) for v in valid.tolist()]) if rot_fill else valid
    token_blocks = torch.repeat_interleave(column(rot_fill, 1), valid)
    token_slots = torch.repeat_interleave(column(rot_fill, 2), valid)
    token_entries = torch.repeat_interleave(column(rot_fill, 0), valid)
    return RotatedFill(
        home_entries=column(home_fill, 0), home_blocks=column(home_fill, 1),
        entries=column(rot_fill, 0), blocks=column(rot_fill, 1),
        token_blocks=token_blocks, token_offsets=offsets,
        token_positions=token_slots * block_size + offsets,
        token_pool_slots=token_entries * block_size + offsets,
    )


class MinipicCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """Stock CPU metadata plus the step plan (positions, off-home sub-batch)."""

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: Any,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.position_free = has_position_free_pages(kv_cache_spec)
        self.path = attn_path()
        self.home = _HomeSlots(vllm_config.cache_config.num_gpu_blocks or 0)
        # One pool entry holds a block's rotated keys and its values in every layer of the group.
        itemsize = torch.tensor([], dtype=kv_cache_spec.dtype).element_size()
        entry_bytes = (2 * kv_cache_spec.block_size * kv_cache_spec.head_size
                       * kv_cache_spec.num_kv_heads * itemsize * len(layer_names))
        longest = -(-vllm_config.model_config.max_model_len // kv_cache_spec.block_size)
        self.rotated = RotatedBlocks(cap=pool_cap_entries(entry_bytes, longest),
                                     entry_bytes=entry_bytes)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> MinipicCPUAttentionMetadata:
        base = super().build(common_prefix_len, common_attn_metadata, fast_build)
        md = MinipicCPUAttentionMetadata(
            **{f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        )
        if not self.position_free or self.is_cross_attention or self.is_encoder_only_attention:
            return md
        cm = common_attn_metadata
        query_start_loc = cm.query_start_loc[: cm.num_reqs + 1]
        seq_lens = cm.seq_lens[: cm.num_reqs]
        plan = plan_step(
            self.home, query_start_loc, seq_lens,
            cm.block_table_tensor[: cm.num_reqs], cm.slot_mapping[: cm.num_actual_tokens],
            self.block_size, self.path,
            None if self.path == "torch" else functools.partial(self._schedule, md.causal),
            self.rotated,
            key_start=step_key_starts(query_start_loc, seq_lens, self.block_size),
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
        # Requests reading every block at its home slot: keys rotated at their home positions
        # (region [2]) are exactly what stock vLLM computes with, so its kernel runs unchanged.
        home = plan.home
        if home is None:
            self._attend(layer, query[:n], k_home, v_cache, output[:n],
                         attn_metadata.query_start_loc, attn_metadata.seq_lens,
                         attn_metadata.block_table, attn_metadata.scheduler_metadata,
                         attn_metadata.causal, attn_metadata.dynamic_causal)
        elif home.rows.numel():
            sub_out = torch.empty(home.rows.numel(), *output.shape[1:], dtype=output.dtype)
            self._attend(layer, query[home.rows], k_home, v_cache, sub_out,
                         home.query_start_loc, home.seq_lens, home.block_table,
                         home.scheduler_metadata, attn_metadata.causal, None)
            output[home.rows] = sub_out
        if plan.release_pool:
            self._pool = None  # idle: the pool's index was reset, give the pages back
        if rope is not None:
            # Chunk by chunk: a later chunk may reuse pool entries an earlier one attended with.
            for chunk in plan.off_home_chunks:
                self._attend_off_home(layer, query, k_unrot, v_cache, k_home, chunk,
                                      attn_metadata.causal, rope, output)
        return output

    def _attend(self, layer: Any, query: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, output: torch.Tensor, query_start_loc: torch.Tensor,
                seq_lens: torch.Tensor, block_table: torch.Tensor,
                scheduler_metadata: torch.Tensor | None, causal: bool,
                dynamic_causal: Any) -> None:
        """vLLM's C++ CPU attention kernel on (key_cache, value_cache) pages."""
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=output,
            query_start_loc=query_start_loc, seq_lens=seq_lens, scale=self.scale,
            causal=causal, alibi_slopes=None, sliding_window=self.sliding_window,
            block_table=block_table, softcap=self.logits_soft_cap,
            scheduler_metadata=scheduler_metadata, s_aux=None, dynamic_causal=dynamic_causal,
            k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
            kv_cache_dtype=self.kv_cache_dtype,
        )

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
                         v_cache: torch.Tensor, k_home: torch.Tensor, batch: OffHomeBatch,
                         causal: bool, rope: torch.nn.Module, output: torch.Tensor) -> None:
        """RoPE inside attention: keys rotated by the slot they are read at, then attended.

        The rotated copies live in this layer's pool (``RotatedBlocks``); the step's plan says
        which entries to (re)build, after this step's writes: blocks read at their home slot
        are copied from region [2], the others rotated from region [0] with the model's own
        rotary op. The C++ kernel then runs on the pool with the pool's block table.
        """
        num_kv_heads, block_size, head_size = k_unrot.shape[1:]
        pool = self._rotated_pool(batch.pool_blocks, num_kv_heads, block_size, head_size,
                                  k_unrot.dtype)
        p_key, p_value = pool.chunk(2, dim=2)
        fill = batch.fill
        if fill is not None:
            if fill.home_entries.numel():
                p_key[fill.home_entries] = k_home[fill.home_blocks]
                p_value[fill.home_entries] = v_cache[fill.home_blocks]
            if fill.entries.numel():
                keys = k_unrot[fill.token_blocks, :, fill.token_offsets]  # [K, kv_heads, D]
                keys = _rotate(rope, fill.token_positions, keys)
                # The writer stores K in the kernel's (ISA-specific) layout and needs a value
                # too: it gets the keys, and the block's values are copied over them after.
                ops.cpu_attn_reshape_and_cache(keys, keys, p_key, p_value,
                                               fill.token_pool_slots, layer.isa,
                                               kv_cache_dtype=self.kv_cache_dtype)
                p_value[fill.entries] = v_cache[fill.blocks]
        sub_out = torch.empty(batch.rows.numel(), *output.shape[1:], dtype=output.dtype)
        self._attend(layer, query[batch.rows], p_key, p_value, sub_out,
                     batch.query_start_loc, batch.seq_lens, batch.block_table,
                     batch.scheduler_metadata, causal, None)
        output[batch.rows] = sub_out

    def _rotated_pool(self, blocks: int, num_kv_heads: int, block_size: int, head_size: int,
                      dtype: torch.dtype) -> torch.Tensor:
        """This layer's rotated-block pages ``[blocks, kv_heads, 2 * block_size, D]`` (K, V),
        grown (contents kept) when the plan's pool is larger."""
        pool = getattr(self, "_pool", None)
        if pool is None or pool.shape[0] < blocks:
            grown = torch.zeros(blocks, num_kv_heads, 2 * block_size, head_size, dtype=dtype)
            if pool is not None:
                grown[: pool.shape[0]] = pool
            self._pool = pool = grown
        return pool

    def _attend_torch(self, query: torch.Tensor, k_unrot: torch.Tensor, v_cache: torch.Tensor,
                      plan: StepPlan, causal: bool, rope: torch.nn.Module,
                      output: torch.Tensor) -> torch.Tensor:
        """The pure-torch alternative: the reference kernel on regions 0/1 (plain layouts)."""
        assert plan.off_home_chunks, "the torch path sends every request off home"
        for batch in plan.off_home_chunks:
            sub_out = paged_attention_rope_ref(
                query[batch.rows], k_unrot.transpose(1, 2), v_cache.transpose(1, 2),
                batch.global_block_table, batch.seq_lens, batch.query_start_loc,
                rope.cos_sin_cache, rope.rotary_dim, rope.is_neox_style, self.scale,
                causal=bool(causal),
                key_start=None if plan.key_start is None else plan.key_start[batch.rows],
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
