"""Editors and type checkers resolve every import of a plain checkout (``tools/check_imports.py``:
mypy's import resolution, which does not follow the editable install's import hook), and the
check can fail: a module importing a name that does not exist is reported."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from check_imports import unresolved  # noqa: E402


def test_every_import_resolves_from_the_checkout(tmp_path) -> None:
    # the probe lives outside the checkout: tests in the other lane read every file of it
    probe = tmp_path / "probe_unresolved.py"
    probe.write_text("from minipic.no_such_layer import anything  # noqa: F401\n")
    found = unresolved((probe,))
    assert [line for line in found if probe.name in line], "the check cannot fail"
    assert [line for line in found if probe.name not in line] == []
