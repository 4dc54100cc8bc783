"""A worker extension that breaks one of minipic's worker-side hooks the way a vLLM change would
(``tests/engine/test_integration_guard.py``). Not a fixture for anything else.

vLLM imports a ``worker_extension_cls`` module in each worker after the general plugins are
loaded and before the model runner and model are built, which is exactly where a different
vLLM would diverge. ``MINIPIC_TEST_SABOTAGE`` picks the break:

* ``runner-override``: the CPU runner gets its own ``_build_attention_metadata`` (the stock body),
  so the wrapper on ``GPUModelRunner`` is installed but never runs (as with vLLM's V2 runner);
* ``forged-mark``: the same, carrying minipic's patch mark, so only the run-time check can see it;
* ``foreign-backend``: ``CPU_ATTN`` resolves to vLLM's stock backend again, so the model's
  attention layers are not position-free.
"""

from __future__ import annotations

import os

from minipic.span_contract.env import TEST_SABOTAGE_ENV

MODE = os.environ.get(TEST_SABOTAGE_ENV, "")

if MODE in ("runner-override", "forged-mark"):
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from minipic.engine_ext.attention import span_isolation
    from minipic.engine_ext.vllm_surface import patches

    stock = GPUModelRunner._build_attention_metadata.__wrapped__

    def _build_attention_metadata(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        return stock(self, *args, **kwargs)

    if MODE == "forged-mark":
        setattr(_build_attention_metadata, patches.PATCH_MARK_ATTR,
                frozenset({f"rope:{span_isolation.TARGET}"}))
    CPUModelRunner._build_attention_metadata = _build_attention_metadata
elif MODE == "foreign-backend":
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN,
                     "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend")
elif MODE:
    raise ValueError(f"MINIPIC_TEST_SABOTAGE={MODE!r}")


class Sabotage:
    """The extension class vLLM mixes into the worker (adds nothing; the import did the work)."""
