"""Position-free KV cache for vLLM on CPU: unrotated keys in the cache, RoPE inside attention.

**Where RoPE is applied** (docs/design.md §1):

* queries: by the model, as in stock vLLM (``engine_ext/attention/unrotated_keys.py`` swaps each
  supported attention module's ``rotary_emb`` for a query-only wrapper, so ``k`` reaches
  ``self.attn``
  *unrotated*);
* keys: here, in :meth:`MinipicCPUAttentionImpl.forward`, always with the model's own rotary
  module (``self.minipic_rope``: its ``cos_sin_cache``, ``rotary_dim``, neox/gptj layout, llama3 /
  yarn / linear scaling) and always at the key's *logical* position in the current request:
  key ``j`` of a request sits at block-table slot ``j // block_size``, so it is rotated by ``j``,
  whatever physical block holds it. Query ``t`` is at ``seq_len - query_len + t``.

**Cache layout: vLLM's stock page, keys stored once.** Each (block, kv head) page holds, as in
stock vLLM, ``block_size * head_size`` key elements and as many values, in the layout of vLLM's
C++ CPU kernel (written by ``cpu_attn_reshape_and_cache``). The keys are rotated at the
position they were *written* at, the block's **home** slot: a block filled by a request at
block-table slot ``s`` holds ``R_{s*bs+o} k~``, exactly what stock vLLM caches, so KV memory per
token is stock's (1.00x). What makes the cache position-free is the home-slot table
(``step_plan.HomeSlots``, one per KV-cache group): RoPE rotations compose, ``R(a) R(b) =
R(a + b)``, so a block's keys at another slot ``t`` are its home keys rotated once more by
``(t - s) * bs`` -- the same offset for every key of the block (``kernels.rotate_by_offset``,
as a table for the model's own rotary op: ``kernels.offset_cos_sin_cache``;
a table that folds a scale into cos/sin, YaRN's ``mscale``, is divided out of that second
rotation, so it is applied once). The position-free key ``k~`` itself is recovered by the
inverse rotation (``kernels.unrotate``), which is how anything that must hold position-free keys
(the torch reference path below; a span store) reads them.

Reading a block at its home slot (every read when PIC is off: stock prefix hashing only shares
a block at the slot it was computed at) therefore runs vLLM's own C++ kernel
(``cpu_attention_with_kv_cache``) on the stock page with no extra work -- bit-identical to
stock. A request that reads some block at another slot (a span reused at a new offset) is
attended with keys from the layer's *key shadow* (``engine_ext/attention/key_shadow/pages.py``):
address space shaped like the cache, where block ``b``'s page, at index ``b``, holds its keys moved
to the slot it is read at (rotated from home by the difference, or copied when the slot is its
home). vLLM's kernel takes keys and values as separate tensors with one block table, so it runs with
keys from the shadow and **values in place from the cache**, on the request's own physical table:
only keys are ever moved, and memory is committed only for the pages written, inside the pool's
budget (``engine_ext/attention/key_shadow/pool.py``). The kernel's key layout depends on the ISA, so
it is measured once per (ISA, dtype, block) by vLLM's own writer
(``engine_ext/attention/cpu_kv_layout.py``). A shadow page depends only on the block's content and
the slot, so it serves every request and every later step that reads that block there; it turns
stale when the block is written, so a decode step rebuilds one page per request. Requests of one
step that read a block at different slots are attended in separate chunks; a request that reads one
block at two slots itself (the same document twice) attends a private scratch copy. Nothing shared
is ever rewritten in the KV cache, and one physical block serves any number of requests at any
offsets. Which physical block sits at which home slot, and which slot each shadow page holds, are
tracked per KV-cache group by the metadata builder, once per step.

**Precision.** Off-home keys are rotated twice (at write, then by the offset) where the
reference rotates once; in fp32 the difference is at rounding level (measured in
``tests/engine/test_kernels.py``: about 1e-6 of the key's magnitude), in bf16 one extra rounding of
the moved key. Home reads are exact.

**Paths.** ``MINIPIC_CPU_ATTN=auto`` (default): requests at home run vLLM's C++ kernel on the
cache; only off-home requests read the key shadow. ``scratch`` sends every request through the
shadow, ``torch`` through the pure-torch reference (``kernels.paged_attention_rope_ref``, on keys
un-rotated from the cache). Why ``auto``
(measured per-layer and whole-engine costs of each path): ``results/cpu_backend.md``.

**Span isolation** (``engine_ext/attention/span_isolation.py``): queries whose ``key_start`` is not
0 are split into kernel rows whose tables start at their segment's first block (``step_plan``).

Invariants: nothing shared is ever rewritten in the cache after its block is written; a
block's keys are rotated at the one slot it was written at (its home); a shadow page holds
exactly "block's keys rotated for slot" and turns stale when the block is written; one kernel
call reads each block at one slot; every layer of a KV-cache group sees the same step plan,
built once per step by the metadata builder.

**Processes.** ``install()`` runs from the plugin in every vLLM process; it only registers class
paths (``CPU_ATTN`` -> this module, ``CUSTOM`` -> ``engine_ext.attention.cuda_backend``) and wraps
the model loader (``engine_ext.attention.unrotated_keys``). Both take effect only where a model is
built: the worker.

**Sliding windows** count real tokens (docs/design.md §2): a converted windowed layer keeps
every block (``unrotated_keys`` gives vLLM a full-attention spec for it, since vLLM frees blocks by
physical distance); plain requests (no layout tokens: logical = physical) run vLLM's kernel with
the window as stock; span requests' masked rows apply it at logical positions (the kept copy is in
logical order, so vLLM's kernel windows it right; the masked torch rows add it to their mask).
Logit soft-capping and learned attention sinks (GPT-OSS) are applied on every path the same way.

Limitations: decoder self-attention only (other attention types and layers without a supported
rotary module get stock behaviour); no ALiBi, fp8 KV cache, MRoPE, DCP/PCP; speculative decoding
positions are not verified.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from minipic.engine_ext.vllm_surface.added_names import OFFSET_TABLES_ATTR
from minipic.span_contract.env import CPU_ATTN_ENV
from minipic.span_contract.span_config import SpanConfig

BACKEND_PATH = "minipic.engine_ext.attention.cpu_backend.MinipicCPUAttentionBackend"
CUDA_BACKEND_PATH = "minipic.engine_ext.attention.cuda_backend.MinipicCudaAttentionBackend"
# auto: C++ kernel on home-rotated keys + the key shadow for requests reading blocks off
# their home slot. scratch / torch: every request through the shadow / the pure-torch path.
ATTN_PATH_ENV = CPU_ATTN_ENV
ATTN_PATHS = ("auto", "scratch", "torch")

_STATE: dict[str, Any] = {"installed": False}
# Metadata builder of each position-free layer, in this worker: what a KV connector that fills
# blocks from outside the forward (engine_ext/span_store) needs to tell the home-slot table;
# reached only through home_slot_of and blocks_filled below.
_BUILDERS: dict[str, Any] = {}


def home_slot_of(layer: str, block_id: int) -> int | None:
    """The table slot whose positions ``block_id``'s cached keys are rotated at, in the group
    of ``layer`` (-1: never written); None when that layer's backend keeps no home slots (a
    GPU backend, or keys stored rotated)."""
    builder = _BUILDERS.get(layer)
    if builder is None:
        return None
    return int(builder.home.slots_of(torch.tensor([block_id]))[0])


def blocks_filled(layer: str, blocks: list[int], home_slots: list[int]) -> None:
    """Record that ``blocks`` of ``layer``'s group were written outside a forward (a span store
    load) with keys rotated at ``home_slots``: their home, and no stale shadow page."""
    builder = _BUILDERS.get(layer)
    if builder is not None:
        builder.blocks_filled(blocks, home_slots)


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

    from minipic.engine_ext.attention import unrotated_keys

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

from minipic.engine_ext.attention import (  # noqa: E402
    cpu_kv_layout,
    kept_pool,
    masked_rows,
)
from minipic.engine_ext.attention.kept_pool import KeptPool  # noqa: E402
from minipic.engine_ext.attention.key_shadow.pages import KeyShadow  # noqa: E402
from minipic.engine_ext.attention.key_shadow.pool import (  # noqa: E402
    KeyShadowIndex,
    pool_cap_entries,
)
from minipic.engine_ext.attention.span_isolation import step_positions, step_span_view  # noqa: E402
from minipic.engine_ext.attention.step_plan import (  # noqa: E402
    HomeSlots,
    OffHomeBatch,
    RotatedFill,
    StepPlan,
    plan_step,
)
from minipic.kernels import (  # noqa: E402
    offset_cos_sin_cache,
    paged_attention_rope_ref,
    unrotate,
)


def position_free_spec(spec: AttentionSpec) -> bool:
    """Whether a group's spec can be read position-free (plain decoder full attention only)."""
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


def converted_layers(vllm_config: Any, layer_names: list[str]) -> int:
    """How many of a group's layers store unrotated keys and rotate them in attention.

    ``engine_ext.attention.unrotated_keys`` sets ``impl.minipic_rope`` when the model is built,
    before vLLM creates the metadata builders, so the builder can ask its own layers.
    """
    layers = vllm_config.compilation_config.static_forward_context
    return sum(getattr(getattr(layers.get(name), "impl", None), "minipic_rope", None)
               is not None for name in layer_names)


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


@dataclass
class MinipicCPUAttentionMetadata(CPUAttentionMetadata):
    plan: StepPlan | None = None  # None: layers of this group are not position-free


class MinipicCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """Stock CPU metadata plus the step plan (positions, off-home sub-batch)."""

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: Any,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.position_free = (position_free_spec(kv_cache_spec)
                              and converted_layers(vllm_config, layer_names) > 0)
        self.path = attn_path()
        self.home = HomeSlots(vllm_config.cache_config.num_gpu_blocks or 0)
        # A shadow page holds one block's keys (values are read in place) in every layer.
        itemsize = torch.tensor([], dtype=kv_cache_spec.dtype).element_size()
        entry_bytes = (kv_cache_spec.block_size * kv_cache_spec.head_size
                       * kv_cache_spec.num_kv_heads * itemsize * len(layer_names))
        longest = -(-vllm_config.model_config.max_model_len // kv_cache_spec.block_size)
        # a private chunk's scratch: keys and values of one layer for one request's table
        scratch = 2 * longest * entry_bytes // max(len(layer_names), 1)
        self.rotated = KeyShadowIndex(
            cap=pool_cap_entries(entry_bytes, longest, scratch) if self.position_free else None,
            entry_bytes=entry_bytes)
        # span requests' kept copies, in KV-cache blocks the scheduler reserved with them
        # (``kept_pool``, ``kept_reservation``)
        self.kept = KeptPool(layer_names, kv_cache_spec.block_size)
        if self.position_free:
            kept_pool.POOLS.append(self.kept)
            _BUILDERS.update(dict.fromkeys(layer_names, self))

    def blocks_filled(self, blocks: list[int], home_slots: list[int]) -> None:
        """Blocks whose pages were written outside a forward (a span store load), with keys
        rotated at ``home_slots``: record their home and drop stale rotated copies."""
        if not blocks:
            return
        ids = torch.tensor(blocks, dtype=torch.long)
        self.home.slots_of(ids)  # grows the table when needed
        self.home.slot[ids] = torch.tensor(home_slots, dtype=torch.int32)
        self.rotated.invalidate(blocks)

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
        view = step_span_view(query_start_loc, seq_lens, self.block_size)
        plan = plan_step(
            self.home, query_start_loc, seq_lens,
            cm.block_table_tensor[: cm.num_reqs], cm.slot_mapping[: cm.num_actual_tokens],
            self.block_size, self.path,
            None if self.path == "torch" else functools.partial(self._schedule, md.causal),
            self.rotated,
            key_start=view.key_start,
            positions=step_positions(query_start_loc, seq_lens),
            view=view,
            kept=self.kept,
        )
        md.plan = plan
        return md

    def _schedule(self, causal: bool, qsl: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        return _scheduler_metadata(self.num_heads, self.num_kv_heads, self.head_dim, self.dtype,
                                   self.isa, self.kv_cache_dtype, qsl, seq_lens, causal)


class MinipicCPUAttentionImpl(CPUAttentionBackendImpl):
    """Writes unrotated keys, rotates them by logical position when attention reads them.

    ``minipic_rope`` is set by ``engine_ext.attention.unrotated_keys`` to the model's own rotary
    module once it has made that layer's keys arrive unrotated; while it is None (unsupported model
    or layer) the layer behaves exactly like stock vLLM (keys arrive rotated).
    """

    minipic_rope: torch.nn.Module | None = None
    position_free_capable: ClassVar[bool] = True
    # a sliding window counts real tokens here (docs/design.md §2): span requests' masked rows
    # apply it at logical positions, so the layer may keep every block (unrotated_keys)
    logical_windows: ClassVar[bool] = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.path = attn_path()

    def rope_unsupported_reason(self, rope: torch.nn.Module) -> str | None:
        """Why this layer cannot take unrotated keys with ``rope`` (None: it can)."""
        if self.attn_type != AttentionType.DECODER:
            return f"attention type {self.attn_type}"
        if self.alibi_slopes is not None:
            return "ALiBi"
        if self.sinks is not None and self.path == "torch":
            return "attention sinks with MINIPIC_CPU_ATTN=torch"
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
        plan = attn_metadata.plan
        if plan is None:
            # Not a position-free group (non-decoder layer, sliding window...): stock path.
            if key is not None and value is not None:
                super().do_kv_cache_update(layer, key, value, kv_cache,
                                           attn_metadata.slot_mapping)
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported")

        num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
        # vLLM's stock page: [K rotated at home | V] per (block, kv head), C++ kernel layouts.
        key_cache, value_cache = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size,
                                               self.head_size).chunk(2, dim=2)
        rope = self.minipic_rope
        path = self.path if rope is not None else "auto"
        n = attn_metadata.num_actual_tokens

        if key is not None and value is not None:
            self._write(layer, key[:n], value[:n], key_cache, value_cache, plan, rope)

        if plan.masked is not None:
            if rope is None:
                raise RuntimeError(
                    "minipic: a span-opted-in request reached a layer that keeps stock rotated "
                    "keys in a position-free group; its layout tokens cannot be hidden there")
            self._attend_masked(layer, query, key_cache, kv_cache, plan, rope, output)
        if path == "torch":
            return self._attend_torch(layer, query, key_cache, value_cache, plan,
                                      attn_metadata.causal, rope, output)
        # Requests reading every block at its home slot: the cached keys are exactly what
        # stock vLLM computes with, so its kernel runs unchanged.
        home = plan.home
        if home is None:
            self._attend(layer, query[:n], key_cache, value_cache, output[:n],
                         attn_metadata.query_start_loc, attn_metadata.seq_lens,
                         attn_metadata.block_table, attn_metadata.scheduler_metadata,
                         attn_metadata.causal, attn_metadata.dynamic_causal)
        elif home.rows.numel():
            sub_out = torch.empty(home.rows.numel(), *output.shape[1:], dtype=output.dtype)
            self._attend(layer, query[home.rows], key_cache, value_cache, sub_out,
                         home.query_start_loc, home.seq_lens, home.block_table,
                         home.scheduler_metadata, attn_metadata.causal, None)
            output[home.rows] = sub_out
        if plan.release_pool and getattr(self, "_shadow", None) is not None:
            self._shadow.release_all()  # idle: the pool's index was reset, give the pages back
        if rope is not None:
            # Chunk by chunk: a later chunk may refill shadow pages an earlier one attended with.
            for chunk in plan.off_home_chunks:
                self._attend_off_home(layer, query, key_cache, value_cache, chunk,
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
            scheduler_metadata=scheduler_metadata, s_aux=self._sinks(),
            dynamic_causal=dynamic_causal,
            k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
            kv_cache_dtype=self.kv_cache_dtype,
        )

    def _sinks(self) -> torch.Tensor | None:
        """The layer's learned sink logits as vLLM's kernel takes them (bf16 or fp32, cast
        once, after the weights are loaded, as the stock impl does)."""
        if self.sinks is not None and self.sinks.dtype not in (torch.bfloat16, torch.float32):
            self.sinks = self.sinks.to(torch.float32)
        return self.sinks

    # -- write -------------------------------------------------------------------------------

    def _write(self, layer: Any, key: torch.Tensor, value: torch.Tensor,
               key_cache: torch.Tensor, value_cache: torch.Tensor, plan: StepPlan,
               rope: torch.nn.Module | None) -> None:
        """Store this step's tokens as stock vLLM does: keys rotated at their position (the
        block's home; ``plan_step`` recorded it), values, with vLLM's own writer."""
        if plan.write_rows is not None:
            key, value = key[plan.write_rows], value[plan.write_rows]
        if rope is not None:  # RoPE on keys at write time, with the model's own op
            key = _rotate(rope, plan.write_positions, key)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, plan.write_slots,
                                       layer.isa, k_scale=layer._k_scale_float,
                                       v_scale=layer._v_scale_float,
                                       kv_cache_dtype=self.kv_cache_dtype)

    def _layout(self, layer: Any, key_cache: torch.Tensor) -> cpu_kv_layout.PageLayout:
        """Where the C++ writer puts each key / value element of a page (measured once)."""
        return cpu_kv_layout.probe(layer.isa, key_cache.dtype, key_cache.shape[2],
                                   key_cache.shape[3])

    # -- read paths --------------------------------------------------------------------------

    def _attend_off_home(self, layer: Any, query: torch.Tensor, key_cache: torch.Tensor,
                         value_cache: torch.Tensor, batch: OffHomeBatch, causal: bool,
                         rope: torch.nn.Module, output: torch.Tensor) -> None:
        """RoPE inside attention: keys moved to the slot they are read at, then attended.

        The moved keys live in this layer's key shadow
        (``engine_ext/attention/key_shadow/pages.py``), at each block's own index; the plan says
        which pages to give back and which to (re)build, after this step's writes: blocks read at
        their home slot are copied, the others get their home keys rotated by the slot difference
        (one offset per block). The C++ kernel then runs with keys from the shadow and values from
        the cache, on the physical block table. A private chunk attends a scratch copy (keys and
        values) instead.
        """
        if batch.scratch_pages:
            pages = torch.empty(batch.scratch_pages, *key_cache.shape[1:-2],
                                2 * key_cache.shape[2], key_cache.shape[3],
                                dtype=key_cache.dtype)
            keys, values = pages.chunk(2, dim=2)
            values.copy_(value_cache.index_select(0, batch.fill.blocks))
        else:
            shadow = self._key_shadow(key_cache)
            if batch.release:
                shadow.release(batch.release)
            keys, values = shadow.keys, value_cache
        fill = batch.fill
        if fill is not None:
            if fill.copy_blocks.numel():
                keys.index_copy_(0, fill.copy_dest, key_cache.index_select(0, fill.copy_blocks))
            if fill.blocks.numel():
                move_keys(self._layout(layer, key_cache), key_cache, fill, rope, keys)
        sub_out = torch.empty(batch.rows.numel(), *output.shape[1:], dtype=output.dtype)
        self._attend(layer, query[batch.rows], keys, values, sub_out,
                     batch.query_start_loc, batch.seq_lens, batch.block_table,
                     batch.scheduler_metadata, causal, None)
        output[batch.rows] = sub_out

    def _key_shadow(self, key_cache: torch.Tensor) -> KeyShadow:
        """This layer's key shadow, shaped like its cache (created at the first off-home read)."""
        shadow = getattr(self, "_shadow", None)
        blocks, heads, block_size, head_size = key_cache.shape
        shape = (blocks, heads, 2 * block_size, head_size)
        if shadow is None or not shadow.matches(shape, key_cache.dtype):
            self._shadow = shadow = KeyShadow(shape, key_cache.dtype)
        return shadow

    def _attend_masked(self, layer: Any, query: torch.Tensor, key_cache: torch.Tensor,
                       kv_cache: torch.Tensor, plan: StepPlan, rope: torch.nn.Module,
                       output: torch.Tensor) -> None:
        """Rule 1 (docs/design.md §2): the requests that hold layout tokens.

        vLLM's C++ kernel attends every key of a row's range, so these rows are attended by
        ``engine_ext/attention/masked_rows.py``: keys moved from their home to their logical
        positions by the model's rotary op, layout keys hidden from every query but their own,
        queries moved from the physical position the model rotated them at; the question's and
        the decoding queries by vLLM's kernel over a kept copy of the request's real keys, the
        span tokens of a final with a mask in torch.
        """
        assert plan.masked is not None and plan.home_slots is not None
        context = self.__dict__.get("_masked_context")
        if context is None or context[0] is not kv_cache:  # what a layer's calls all share
            table, shift = _offset_table(rope, key_cache.dtype)

            def rotate(x: torch.Tensor, rows: torch.Tensor) -> None:
                ops.rotary_embedding(rows, x.view(x.shape[0], -1), None, self.head_size, table,
                                     rope.is_neox_style)

            pages = kv_cache.view(kv_cache.shape[0], kv_cache.shape[1],
                                  2 * key_cache.shape[2], self.head_size)
            context = (kv_cache, self._layout(layer, key_cache), shift, rotate, pages,
                       _LayerKernel(self, layer, kv_cache.dtype),
                       masked_rows.RowSettings.from_env())
            self._masked_context = context
        _, layout, shift, rotate, pages, kernel, settings = context
        rows = masked_rows.prepare(plan.masked, plan.home_slots, key_cache.shape[2], shift)
        step = masked_rows.kept_step(plan.masked)
        # the kept copies lie in this layer's own cache, in blocks reserved for them
        masked_rows.attend(rows, query, pages, layout, rotate, kernel, self.scale, output,
                           step, window=max(self.sliding_window, 0),
                           softcap=self.logits_soft_cap or 0.0, sinks=self._sinks(),
                           settings=settings)

    def _position_free_pages(self, layer: Any, key_cache: torch.Tensor,
                             value_cache: torch.Tensor, block_table: torch.Tensor,
                             home_slots: torch.Tensor, rope: torch.nn.Module
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(keys, values, table)`` of the blocks ``block_table`` reads, as token-major pages
        ``[U, block_size, heads, D]`` with keys un-rotated from their home slots; ``table``
        indexes those pages."""
        layout = self._layout(layer, key_cache)
        num_kv_heads, block_size, head_size = key_cache.shape[1:]
        blocks, table = torch.unique(block_table.long(), return_inverse=True)
        home = home_slots[blocks].long().clamp(min=0)  # unwritten: never read
        positions = (home.unsqueeze(1) * block_size + torch.arange(block_size)).flatten()
        keys = layout.plain_keys(key_cache[blocks]).transpose(1, 2)  # [U, bs, heads, D]
        keys = unrotate(keys.reshape(-1, num_kv_heads, head_size), positions,
                        rope.cos_sin_cache, rope.rotary_dim, rope.is_neox_style)
        values = layout.plain_values(value_cache[blocks]).transpose(1, 2)
        return (keys.view(-1, block_size, num_kv_heads, head_size), values,
                table.to(torch.int32))

    def _attend_torch(self, layer: Any, query: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, plan: StepPlan, causal: bool,
                      rope: torch.nn.Module, output: torch.Tensor) -> torch.Tensor:
        """The pure-torch alternative: the reference kernel on position-free keys, un-rotated
        from the cache by their home positions (only the blocks the step reads)."""
        assert plan.home_slots is not None
        for batch in plan.off_home_chunks:
            keys, values, table = self._position_free_pages(
                layer, key_cache, value_cache, batch.global_block_table, plan.home_slots, rope)
            sub_out = paged_attention_rope_ref(
                query[batch.rows], keys, values, table, batch.seq_lens, batch.query_start_loc,
                rope.cos_sin_cache, rope.rotary_dim, rope.is_neox_style, self.scale,
                causal=bool(causal),
                key_start=None if plan.key_start is None else plan.key_start[batch.rows],
            )
            output[batch.rows] = sub_out
        return output


def _scheduler_metadata(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        isa: str, kv_cache_dtype: str, qsl: torch.Tensor, seq_lens: torch.Tensor,
                        causal: bool, window: int = -1) -> torch.Tensor:
    """vLLM's C++ kernel's work split for these rows (what every call of the kernel needs);
    ``window``: the layer's sliding window (-1: none), which the split skips keys by."""
    return ops.cpu_attn_get_scheduler_metadata(
        num_reqs=seq_lens.numel(), num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, seq_lens=seq_lens, dtype=dtype, query_start_loc=qsl, causal=causal,
        sliding_window_size=window, isa=isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        kv_cache_dtype=kv_cache_dtype,
    )


class _LayerKernel:
    """vLLM's C++ writer and attention kernel bound to one layer (``masked_rows.PagedKernel``):
    how the masked rows' kept copy is written and read, the same ops as the cache's."""

    def __init__(self, impl: MinipicCPUAttentionImpl, layer: Any, dtype: torch.dtype) -> None:
        self.impl, self.layer, self.dtype = impl, layer, dtype
        self.window = impl.sliding_window  # the schedule depends on it: one per window

    def write(self, keys: torch.Tensor, values: torch.Tensor, pages: torch.Tensor,
              slots: torch.Tensor) -> None:
        key_pages, value_pages = pages.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(keys, values, key_pages, value_pages, slots,
                                       self.layer.isa, k_scale=self.layer._k_scale_float,
                                       v_scale=self.layer._v_scale_float,
                                       kv_cache_dtype=self.impl.kv_cache_dtype)

    def schedule(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        impl = self.impl
        return _scheduler_metadata(impl.num_heads, impl.num_kv_heads, impl.head_size, self.dtype,
                                   self.layer.isa, impl.kv_cache_dtype, query_start_loc,
                                   seq_lens, True, impl.sliding_window)

    def attend(self, query: torch.Tensor, pages: torch.Tensor, query_start_loc: torch.Tensor,
               seq_lens: torch.Tensor, block_table: torch.Tensor, scheduler: torch.Tensor,
               out: torch.Tensor) -> None:
        key_pages, value_pages = pages.chunk(2, dim=2)
        self.impl._attend(self.layer, query, key_pages, value_pages, out, query_start_loc,
                          seq_lens, block_table, scheduler, True, None)


def move_keys(layout: cpu_kv_layout.PageLayout, key_cache: torch.Tensor, fill: RotatedFill,
              rope: torch.nn.Module, target: torch.Tensor, on_pages: bool | None = None) -> None:
    """``target[fill.dest]`` = keys of ``fill.blocks`` moved by ``fill.offsets`` positions.

    One more rotation of the home keys by the offset, with the model's own rotary op and a table
    of offsets (``kernels.offset_cos_sin_cache``: the table's scale divided out), written in the
    page layout of vLLM's C++ kernel. Two ways, the same arithmetic element by element:

    * **on the pages** (column-major key pages, neox pairing: the vector kernels' layout): a
      page ``[D, bs]`` is one "head" of ``D * bs`` elements whose halves pair dim ``d`` with
      ``d + rotary_dim / 2`` at every token, and the offset is the same for all tokens of a
      block, so the op rotates the gathered pages in place with a table whose cos/sin repeat
      each frequency ``bs`` times. Gather, rotate, scatter: three passes, no transposes.
    * **on token rows** (any other layout, gptj pairing): the keys read as token rows through
      the measured layout, rotated, then packed back by the layout's permutation.

    ``on_pages``: force a way (None: on the pages whenever the layout and pairing allow).
    """
    num_kv_heads, block_size, head_size = key_cache.shape[1:]
    count = fill.blocks.numel()
    table, shift = _offset_table(rope, key_cache.dtype)
    if on_pages is None:
        on_pages = layout.column_major_keys() and rope.is_neox_style
    if on_pages:
        if not (layout.column_major_keys() and rope.is_neox_style):
            raise ValueError("rotating on the pages needs column-major key pages and neox "
                             "pairing")
        key = ("pages", key_cache.dtype, block_size)
        if key not in fill.derived:
            offsets, row_of = torch.unique(fill.offsets, return_inverse=True)
            cos, sin = table[offsets + shift].chunk(2, dim=1)
            page_table = torch.cat([cos.repeat_interleave(block_size, dim=1),
                                    sin.repeat_interleave(block_size, dim=1)], dim=1)
            fill.derived[key] = (page_table.contiguous(), row_of.repeat_interleave(num_kv_heads))
        page_table, rows = fill.derived[key]
        pages = key_cache.index_select(0, fill.blocks)  # [n, heads, bs, D]: [D, bs] pages
        ops.rotary_embedding(rows, pages.view(count * num_kv_heads, -1), None,
                             block_size * head_size, page_table, True)
        target.index_copy_(0, fill.dest, pages)
        return
    keys = layout.token_keys(key_cache, fill.blocks)  # [n * bs, heads * D]
    ops.rotary_embedding((fill.offsets + shift).repeat_interleave(block_size), keys, None,
                         head_size, table, rope.is_neox_style)
    plain = keys.view(count, block_size, num_kv_heads, head_size).transpose(1, 2)
    packed = layout.packed_keys(plain).view(count, num_kv_heads, block_size, head_size)
    target.index_copy_(0, fill.dest, packed)


def _offset_table(rope: torch.nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """``(table, shift)``: row ``offset + shift`` of ``table`` moves a key by ``offset``.

    Kept on the rotary module, which vLLM shares between all layers of a model (``get_rope``
    caches it), so the table (``2 * max_position`` rows) exists once per model and dtype.
    """
    tables = rope.__dict__.setdefault(OFFSET_TABLES_ATTR, {})
    if dtype not in tables:
        table = offset_cos_sin_cache(rope.cos_sin_cache, rope.rotary_dim)
        tables[dtype] = (table.to(dtype), rope.cos_sin_cache.shape[0] - 1)
    return tables[dtype]


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
