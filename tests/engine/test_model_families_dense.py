"""Dense model families beyond Llama: position-free, equal to the layout-rule reference.

One seeded tiny random model per family (``support/model_families.py``), one engine each, the
checks of ``support/family_checks.py``: warm, cold and after-an-unprefilled-prompt finals equal
the transformers reference under the layout rule, ``selective@1`` equals the plain prompt, and a
layout-visible reference is told apart. The table users read is docs/models.md.
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.shares("family_engines")]

FAMILIES = ("Mistral", "Qwen2", "Qwen3", "Phi-3", "Granite", "GLM-4")


@pytest.mark.parametrize("name", FAMILIES)
def test_family_is_position_free(name: str, seed: int, family_engines: Any) -> None:
    family_engines.run(name, seed)
