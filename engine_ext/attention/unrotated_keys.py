"""Model side of the position-free KV cache: keys reach the KV cache *unrotated*.

Stock vLLM attention modules of the Llama family (Llama, Mistral, SmolLM2, ...) and Qwen2/Qwen3
all do::

    q, k = self.rotary_emb(positions, q, k)   # RoPE on q and k        (qwen3: after q/k-norm)
    attn_output = self.attn(q, k, v)          # k is written to the KV cache in here

Rather than copying those forwards, we replace each supported module's ``rotary_emb`` attribute
(per instance; the shared ``get_rope`` module itself is untouched) with :class:`QueryOnlyRotary`,
which rotates ``q`` with the very same module and hands ``k`` through unchanged. For Qwen3 that is
the q/k-normed, unrotated key, as required. The original rotary module is given to the layer's
attention impl as ``impl.minipic_rope``; the impl applies it to keys at their logical positions
(``engine_ext/attention/cpu_backend.py``, ``engine_ext/attention/cuda_backend.py``). So RoPE on
queries happens here, RoPE on keys happens inside the attention backend, both from the model's own
table.

When: right after the model is constructed (we wrap the loader's ``initialize_model``), before
weights are loaded and before any forward or torch.compile trace. A module is converted only if
(a) its class is one we have checked, (b) its rotary module rotates by a plain table lookup at
``positions`` (RoPE variants that only change ``cos_sin_cache``: default, llama3, linear, NTK,
yarn; not MRoPE, dual-chunk, Phi-3 long-rope, FoPE) and (c) its attention impl is a position-free
backend that accepts it. Anything else keeps stock behaviour (rotated keys), logged once, so
an unsupported model still runs correctly with PIC off.

torch.compile: the swap is part of the traced model. vLLM's AOT compile cache key does not see
plugin code by itself, so minipic puts its settings and a hash of its engine code into vLLM's
``additional_config`` (``span_contract.engine_config``), which is part of that key.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch

# Under "vllm." so that vLLM's log configuration (level, process prefix) applies in the worker.
logger = logging.getLogger("vllm.minipic.unrotated_keys")

# Attention classes whose forward is exactly "rotary_emb(positions, q, k) then attn(q, k, v)".
# Subclasses are included (MistralAttention derives from LlamaAttention).
SUPPORTED_ATTENTION = (
    ("vllm.model_executor.models.llama", "LlamaAttention"),
    ("vllm.model_executor.models.qwen2", "Qwen2Attention"),
    ("vllm.model_executor.models.qwen3", "Qwen3Attention"),
)

_STATE: dict[str, Any] = {"installed": False, "converted": 0}


class QueryOnlyRotary(torch.nn.Module):
    """Stands in for a module's ``rotary_emb``: rotates queries, leaves keys unrotated."""

    def __init__(self, rope: torch.nn.Module) -> None:
        super().__init__()
        self.rope = rope

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        query, _ = self.rope(positions, query, None)
        return query, key


def table_lookup_rope(rope: Any) -> bool:
    """Whether ``rope`` rotates by ``cos_sin_cache[positions]`` and nothing else.

    True for ``RotaryEmbedding`` and subclasses that only override how the table is built
    (``_compute_inv_freq`` / ``_compute_cos_sin_cache``); those are exactly the variants the
    attention backend reproduces by calling the module at logical key positions.
    """
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    if not isinstance(rope, RotaryEmbedding):
        return False
    cls = type(rope)
    return all(
        getattr(cls, name) is getattr(RotaryEmbedding, name)
        for name in ("forward", "forward_native", "forward_cpu", "forward_cuda", "forward_static")
    ) and not getattr(rope, "use_flashinfer", False)


def _supported_classes() -> tuple[type, ...]:
    """The supported attention classes whose modules are already imported (by the model)."""
    classes = []
    for module_name, cls_name in SUPPORTED_ATTENTION:
        module = sys.modules.get(module_name)
        if module is not None and hasattr(module, cls_name):
            classes.append(getattr(module, cls_name))
    return tuple(classes)


def convert_model(model: torch.nn.Module) -> int:
    """Make every supported attention module of ``model`` pass keys unrotated.

    Returns how many modules were converted. Idempotent (a converted module is skipped).
    """
    classes = _supported_classes()
    converted, skipped = 0, {}
    for name, module in list(model.named_modules()):
        attn = getattr(module, "attn", None)
        rope = getattr(module, "rotary_emb", None)
        if attn is None or rope is None or isinstance(rope, QueryOnlyRotary):
            continue
        impl = getattr(attn, "impl", None)
        if not classes or not isinstance(module, classes):
            skipped[name] = f"attention class {type(module).__name__} not supported"
        elif not table_lookup_rope(rope):
            skipped[name] = f"rotary variant {type(rope).__name__} not supported"
        elif not getattr(impl, "position_free_capable", False):
            skipped[name] = f"attention backend {type(impl).__name__} is not position-free"
        elif reason := impl.rope_unsupported_reason(rope):
            skipped[name] = reason
        else:
            module.rotary_emb = QueryOnlyRotary(rope)
            impl.minipic_rope = rope
            converted += 1
    if skipped:
        first = next(iter(skipped.items()))
        logger.warning(
            "minipic: %d attention module(s) keep stock rotated keys, so spans cannot be reused "
            "at new offsets there (first: %s: %s)", len(skipped), *first,
        )
    _STATE["converted"] += converted
    if converted:
        logger.info("minipic: %d attention module(s) store unrotated keys; RoPE on keys is "
                    "applied inside the attention backend", converted)
    return converted


def converted_count() -> int:
    """Attention modules converted in this process (the backend sizes KV pages by it)."""
    return int(_STATE["converted"])


def install() -> None:
    """Convert models right after the loader constructs them (idempotent, lazy).

    Wraps ``initialize_model`` as seen by ``base_loader`` (its ``create_model`` looks the name up
    at call time). Harmless in processes that never build a model.
    """
    if _STATE["installed"]:
        return
    from minipic.engine_ext.vllm_surface import patches

    def factory(original: Any) -> Any:
        def initialize_model(*args: Any, **kwargs: Any) -> torch.nn.Module:
            model = original(*args, **kwargs)
            convert_model(model)
            return model

        initialize_model.__wrapped__ = original  # type: ignore[attr-defined]
        return initialize_model

    patches.apply("rope", {
        "vllm.model_executor.model_loader.base_loader:initialize_model": factory})
    _STATE["installed"] = True
