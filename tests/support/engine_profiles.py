"""The engine configurations the tests share, by name (``engines.get(name)`` in a test).

Each profile is started at most once per lane and shared by every module that declares it
(``pytest.mark.shares``): an eager engine costs ~40 s to start on 2 cores.
"""

from __future__ import annotations

from typing import Any

# Overlap depths the hybrid checkpoint profile plans for: half the requests reuse 1200 tokens of a
# cached prefix, half 1800 (depths 0..2048 = max_model_len). The engine's recurrent block g
# depends on the CPU (288 or 544 tokens, see tests/engine/test_recurrent_checkpoints.py); with
# budget 2 the dp plan is two multiples of g below the two depths, leaving the first boundary g
# unplanned.
QWEN3NEXT_CKPT_HISTOGRAM = [0.5 if t in (1200, 1800) else 0.0 for t in range(2049)]

# profile name -> EngineSettings overrides. fp32 so outputs can be compared tightly (the hybrid
# profiles run bf16: vLLM's CPU GDN kernel accepts nothing else; its recurrent state is fp32).
ENGINE_PROFILES: dict[str, dict[str, Any]] = {
    "smol_pic": dict(model=None, pic=True),
    "smol_stock": dict(model=None, pic=False),
    "tiny_pic": dict(model="tiny-llama", pic=True),
    "tiny_stock": dict(model="tiny-llama", pic=False),
    "tiny_hash_only": dict(model="tiny-llama", pic=True, features=("hash",)),
    # spans whose sink sits a gap before their text (SpanConfig.sink_gap); 40: no block multiple
    "tiny_pic_gap": dict(model="tiny-llama", pic=True, sink_gap=40),
    # tiny Qwen3-Next hybrid with sparse recurrent checkpoints (span hashing refuses hybrids)
    "qwen3next_ckpt": dict(model="tiny-qwen3-next", pic=True, features=("ckpt",),
                           dtype="bfloat16",
                           ckpt=dict(budget=2, method="dp", histogram=QWEN3NEXT_CKPT_HISTOGRAM)),
    # the same, with the recurrent state's dtype forced (vLLM's choice depends on the CPU): the
    # test of the dtype this CPU does not choose uses one of them
    **{f"qwen3next_ckpt_{dtype}": dict(
        model="tiny-qwen3-next", pic=True, features=("ckpt",), dtype="bfloat16",
        ckpt=dict(budget=2, method="dp", histogram=QWEN3NEXT_CKPT_HISTOGRAM),
        extra={"mamba_ssm_cache_dtype": dtype}) for dtype in ("bfloat16", "float32")},
    # the same model without prefix caching: the reference for exact resumption
    "qwen3next_nocache": dict(model="tiny-qwen3-next", pic=False, dtype="bfloat16",
                              prefix_caching=False),
}
