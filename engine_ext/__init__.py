"""minipic's vLLM plugin: position-independent KV caching inside vLLM's engine.

Rooms, one per feature (each keeps its scheduler / worker split in its module names):

* ``vllm_surface/`` — the patch table (every change to vLLM), its static check, the
  integration guard, and the names minipic sets on vLLM objects;
* ``hashing/`` — where the block hash is changed (SSEP / PDEP);
* ``holes/`` — the lookup past misses: compute only the holes of a prompt;
* ``attention/`` — where RoPE is applied (unrotated keys, rotated inside attention), span
  isolation, and the key shadow;
* ``span_store/`` — span KV kept outside the engine (RAM, disk, a shared directory); a store
  entry is read in ``span_store/tiers/format.py``;
* ``recurrent/`` — sparse recurrent-state checkpoints of hybrid models;
* ``profiling/`` — the step profile.

The entry points sit on top: ``plugin`` (vLLM's ``general_plugins``) installs the features,
``endpoints`` adds minipic's HTTP routes to vLLM's server.
"""
