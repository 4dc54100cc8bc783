"""Names of the calls minipic adds to vLLM's engine processes, shared by the engine and its
front-ends.

The front-ends (the embedded orchestrator, ``minipic serve``'s routes, ``minipic index``, the
benchmarks) ask the engine for minipic's counters by name: EngineCore utility methods through
``call_utility_async`` and worker methods through ``collective_rpc``, both vLLM extension points.
A name is the whole contract between the two sides, so each is spelled once, here, where both
layers can import it; ``engine_ext/vllm_surface/patches.py`` lists the methods themselves as
"adds" rows, with the vLLM class each is set on.
"""

from __future__ import annotations

# EngineCore utility methods (``EngineCore.<name>``, called with ``call_utility_async``)
HOLE_STATS_UTILITY = "minipic_hole_stats"  # engine steps per prompt, holes per step
SPAN_STORE_STATS_UTILITY = "minipic_span_store_stats"  # tokens loaded per tier, saves, fails
CHECKPOINT_STATS_UTILITY = "minipic_ckpt_stats"  # recurrent checkpoints kept and hit
CHECKPOINT_CONFIGURE_UTILITY = "minipic_ckpt_configure"  # the server's checkpoint plan

# Worker methods (called with ``collective_rpc``)
KEY_SHADOW_STATS_RPC = "minipic_key_shadow_stats"  # CPUWorker: the key shadow's memory
INDEX_FLUSH_RPC = "minipic_index_flush"  # ``minipic index``'s worker extension
