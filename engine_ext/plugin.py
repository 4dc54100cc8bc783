"""vLLM general-plugin entry point (``vllm.general_plugins`` -> ``engine_ext.plugin:register``).

vLLM loads every installed general plugin in each of its processes (API server, EngineCore,
workers). Installing minipic must not change stock vLLM, so ``register()`` does nothing unless
``MINIPIC_ENABLE=1`` — which minipic's own entry points (``minipic serve``, the embedded
orchestrator, the tests) set together with the span configuration. When enabled it installs:

* ``hash``  — SSEP/PDEP block hashing (``engine_ext/hashing/span_hashing.py``; used in the
  EngineCore);
* ``rope``  — unrotated keys + RoPE inside attention (``engine_ext/attention/cpu_backend.py`` and
  ``engine_ext/attention/unrotated_keys.py``) and span isolation
  (``engine_ext/attention/span_isolation.py``); used in the worker, where
  ``engine_ext/vllm_surface/integration_guard.py`` proves at the first opted-in step that both are
  on the path vLLM runs, and ``engine_ext/vllm_surface/request_gate.py`` refuses span requests
  in the front-end (HTTP 400) on a model that is not position-free; with it, the blocks of
  decoding span requests' kept copies, reserved with the request
  (``engine_ext/attention/kept_reservation.py``, EngineCore and worker);
* ``holes`` — with ``hash`` and ``rope``: the lookup continues past misses and computes only the
  holes (``engine_ext/holes/scheduler_lookup.py``; EngineCore);
* ``ckpt``  — sparse recurrent-state checkpoints for hybrid models
  (``engine_ext/recurrent/checkpoints.py``; used in the EngineCore, settings in
  ``MINIPIC_CKPT_CONFIG``). Not on by default; hybrid engines run with it instead of ``hash``.

Whatever the features, an EngineCore that minipic's launchers started (``MINIPIC_ENABLE`` set,
on or off) stops once its parent is gone (``engine_ext/vllm_surface/parent_watch.py``): a
killed script or ``minipic eval`` leaves no engine behind.

Measurements only: with ``MINIPIC_PROFILE_DIR`` set, ``register()`` also times the steps of
every process, stock engines included (``engine_ext/profiling/step_profile.py``); unset, it wraps
nothing.

Every vLLM method these features wrap is listed, with the vLLM version it was checked against,
in ``engine_ext/vllm_surface/patches.py``; a version or signature mismatch stops start-up with an
``EngineIntegrationError`` (no silent stock fallback). Patching is idempotent: vLLM may call
``register()`` more than once per process.
"""

from __future__ import annotations

import logging
import os

from minipic.span_contract.span_config import SpanConfig, enabled_features

logger = logging.getLogger("minipic.plugin")

_STATE: dict[str, object] = {"installed": frozenset()}


def active_state() -> dict[str, object]:
    """What this process has installed (for tests and the server's config endpoint)."""
    return dict(_STATE)


def register() -> None:
    from minipic.engine_ext.vllm_surface import parent_watch

    parent_watch.install()
    _register_features()
    # after the features: the profile times the plugin's wrappers with the code they wrap
    from minipic.engine_ext.profiling import step_profile

    step_profile.install_from_env(plugin_on=bool(_STATE["installed"]))


def _register_features() -> None:
    features = enabled_features()
    if not features:
        return
    config = SpanConfig.from_env()
    assert config is not None
    from minipic.engine_ext.vllm_surface import patches

    if "holes" in features and not {"hash", "rope"} <= features:
        raise patches.EngineIntegrationError(
            "minipic feature 'holes' needs 'hash' and 'rope' (hits after a miss are only sound "
            f"with span isolation in attention); features were {sorted(features)}")
    installed: set[str] = set()
    if "hash" in features:
        from minipic.engine_ext.hashing import span_hashing

        span_hashing.install(config)
        installed.add("hash")
        if "holes" in features:
            # Hits past a miss are only sound when the worker isolates spans (scheduler_lookup's
            # docstring), which comes with the position-free backend.
            from minipic.engine_ext.holes import scheduler_lookup

            scheduler_lookup.install()
            installed.add("holes")
            # the span store is a KV connector the lookup asks first; its counters are an
            # EngineCore utility, there whether or not a store is configured
            from minipic.engine_ext.span_store import stats as span_store_stats

            span_store_stats.install()
    if "rope" in features:
        # No fallback on ImportError: span hashing without position-free attention gives wrong
        # answers (tests/engine/test_position_free.py), so a broken import must stop the engine.
        from minipic.engine_ext.attention import cpu_backend, kept_reservation, span_isolation
        from minipic.engine_ext.attention.key_shadow import pool as key_shadow_pool
        from minipic.engine_ext.vllm_surface import integration_guard, request_gate

        cpu_backend.install(config)
        span_isolation.install(config)
        integration_guard.install()  # proves at run time that the two above are on the path
        kept_reservation.install()  # decoding span requests' copies: KV blocks of their own
        patches.verify_installed("kept")  # a part of "rope", not a feature of its own
        request_gate.install()  # span requests on a model that is not position-free: a 400
        key_shadow_pool.install_budget()
        installed.add("rope")
    if "ckpt" in features:
        from minipic.engine_ext.recurrent import checkpoints

        checkpoints.install()
        installed.add("ckpt")
    for feature in installed:  # every table row of an installed feature is in place
        patches.verify_installed(feature)
    _STATE.update(installed=frozenset(installed), config=config)
    logger.warning(
        "minipic plugin active in pid %d: features=%s block_size=%d ssep_id=%d pdep_id=%d "
        "pad_id=%d",
        os.getpid(), ",".join(sorted(installed)) or "none", config.block_size, config.ssep_id,
        config.pdep_id, config.pad_id,
    )
