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
from support.family_checks import check_refused, start
from support.model_families import FAMILIES, warm_model_infos

from minipic.span_contract.engine_config import close_llm
from minipic.span_contract.env import ALL_FAMILIES_ENV

REFUSED = tuple(f for f in FAMILIES if not f.position_free)

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(os.environ.get(ALL_FAMILIES_ENV) != "1",
                       reason=f"one engine per refused family: set {ALL_FAMILIES_ENV}=1"),
]


@pytest.fixture(scope="module", autouse=True)
def _model_infos() -> None:
    warm_model_infos(REFUSED)


@pytest.mark.parametrize("family", REFUSED, ids=[f.name for f in REFUSED])
def test_family_is_refused_per_request(family, seed: int) -> None:
    llm = start(family)
    try:
        check_refused(llm, family, seed)
    finally:
        close_llm(llm)
