"""The client-engine contract: what both halves of minipic must agree on, at the bottom of the
layout (nothing here imports the app, the client or the engine extension).

* ``span_config`` — block size and the SSEP / PDEP / PAD ids; per-request span opt-in;
* ``special_tokens`` — which vocabulary ids a model family uses for them;
* ``models`` — where the default model and the test models come from (offline);
* ``engine_config`` — the engine settings minipic starts vLLM with (``EngineSettings``);
* ``cpu_runtime`` — tcmalloc and Intel OpenMP preloaded into vLLM's CPU engine processes;
* ``checkpoint_config`` — settings of the sparse recurrent-checkpoint feature;
* ``tiktoken_offline`` — offline tokenizer tables for token budgets;
* ``errors`` — the one exception tree users catch by kind.
"""

from minipic.span_contract import errors
from minipic.span_contract.errors import *  # noqa: F403  (the exception tree: errors.__all__)
from minipic.span_contract.span_config import (
    ROUTE_AS_KEY,
    SPANS_OPT_IN_KEY,
    SpanConfig,
    spans_opted_in,
)

# Light on purpose: vLLM's processes import this package through the plugin. Engine settings,
# models and checkpoint settings are imported from their modules (span_contract.engine_config,
# span_contract.models, span_contract.checkpoint_config).
__all__ = [
    "ROUTE_AS_KEY",
    "SPANS_OPT_IN_KEY",
    "SpanConfig",
    "spans_opted_in",
    *errors.__all__,
]
