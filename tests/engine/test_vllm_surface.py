"""Every change minipic makes to vLLM is in the patch table, and engine_ext's rooms stay apart.

* Enabled, the plugin patches both bindings of vLLM's block hasher and installs exactly the
  features asked for (``test_plugin_states`` checks that it is inert when not enabled).
* The methods minipic adds to vLLM classes are rows of kind "adds": installed, each carries its
  row's mark and parameters; a vLLM that already defines the name is refused.
* Every attribute minipic sets on vLLM objects is named in ``engine_ext/vllm_surface/added_names``
  and spelled nowhere else.
* No two public functions of ``engine_ext`` share a name, and its feature rooms import each
  other only in the documented direction.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.source_scan import spelled_constants

from minipic.span_contract.span_config import SpanConfig

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]
ENGINE_EXT = ROOT / "engine_ext"

FEATURES = ("hash", "holes", "rope", "ckpt")
PROBE = """
import inspect, json
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.v1.core import kv_cache_utils
from vllm.v1.engine import core
from minipic.engine_ext.plugin import active_state
from minipic.engine_ext.span_store import stats
stats.install()
from minipic.engine_ext.vllm_surface import patches
from minipic.engine_ext.vllm_surface.added_names import PATCH_MARK_ATTR
rows = []
for p in patches.PATCH_POINTS:
    if p.kind != "adds" or not p.applies_here():
        continue
    owner, attr, value = patches._resolve(p.target)
    rows.append({"target": p.target, "feature": p.feature, "params": list(p.params),
                 "got": list(inspect.signature(value).parameters),
                 "marked": f"{p.feature}:{p.target}" in getattr(value, PATCH_MARK_ATTR, ())})
print(json.dumps({
    "rows": rows,
    "kcu_patched": getattr(kv_cache_utils.get_request_block_hasher, "_minipic", False),
    "core_patched": getattr(core.get_request_block_hasher, "_minipic", False),
    "installed": sorted(active_state()["installed"]),
}))
"""


@pytest.fixture(scope="module")
def enabled_plugin() -> dict:
    """What a fresh process with the plugin enabled sees (one vLLM import for the module)."""
    cfg = SpanConfig(block_size=32, ssep_id=5, pdep_id=11, pad_id=16)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MINIPIC_")}
    env.update(cfg.to_env(FEATURES))
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_enabled_plugin_patches_every_binding_and_installs_what_was_asked(
        enabled_plugin: dict) -> None:
    assert enabled_plugin["kcu_patched"] is True and enabled_plugin["core_patched"] is True
    assert enabled_plugin["installed"] == sorted(FEATURES)


def test_added_methods_are_table_rows_installed_with_their_parameters(
        enabled_plugin: dict) -> None:
    from minipic.engine_ext.vllm_surface import patches

    rows = enabled_plugin["rows"]
    expected = {p.target for p in patches.PATCH_POINTS if p.kind == "adds" and p.applies_here()}
    assert {r["target"] for r in rows} == expected and len(expected) >= 5
    for row in rows:
        assert row["marked"], row
        assert row["got"] == row["params"], row


def test_a_vllm_that_defines_the_name_itself_is_refused(monkeypatch) -> None:
    from vllm.v1.engine.core import EngineCore

    from minipic.engine_ext.vllm_surface import patches
    from minipic.span_contract.engine_utilities import SPAN_STORE_STATS_UTILITY

    target = f"vllm.v1.engine.core:EngineCore.{SPAN_STORE_STATS_UTILITY}"
    monkeypatch.setattr(EngineCore, SPAN_STORE_STATS_UTILITY, lambda self: "vLLM's own",
                        raising=False)
    assert any("defines" in issue for issue in patches._addition_problems(
        next(p for p in patches.PATCH_POINTS if p.target == target)))
    with pytest.raises(patches.EngineIntegrationError, match="defines"):
        patches.add("store", {target: lambda engine_core: None})
    assert getattr(EngineCore, SPAN_STORE_STATS_UTILITY)(None) == "vLLM's own"  # untouched
    with pytest.raises(patches.EngineIntegrationError, match="not rows of kind 'adds'"):
        patches.add("store", {"vllm.v1.engine.core:EngineCore.minipic_unlisted": print})


def _python_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_minipic_attribute_on_vllm_objects_is_named_in_one_module() -> None:
    from minipic.engine_ext.vllm_surface import added_names

    names = set(added_names.ALL.values())
    assert len(names) == len(added_names.ALL), "two constants name one attribute"
    paths = [p for p in _python_files(ENGINE_EXT) + _python_files(ROOT / "serving")
             if p.name != "added_names.py"]
    spelled = spelled_constants(paths, r"_minipic_\w+", ROOT)
    assert not spelled, f"attribute names spelled outside added_names: {spelled}"


def _public_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
            and not n.name.startswith("_")]


def test_no_two_public_functions_of_engine_ext_share_a_name() -> None:
    seen: dict[str, list[str]] = {}
    for path in _python_files(ENGINE_EXT):
        for name in _public_functions(path):
            seen.setdefault(name, []).append(str(path.relative_to(ROOT)))
    # every feature module has an ``install`` (the plugin calls each by its module)
    shared = {n: files for n, files in seen.items() if len(files) > 1 and n != "install"}
    assert not shared, shared


# engine_ext's rooms, and the rooms each may import (besides itself and the layers below
# engine_ext). The vLLM surface is the floor; the entry points (plugin, endpoints) the roof.
ROOMS = {
    "vllm_surface": {"attention"},  # the integration guard asks attention what it installed
    "profiling": {"vllm_surface"},
    "hashing": {"vllm_surface"},
    "attention": {"vllm_surface", "holes"},  # a holed step's positions come from holes' worker
    "holes": {"vllm_surface", "hashing", "attention"},
    "span_store": {"vllm_surface", "hashing", "holes", "attention"},
    "recurrent": {"vllm_surface"},
    "plugin.py": {"vllm_surface", "profiling", "hashing", "attention", "holes", "recurrent",
                  "span_store"},
    "endpoints.py": {"span_store"},
}


def _room(path: Path) -> str:
    rel = path.relative_to(ENGINE_EXT)
    return rel.parts[0]


def test_engine_ext_rooms_import_in_the_documented_direction() -> None:
    bad = {}
    for path in _python_files(ENGINE_EXT):
        if path.parent == ENGINE_EXT and path.name == "__init__.py":
            continue
        room = _room(path)
        assert room in ROOMS, f"{path.relative_to(ROOT)} is in no known room of engine_ext"
        used = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                parts = node.module.split(".")
                if parts[0] == "engine_ext" and len(parts) > 1:
                    target = parts[1] + (".py" if parts[1] in ("plugin", "endpoints") else "")
                    used.add(target)
                elif node.module == "engine_ext":
                    used |= {a.name for a in node.names}
        wrong = used - ROOMS[room] - {room}
        if wrong:
            bad[str(path.relative_to(ROOT))] = sorted(wrong)
    assert not bad, f"imports across engine_ext's rooms that the room map does not allow: {bad}"
