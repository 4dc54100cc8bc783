"""Families with sliding-window layers, position-free and equal to the layout-rule reference:
Gemma 2 (windows on alternate layers, logit soft-capping), Gemma 3 (q/k norm, two RoPE bases) and
GPT-OSS (windows on alternate layers, learned per-head attention sinks, MoE).

One seeded tiny random model per family (``support/model_families.py``), one engine each, the
checks of ``support/family_checks.py``: warm, cold and after-an-unprefilled-prompt finals equal
the transformers reference under the layout rule, ``selective@1`` equals the plain prompt, and a
layout-visible reference is told apart. Here the prompts are longer than the window (64), so the
rule that a window counts real tokens (docs/design.md §2) is held: a reference that counts it in
physical slots, or not at all, is told apart, and ``selective@1`` still equals the plain prompt.
The table users read is docs/models.md.
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.shares("family_engines")]

FAMILIES = ("Gemma 2", "Gemma 3", "GPT-OSS")


@pytest.mark.parametrize("name", FAMILIES)
def test_family_is_position_free(name: str, seed: int, family_engines: Any) -> None:
    family_engines.run(name, seed)
