"""Model side of the position-free KV cache: keys reach the KV cache *unrotated*.

Most of vLLM's decoder attention modules (Llama, Mistral, Qwen2/3 and their MoE variants,
Mixtral, Granite, GLM-4, Gemma, ...) do::

    q, k = self.rotary_emb(positions, q, k)   # RoPE on q and k        (qwen3: after q/k-norm)
    attn_output = self.attn(q, k, v)          # k is written to the KV cache in here

Rather than copying those forwards, we replace each fitting module's ``rotary_emb`` attribute
(per instance; the shared ``get_rope`` module itself is untouched) with :class:`QueryOnlyRotary`,
which rotates ``q`` with the very same module and hands ``k`` through unchanged. For Qwen3 that is
the q/k-normed, unrotated key, as required. The original rotary module is given to the layer's
attention impl as ``impl.minipic_rope``; the impl applies it to keys at their logical positions
(``engine_ext/attention/cpu_backend.py``, ``engine_ext/attention/cuda_backend.py``). So RoPE on
queries happens here, RoPE on keys happens inside the attention backend, both from the model's own
table.

When: right after the model is constructed (we wrap the loader's ``initialize_model``), before
weights are loaded and before any forward or torch.compile trace. A module is converted only if
(a) its own ``forward`` is proven to have that shape (``engine_ext/attention/rotary_proof.py``:
no class list to keep up), (b) its rotary module rotates by a plain table lookup at
``positions`` (RoPE variants that only change ``cos_sin_cache``: default, llama3, linear, NTK,
yarn; not MRoPE, dual-chunk, Phi-3 long-rope, FoPE) and (c) its attention impl is a position-free
backend that accepts it. Anything else keeps stock behaviour (rotated keys), logged once with the
reason, so an unsupported model still runs correctly with PIC off; its span requests are refused
per request before they reach the worker (``engine_ext/vllm_surface/request_gate.py``).

torch.compile: the swap is part of the traced model. vLLM's AOT compile cache key does not see
plugin code by itself, so minipic puts its settings and a hash of its engine code into vLLM's
``additional_config`` (``span_contract.engine_config``), which is part of that key.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from minipic.engine_ext.vllm_surface.added_names import ROTATED_KEYS_REASON_ATTR

# Under "vllm." so that vLLM's log configuration (level, process prefix) applies in the worker.
logger = logging.getLogger("vllm.minipic.unrotated_keys")

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


def _attention_layer(module: torch.nn.Module) -> bool:
    """Whether ``module`` is one of vLLM's attention layers whose KV cache holds keys (recurrent
    layers, also ``AttentionLayerBase``, hold state, not keys: ``engine_ext/recurrent``)."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    return isinstance(module, AttentionLayerBase) and not isinstance(module, MambaBase)


def convert_model(model: torch.nn.Module) -> int:
    """Make every attention module of ``model`` that provably fits pass keys unrotated.

    A module fits when :mod:`rotary_proof` shows, on its own ``forward``, that RoPE is the last
    thing done to q and k before its attention layer, its rotary module is a plain table lookup,
    and the layer's backend accepts it (``rope_unsupported_reason``). Every other module that
    owns an attention layer keeps stock rotated keys, with the reason kept on its layers
    (:func:`refusal`; the model's verdict, ``integration_guard.worker_model_support``, names
    the first).
    Returns how many modules were converted. Idempotent (a converted module is skipped).
    """
    from minipic.engine_ext.attention import rotary_proof

    converted, skipped = 0, {}
    for name, module in list(model.named_modules()):
        layers = [c for c in module.children() if _attention_layer(c)]
        if not layers or any(isinstance(c, QueryOnlyRotary) for c in module.children()):
            continue
        shape, reason = rotary_proof.prove(module)
        if shape is None:
            skipped[name] = reason
            continue
        rope = getattr(module, shape.rope_attr, None)
        attn = getattr(module, shape.attn_attr, None)
        impl = getattr(attn, "impl", None)
        if attn is None or not _attention_layer(attn):
            skipped[name] = f"self.{shape.attn_attr} is not a vLLM attention layer"
        elif not table_lookup_rope(rope):
            skipped[name] = f"rotary variant {type(rope).__name__} not supported"
        elif not getattr(impl, "position_free_capable", False):
            skipped[name] = f"attention backend {type(impl).__name__} is not position-free"
        elif reason := impl.rope_unsupported_reason(rope):
            skipped[name] = reason
        elif windowed(impl) and not getattr(impl, "logical_windows", False):
            skipped[name] = (f"sliding window (backend {type(impl).__name__} cannot count it in "
                             f"real tokens: docs/design.md §2)")
        else:
            setattr(module, shape.rope_attr, QueryOnlyRotary(rope))
            impl.minipic_rope = rope
            if windowed(impl):
                keep_every_block(attn)
            converted += 1
    if skipped:
        first = next(iter(skipped.items()))
        logger.warning(
            "minipic: %d attention module(s) keep stock rotated keys, so spans cannot be reused "
            "at new offsets there; span requests are refused on this model (first: %s: %s)",
            len(skipped), *first,
        )
    _STATE["converted"] += converted
    for name, reason in skipped.items():  # on the layers themselves: one model's, not the process's
        for layer in model.get_submodule(name).children():
            if _attention_layer(layer):
                layer.__dict__[ROTATED_KEYS_REASON_ATTR] = reason
    if converted:
        logger.info("minipic: %d attention module(s) store unrotated keys; RoPE on keys is "
                    "applied inside the attention backend", converted)
    return converted


def windowed(impl: Any) -> bool:
    """Whether an attention impl has a sliding window (vLLM's impls: -1 or None when not)."""
    return getattr(impl, "sliding_window", None) not in (None, -1)


def keep_every_block(attn: torch.nn.Module) -> None:
    """Give vLLM a full-attention KV spec for a windowed layer whose impl counts the window in
    real tokens: vLLM frees a windowed layer's blocks by *physical* distance, never shorter
    than the logical one, so it would drop blocks a query still sees under the layout rule
    (docs/design.md §2). The impl keeps its ``sliding_window`` and applies it in attention.
    Costs the memory a window would save (the layer's blocks live as long as a full
    attention layer's)."""
    attn.sliding_window = None  # read by Attention.get_kv_cache_spec, after the model is built


def refusal(layer: torch.nn.Module) -> str | None:
    """Why ``layer`` (an attention layer) was left with rotated keys (None: not refused here)."""
    return layer.__dict__.get(ROTATED_KEYS_REASON_ATTR)


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
