"""The layout's arrows point down, and each package's public names are docs/api.md's.

Layers (``docs/api.md``): the app ``minipic`` on top; ``serving`` (servers, the Ray Serve
cluster, documents laid out server-side) and ``integrations`` (LangChain, LlamaIndex) over the
SDK ``orchestrator``; ``engine_ext`` (vLLM plugin); ``prompt_builder``; the contract
``span_contract``; pure math ``kernels`` and ``checkpoint_planner`` at the bottom.
Every import statement of every module is read (function-level imports too), so a lazy import
cannot hide an upward arrow.

One import name: the layers are sub-packages of ``minipic`` (in a checkout, links from
``minipic/<layer>`` to the top-level folders), and nothing imports a layer by its bare folder
name -- that would load a second copy of the module beside ``minipic.<layer>``'s.
"""

from __future__ import annotations

import ast
import importlib
import re
import types
from pathlib import Path

import pytest
from support.source_scan import spelled_constants

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]
OURS = ("minipic", "serving", "integrations", "orchestrator", "engine_ext", "prompt_builder",
        "span_contract", "kernels", "checkpoint_planner")
LAYERS = OURS[1:]  # sub-packages of minipic; "minipic" alone is the app


def _module_name(package: str) -> str:
    return package if package == "minipic" else f"minipic.{package}"


def _files(package: str) -> list[Path]:
    """The ``.py`` files of a top-level folder (the app's without its links to the layers)."""
    paths = sorted((ROOT / package).rglob("*.py"))
    if package == "minipic":
        paths = [p for p in paths if p.relative_to(ROOT).parts[1] not in LAYERS]
    return paths
# package -> the packages of ours it may import
ALLOWED = {
    "minipic": set(OURS),
    # the server side: one supervised server, or the Ray Serve cluster and its router (which
    # hashes requests with the engine plugin's own hasher)
    # documents on the standard routes lay prompts out and prefill spans with the SDK's own
    # builder and scheduler (serving/documents), so the server side sits above both
    "serving": {"engine_ext", "span_contract", "prompt_builder", "orchestrator"},
    # framework glue beside the SDK: it uses the SDK, the SDK never imports it
    "integrations": {"orchestrator", "prompt_builder", "span_contract"},
    "orchestrator": {"prompt_builder", "span_contract"},
    "engine_ext": {"span_contract", "kernels", "checkpoint_planner"},
    "prompt_builder": {"span_contract"},
    "span_contract": {"checkpoint_planner"},
    "kernels": set(),
    "checkpoint_planner": set(),
}


def _imported_modules(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "minipic":  # from minipic import orchestrator, Orchestrator...
                found += [f"minipic.{alias.name}" for alias in node.names]
            else:
                found.append(node.module)
    return found


def _imports(path: Path) -> set[str]:
    """The layers (or "minipic", the app) a module imports."""
    found = set()
    for module in _imported_modules(path):
        parts = module.split(".")
        if parts[0] != "minipic":
            continue
        found.add(parts[1] if len(parts) > 1 and parts[1] in LAYERS else "minipic")
    return found


@pytest.mark.parametrize("package", OURS)
def test_no_import_points_up(package: str) -> None:
    bad = {}
    for path in _files(package):
        up = _imports(path) - ALLOWED[package] - {package}
        if up:
            bad[str(path.relative_to(ROOT))] = sorted(up)
    assert not bad, f"{package} imports packages above it: {bad}"


def test_layers_are_imported_under_minipic_only() -> None:
    """``import engine_ext`` would work from a checkout and load a second copy of every module
    beside ``minipic.engine_ext``'s (two registries, two ``isinstance`` worlds); in an installed
    wheel it fails. Every module of the repository uses the one name."""
    bare = []
    for folder in (*OURS, "benchmarks", "examples", "tools", "tests"):
        for path in _files(folder):
            bare += [f"{path.relative_to(ROOT)}: {m}" for m in _imported_modules(path)
                     if m.split(".")[0] in LAYERS]
    assert not bare, bare
    for layer in LAYERS:
        link = ROOT / "minipic" / layer
        assert link.is_symlink() and link.resolve() == ROOT / layer, layer


def _readme_api() -> dict[str, set[str]]:
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    section = text.split("## Public API", 1)[1].split("\n## ", 1)[0]
    table: dict[str, set[str]] = {}
    for match in re.finditer(r"^\| `(\w+)` \| (.*) \|$", section, re.M):
        table[match.group(1)] = set(re.findall(r"`(\w+)`", match.group(2)))
    return table


def test_public_names_are_the_documented_ones() -> None:
    documented = _readme_api()
    assert set(documented) == set(OURS)
    for package in OURS:
        exported = set(getattr(importlib.import_module(_module_name(package)), "__all__", ()))
        assert exported == documented[package], (
            f"{package}: exported but undocumented {sorted(exported - documented[package])}, "
            f"documented but not exported {sorted(documented[package] - exported)}")


def test_one_exception_tree() -> None:
    """Every error class of every package derives from MinipicError, defined once."""
    from minipic.span_contract.errors import MinipicError

    for package in OURS:
        for path in _files(package):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ClassDef) and node.name.endswith("Error"):
                    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
                    module = module if package == "minipic" else f"minipic.{module}"
                    cls = getattr(importlib.import_module(module), node.name)
                    assert issubclass(cls, MinipicError), f"{module}.{node.name}"


def test_every_minipic_variable_is_named_in_the_env_module() -> None:
    """``span_contract/env.py`` is the one list of ``MINIPIC_*`` variables: no other module of
    the packages, benchmarks, tools or tests spells one, and ``docs/env.md`` documents each."""
    from minipic.span_contract import env

    listed = {v.name for v in env.VARIABLES}
    constants = {v for k, v in vars(env).items() if k.endswith("_ENV")}
    assert listed == constants, f"constants without a row: {sorted(constants - listed)}"
    paths = [path for folder in (*OURS, "benchmarks", "tools", "tests")
             for path in _files(folder) if path != ROOT / "span_contract" / "env.py"]
    spelled = spelled_constants(paths, r"MINIPIC_[A-Z0-9_]+", ROOT)
    assert not spelled, f"MINIPIC_* names spelled outside span_contract/env.py: {spelled}"
    docs = (ROOT / "docs" / "env.md").read_text(encoding="utf-8")
    assert not [name for name in listed if f"`{name}`" not in docs], "docs/env.md is missing some"


def test_every_name_imported_from_our_packages_exists() -> None:
    """Lazy imports (inside functions, for vLLM's processes) run only on their code path, so a
    renamed name would fail there first; here every ``from <ours> import name`` of the packages,
    benchmarks, examples and tests is resolved now, and so is every ``module.attribute`` read
    through a module imported that way."""
    ours = ("minipic", "support")
    missing = []
    for folder in (*OURS, "benchmarks", "examples", "tools", "tests"):
        for path in _files(folder):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            modules: dict[str, types.ModuleType] = {}
            for node in ast.walk(tree):
                if not (isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                        and node.module.split(".")[0] in ours):
                    continue
                module = importlib.import_module(node.module)
                for alias in node.names:
                    value = getattr(module, alias.name, None)
                    if value is None and alias.name != "*":
                        try:
                            value = importlib.import_module(f"{node.module}.{alias.name}")
                        except ImportError:
                            missing.append(f"{path.relative_to(ROOT)}:{node.lineno} "
                                           f"{node.module}.{alias.name}")
                    if isinstance(value, types.ModuleType):
                        modules[alias.asname or alias.name] = value
            for node in ast.walk(tree):
                if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                        and node.value.id in modules
                        and not hasattr(modules[node.value.id], node.attr)):
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno} "
                                   f"{node.value.id}.{node.attr}")
    assert not missing, missing
