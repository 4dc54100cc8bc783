"""Families that are not position-free are refused per request, and keep serving plain ones.

One engine per family (``support/model_families.py``), each in the family runner's process
(``support/family_checks.FamilyRunner``): the verdict names the family's reason
(docs/models.md), an opted-in request gets ``VLLMValidationError`` in the front-end before it
reaches the worker, and a plain request on the same engine answers. The same path end to end
through a real server, under concurrent load: ``tests/serving/test_unsupported_model.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
from support.model_families import FAMILIES

REFUSED = tuple(f.name for f in FAMILIES if not f.position_free)

pytestmark = [pytest.mark.engine, pytest.mark.shares("family_engines")]


@pytest.mark.parametrize("name", REFUSED)
def test_family_is_refused_per_request(name: str, seed: int, family_engines: Any) -> None:
    family_engines.run(name, seed)
