"""The client-engine contract: what both halves of minipic must agree on, at the bottom of the
layout (nothing here imports the app, the client or the engine extension).

* ``span_config`` — block size and the SSEP / PDEP / PAD ids; per-request span opt-in;
* ``special_tokens`` — which vocabulary ids a model family uses for them;
* ``models`` — where the default model and the test models come from (offline);
* ``engine_config`` — the engine settings minipic starts vLLM with (``EngineSettings``);
* ``checkpoint_config`` — settings of the sparse recurrent-checkpoint feature;
* ``tiktoken_offline`` — offline tokenizer tables for token budgets;
* ``errors`` — the one exception tree users catch by kind.
"""
