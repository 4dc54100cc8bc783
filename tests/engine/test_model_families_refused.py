"""Families that are not position-free are refused per request, and keep serving plain ones.

One engine per family (``support/model_families.py``): the verdict names the family's reason
(docs/models.md), an opted-in request gets ``VLLMValidationError`` in the front-end before it
reaches the worker, and a plain request on the same engine answers. Each start costs ~40 s on 2
cores, so the default suite holds the refusal end to end on one family through a real server
(``tests/serving/test_unsupported_model.py``) and the proof's reasons on vLLM's own classes
(``tests/engine/test_rotary_proof.py``); ``ALL_FAMILIES_ENV=1`` (span_contract/env.py) runs every
refused family here.
"""

from __future__ import annotations

import os

import pytest
from support.family_checks import model_infos_fixture, run_family
from support.model_families import FAMILIES

from minipic.span_contract.env import ALL_FAMILIES_ENV

REFUSED = tuple(f.name for f in FAMILIES if not f.position_free)

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(os.environ.get(ALL_FAMILIES_ENV) != "1",
                       reason=f"one engine per refused family: set {ALL_FAMILIES_ENV}=1"),
]

_model_infos = model_infos_fixture(REFUSED)


@pytest.mark.parametrize("name", REFUSED)
def test_family_is_refused_per_request(name: str, seed: int) -> None:
    run_family(name, seed)
