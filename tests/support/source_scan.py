"""Reading the repository's own sources in tests: which string constants spell a name.

Why by AST and not grep: a name mentioned in a docstring or a comment is documentation; a
string constant that *is* the name is a second place that spells it (and can drift).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path


def spelled_constants(paths: Iterable[Path], pattern: str, root: Path) -> dict[str, list[str]]:
    """``{constant: [file, ...]}`` for every string constant of ``paths`` that fully matches
    ``pattern`` (files relative to ``root``)."""
    found: dict[str, list[str]] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and re.fullmatch(pattern, node.value)):
                found.setdefault(node.value, []).append(str(path.relative_to(root)))
    return found
