"""Mixture-of-experts model families: position-free, equal to the layout-rule reference.

One seeded tiny random model per family (``support/model_families.py``), one engine each, the
checks of ``support/family_checks.py``: warm, cold and after-an-unprefilled-prompt finals equal
the transformers reference under the layout rule, ``selective@1`` equals the plain prompt, and a
layout-visible reference is told apart. The table users read is docs/models.md.
"""

from __future__ import annotations

import pytest
from support.family_checks import model_infos_fixture, run_family

pytestmark = pytest.mark.engine

FAMILIES = ("Qwen2-MoE", "Qwen3-MoE", "Mixtral")
_model_infos = model_infos_fixture(FAMILIES)


@pytest.mark.parametrize("name", FAMILIES)
def test_family_is_position_free(name: str, seed: int) -> None:
    run_family(name, seed)
