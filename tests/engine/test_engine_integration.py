"""The plugin refuses an incompatible vLLM loudly, in a fresh process
(``engine_ext/vllm_surface/patches.py``).

A vLLM upgrade that moves or changes a method minipic wraps must stop the engine at start-up
with a message naming the feature, the target and both versions — never run with part of the
plugin silently off (span hashing without span isolation gives wrong answers). Each case runs
in its own interpreter, because patches are process-wide.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from minipic.engine_ext.vllm_surface.patches import PATCH_POINTS, VLLM_CHECKED, table
from minipic.span_contract.env import ALLOW_VLLM_VERSION_ENV
from minipic.span_contract.span_config import SpanConfig

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]
CONFIG = SpanConfig(block_size=32, ssep_id=5, pdep_id=11, pad_id=16)

# A vLLM "upgrade": the scheduler's chunk clip gets another signature.
BREAK_SIGNATURE = """
import vllm.v1.core.sched.scheduler as s
def _reserve_prefill_lookahead(self, request, num_new_tokens):
    return num_new_tokens
s.Scheduler._reserve_prefill_lookahead = _reserve_prefill_lookahead
"""
BREAK_VERSION = "import vllm\nvllm.__version__ = '0.99.0'\n"


def _run(prelude: str, body: str, env_extra: dict[str, str], tmp_path: Path,
         timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``body`` in a fresh interpreter whose every process first runs ``prelude``
    (a ``sitecustomize`` on PYTHONPATH, so spawned engine processes get it too)."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(prelude)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MINIPIC_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), env.get("PYTHONPATH", "")])
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(body)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


LOAD = """
from vllm.plugins import load_general_plugins
load_general_plugins()
print("LOADED")
"""


def test_changed_signature_stops_plugin_load(tmp_path: Path) -> None:
    proc = _run(BREAK_SIGNATURE, LOAD, CONFIG.to_env(), tmp_path)
    assert proc.returncode != 0 and "LOADED" not in proc.stdout
    err = proc.stderr
    assert "EngineIntegrationError" in err and "'holes'" in err, err[-3000:]
    assert "Scheduler._reserve_prefill_lookahead" in err and "num_computed_tokens" in err


def test_other_vllm_version_stops_plugin_load_unless_allowed(tmp_path: Path) -> None:
    proc = _run(BREAK_VERSION, LOAD, CONFIG.to_env(), tmp_path)
    assert proc.returncode != 0 and "LOADED" not in proc.stdout
    assert "vLLM 0.99.0 is installed" in proc.stderr and VLLM_CHECKED in proc.stderr
    allowed = _run(BREAK_VERSION, LOAD,
                   {**CONFIG.to_env(), ALLOW_VLLM_VERSION_ENV: "0.99.0"}, tmp_path)
    assert allowed.returncode == 0 and "LOADED" in allowed.stdout, allowed.stderr[-3000:]
    # plugin off: an incompatible vLLM is none of minipic's business
    off = _run(BREAK_VERSION, LOAD, {}, tmp_path)
    assert off.returncode == 0 and "LOADED" in off.stdout, off.stderr[-3000:]


def test_engine_refuses_to_start_on_incompatible_vllm(tmp_path: Path) -> None:
    """A real engine start (tiny model): it fails with the table's message, it does not run."""
    body = """
    from minipic.span_contract.engine_config import EngineSettings, build_llm

    if __name__ == "__main__":
        llm = build_llm(EngineSettings(model="tiny-llama", max_model_len=512))
        print("STARTED")
    """
    proc = _run(BREAK_SIGNATURE, body, {"VLLM_CPU_KVCACHE_SPACE": "1"}, tmp_path, timeout=600)
    assert proc.returncode != 0 and "STARTED" not in proc.stdout
    assert "EngineIntegrationError" in proc.stderr, proc.stderr[-3000:]
    assert "Scheduler._reserve_prefill_lookahead" in proc.stderr


def test_table_covers_every_wrapped_target() -> None:
    rows = table()
    assert len(rows) == len(PATCH_POINTS) and all(f"{VLLM_CHECKED} (run)" in r["checked_against"]
                                                  for r in rows)
    assert {r["feature"] for r in rows} == {"hash", "holes", "rope", "kept", "ckpt", "route",
                                             "documents", "store"}
    assert {r["kind"] for r in rows} == {"wraps", "adds"}
    assert all(r["why"] for r in rows)


def _fake_vllm_config(additional: dict, enforce_eager: bool):
    import types

    return types.SimpleNamespace(
        additional_config=additional,
        model_config=types.SimpleNamespace(enforce_eager=enforce_eager, is_hybrid=False),
        cache_config=types.SimpleNamespace(block_size=CONFIG.block_size),
    )


def test_span_config_must_travel_in_vllm_config() -> None:
    """vLLM's compile cache keys on its config: the span config the plugin runs must be in it
    (compiled engines refuse to start without it), and must be the same one."""
    from minipic.engine_ext.hashing.span_hashing import check_supported
    from minipic.span_contract.engine_config import EngineSettings
    from minipic.span_contract.errors import EngineIntegrationError

    settings = EngineSettings(model="tiny-llama", span_config=CONFIG).resolved()
    extra = settings.additional_config()
    assert extra["minipic"]["span_config"] == CONFIG.model_dump(mode="json")
    assert len(extra["minipic"]["plugin_code"]) == 16
    argv = settings.server_argv("127.0.0.1", 1, "m")
    assert argv[argv.index("--additional-config") + 1] == json.dumps(extra)
    check_supported(_fake_vllm_config(extra, enforce_eager=False), CONFIG)  # compiled, matching
    check_supported(_fake_vllm_config({}, enforce_eager=True), CONFIG)  # eager: env suffices
    with pytest.raises(EngineIntegrationError, match="additional_config"):
        check_supported(_fake_vllm_config({}, enforce_eager=False), CONFIG)
    other = {"minipic": {**extra["minipic"], "span_config": {**CONFIG.model_dump(),
                                                             "ssep_id": 6}}}
    with pytest.raises(EngineIntegrationError, match="span_config"):
        check_supported(_fake_vllm_config(other, enforce_eager=True), CONFIG)
    assert EngineSettings(model="tiny-llama", pic=False).resolved().additional_config() == {}


def test_span_hashing_still_refuses_hybrid_models(tmp_path: Path) -> None:
    """A recurrent state depends on the whole prefix: span hashing (and hits past misses) on a
    hybrid model would be false hits, so the engine refuses to start with it."""
    body = """
    from minipic.span_contract.engine_config import EngineSettings, build_llm

    if __name__ == "__main__":
        build_llm(EngineSettings(model="tiny-qwen3-next", dtype="bfloat16", max_model_len=1024))
        print("STARTED")
    """
    proc = _run("", body, {"VLLM_CPU_KVCACHE_SPACE": "1"}, tmp_path, timeout=600)
    assert proc.returncode != 0 and "STARTED" not in proc.stdout
    assert "HybridModelNotSupportedError" in proc.stderr, proc.stderr[-3000:]
