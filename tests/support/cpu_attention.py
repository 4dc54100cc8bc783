"""The position-free CPU attention backend on synthetic paged steps, without an engine: the
set-up ``tests/engine/test_position_free.py`` and ``tests/engine/test_hole_steps.py`` share.

``CpuAttention`` holds one ``MinipicCPUAttentionImpl`` over a fresh paged cache (16 blocks unless
told) and the pool of kept copies its metadata builder would hold, with vLLM's config lookup
faked for its dtype and ``MINIPIC_CPU_ATTN`` set to the path under test; a test plans each step
(``plan``: ``plan_step``, the C++ kernel's work split unless the path is ``torch``), checks the
plan, and runs the step (``forward``).
"""

from __future__ import annotations

import types
from typing import Any

import torch


def neox_rope(head_size: int, dtype: torch.dtype, max_position: int = 2048) -> Any:
    """vLLM's neox rotary embedding for ``head_size`` (positions up to ``max_position``)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        return get_rope(head_size=head_size, max_position=max_position, is_neox_style=True,
                        dtype=dtype)


class CpuAttention:
    """One backend instance and its paged cache; ``rotated``: the key shadow kept across steps."""

    def __init__(self, path: str, dtype: torch.dtype, rope: Any, rotated: Any, monkeypatch: Any,
                 *, heads: int, kv_heads: int, head: int, block: int, blocks: int = 16) -> None:
        import vllm._custom_ops as ops
        import vllm.v1.attention.backends.cpu_attn as cpu_attn

        from minipic.engine_ext.attention import cpu_backend as rab
        from minipic.engine_ext.attention.kept_pool import KeptPool
        from minipic.engine_ext.attention.step_plan import HomeSlots

        fake_config = types.SimpleNamespace(model_config=types.SimpleNamespace(dtype=dtype))
        monkeypatch.setattr(cpu_attn, "get_current_vllm_config", lambda: fake_config)
        monkeypatch.setenv(rab.ATTN_PATH_ENV, path)
        self.ops, self.rab, self.path, self.dtype, self.rotated = ops, rab, path, dtype, rotated
        self.heads, self.kv_heads, self.head, self.block = heads, kv_heads, head, block
        self.impl = rab.MinipicCPUAttentionImpl(heads, head, head**-0.5, kv_heads, None, None,
                                                "auto")
        self.impl.minipic_rope = rope
        self.layer = types.SimpleNamespace(isa=cpu_attn._get_attn_isa(dtype, block, head),
                                           _k_scale_float=1.0, _v_scale_float=1.0)
        self.kv_cache = torch.zeros(blocks, kv_heads, block, 2 * head, dtype=dtype)  # stock page
        self.home = HomeSlots(blocks)
        # the kept copies' pages: blocks of this cache the test reserves per request, as the
        # scheduler does (``reserve``); none reserved: every copy is built for its step
        self.kept = KeptPool(["layer"], block)
        self.kept.reserved = {}

    def reserve(self, request: str, pages: list[int]) -> None:
        """Blocks of the cache for ``request``'s kept copy (they must be in no table)."""
        assert self.kept.reserved is not None
        self.kept.reserved[request] = list(pages)

    def schedule(self, qsl: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """The C++ kernel's work split for a (sub-)batch."""
        return self.ops.cpu_attn_get_scheduler_metadata(
            seq_lens.numel(), self.heads, self.kv_heads, self.head, seq_lens, self.dtype, qsl,
            True, -1, self.layer.isa, False)

    def plan(self, qsl: torch.Tensor, seq_lens: torch.Tensor, table: torch.Tensor,
             slots: torch.Tensor, **step: Any) -> Any:
        """``plan_step`` for one step; ``step``: its ``key_start`` / ``positions``, if given."""
        return self.rab.plan_step(self.home, qsl, seq_lens, table, slots, self.block, self.path,
                                  None if self.path == "torch" else self.schedule, self.rotated,
                                  kept=self.kept, **step)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                qsl: torch.Tensor, seq_lens: torch.Tensor, table: torch.Tensor,
                slots: torch.Tensor, plan: Any) -> torch.Tensor:
        """The step through the backend's ``forward`` (output rows start as NaN)."""
        md = self.rab.MinipicCPUAttentionMetadata(
            num_actual_tokens=query.shape[0], max_query_len=int((qsl[1:] - qsl[:-1]).max()),
            query_start_loc=qsl, max_seq_len=int(seq_lens.max()), seq_lens=seq_lens,
            block_table=table, slot_mapping=slots, scheduler_metadata=self.schedule(qsl, seq_lens),
            causal=True, plan=plan,
        )
        out = torch.full_like(query, float("nan"))
        self.impl.forward(self.layer, query, key, value, self.kv_cache, md, out)
        return out
