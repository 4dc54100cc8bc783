"""pytest plugin (``-p minipic_patched``): vLLM's tests with minipic's engine patches installed.

``MINIPIC_UPSTREAM_MODE`` chooses what runs:

* ``stock``   — nothing installed (the baseline, same interpreter and tree);
* ``patched`` — the EngineCore features ``minipic serve`` installs, ``hash`` and ``holes``
  (``engine_ext/hashing/span_hashing.py``, ``engine_ext/holes/scheduler_lookup.py``), requests not
  opted in: PIC off must be stock vLLM;
* ``optin``   — the same, and every request is treated as opted into span semantics, with
  marker ids outside any vocabulary vLLM's tests use: span hashing without markers, and the
  lookup past misses, must still be stock behaviour.

The ``rope`` feature patches the worker (attention, model loading), which these scheduler tests
never build; ``ckpt`` changes which recurrent states are kept by design, so vLLM's hybrid
retention tests are not its oracle (``tests/engine/test_recurrent_checkpoints.py`` is).

The hasher factory here builds minipic's span hasher directly: the production factory also
checks the engine's config (hybrid refusal, block size equal to the span config), which needs a
running EngineCore, while these tests build hashers of many block sizes without one.
``MINIPIC_UPSTREAM_REPORT`` names a JSON file that gets what was installed and how often it ran,
so the caller can tell a patched run from one where the patches never took part.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Any

from minipic.span_contract.env import UPSTREAM_MODE_ENV, UPSTREAM_REPORT_ENV

MODE_ENV = UPSTREAM_MODE_ENV
REPORT_ENV = UPSTREAM_REPORT_ENV
MODES = ("stock", "patched", "optin")
# far outside every vocabulary vLLM's tests draw token ids from
MARKER_IDS = {"ssep_id": 1_000_000_001, "pdep_id": 1_000_000_002, "pad_id": 1_000_000_003}

_COUNTS: Counter[str] = Counter()


def _install(mode: str) -> list[str]:
    from minipic.engine_ext.hashing import span_hashing
    from minipic.engine_ext.holes import scheduler_lookup as hole_lookup
    from minipic.engine_ext.vllm_surface import patches
    from minipic.span_contract.span_config import SpanConfig

    config = SpanConfig(block_size=16, **MARKER_IDS)

    def factory(stock: Any) -> Any:
        def get_request_block_hasher(hash_block_size: int, caching_hash_fn: Any) -> Any:
            _COUNTS["span_hashers_built"] += 1
            hasher = span_hashing.make_span_block_hasher(hash_block_size, caching_hash_fn,
                                                         config)

            def counted(request: Any) -> list[Any]:
                _COUNTS["span_hasher_calls"] += 1
                return hasher(request)

            return counted

        return get_request_block_hasher

    hashers = [p.target for p in patches.points("hash") if p.target.endswith("block_hasher")]
    patches.apply("hash", {
        **{target: factory for target in hashers},
        "vllm.v1.core.sched.scheduler:Scheduler.__init__": span_hashing._wrap_scheduler_init,
    })
    hole_lookup.install()
    for feature in ("hash", "holes"):
        patches.verify_installed(feature)
    if mode == "optin":
        def opted_in(sampling_params: Any) -> bool:
            _COUNTS["opt_in_checks"] += 1
            return True

        span_hashing.spans_opted_in = opted_in
        hole_lookup.spans_opted_in = opted_in
        stock_find = hole_lookup.find_cached_runs

        def find_cached_runs(*args: Any) -> Any:
            runs = stock_find(*args)
            _COUNTS["hole_lookups"] += 1
            _COUNTS["hole_runs_found"] += len(runs)
            return runs

        hole_lookup.find_cached_runs = find_cached_runs
    return sorted(f"{p.feature}:{p.target}" for p in patches.PATCH_POINTS
                  if p.feature in ("hash", "holes") and p.applies_here())


def pytest_configure(config: Any) -> None:
    """Before collection: vLLM's test modules import the hasher factory by name."""
    mode = os.environ.get(MODE_ENV, "stock")
    if mode not in MODES:
        raise ValueError(f"{MODE_ENV}={mode!r}; expected one of {MODES}")
    installed = [] if mode == "stock" else _install(mode)
    config._minipic_upstream = {"mode": mode, "installed": installed}


def pytest_unconfigure(config: Any) -> None:
    path = os.environ.get(REPORT_ENV)
    state = getattr(config, "_minipic_upstream", None)
    if path and state is not None:
        with open(path, "w") as f:
            json.dump({**state, "counts": dict(_COUNTS)}, f)
