"""Installing minipic must not change stock vLLM: the plugin acts only when enabled (what it
does when enabled: ``test_vllm_surface``, in one vLLM import with the patch table's checks)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.fast

PROBE = """
import json
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.v1.core import kv_cache_utils
from vllm.v1.engine import core
from minipic.engine_ext.plugin import active_state
print(json.dumps({
    "kcu_patched": getattr(kv_cache_utils.get_request_block_hasher, "_minipic", False),
    "core_patched": getattr(core.get_request_block_hasher, "_minipic", False),
    "installed": sorted(active_state()["installed"]),
}))
"""


def run_probe(env_extra: dict[str, str]) -> dict:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("MINIPIC_")}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_plugin_is_inert_when_not_enabled():
    state = run_probe({})
    assert state == {"kcu_patched": False, "core_patched": False, "installed": []}

