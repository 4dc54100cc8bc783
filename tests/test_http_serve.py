"""`minipic serve` over HTTP with a plain httpx client: the same cached-token counts as the
in-process engine, and a config endpoint a client can check its span ids against."""

from __future__ import annotations

import random

import httpx
import pytest

from prompt_builder import PromptBuilder
from span_contract.span_config import SPANS_OPT_IN_KEY

pytestmark = pytest.mark.server

WORDS = "amber basalt cedar delta ember fjord granite harbor iris juniper".split()


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)) + "."


def http_cached(base_url: str, ids: list[int], salt: str | None = None) -> int:
    body = {"model": "minipic", "prompt": ids, "max_tokens": 1,
            "vllm_xargs": {SPANS_OPT_IN_KEY: True}}
    if salt:
        body["cache_salt"] = salt
    resp = httpx.post(base_url + "/v1/completions", json=body, timeout=120)
    resp.raise_for_status()
    details = resp.json()["usage"]["prompt_tokens_details"] or {}
    return details.get("cached_tokens") or 0


def local_cached(llm, ids: list[int], salt: str | None = None) -> int:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=ids)
    if salt:
        prompt["cache_salt"] = salt
    params = SamplingParams(max_tokens=1, extra_args={SPANS_OPT_IN_KEY: True})
    return llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens


def test_config_endpoint_matches_client_builder(smol_server):
    builder = PromptBuilder.from_pretrained(None, block_size=32)
    cfg = httpx.get(smol_server.base_url + "/minipic/config", timeout=10).json()
    assert cfg["enabled"] is True
    assert set(cfg["features"]) >= {"hash"}
    assert cfg["span_config"] == builder.span_config.model_dump()


def test_http_and_in_process_see_same_cached_tokens(smol_server, engines):
    builder = PromptBuilder.from_pretrained(None, block_size=32)
    rng = random.Random()
    docs = [text(rng, 40), text(rng, 25), text(rng, 55)]
    system = text(rng, 12)
    first = builder.build(system=system, spans=docs, question=text(rng, 6))
    second = builder.build(system=system, spans=[docs[2], docs[0]], question=text(rng, 6))
    salt = f"tenant-{rng.random()}"
    sequence = ([(ids, None) for ids in first.span_prefills]
                + [(first.prompt_token_ids, None), (second.prompt_token_ids, None),
                   (second.prompt_token_ids, salt)])
    llm = engines.get("smol_pic")
    over_http = [http_cached(smol_server.base_url, ids, s) for ids, s in sequence]
    in_process = [local_cached(llm, ids, s) for ids, s in sequence]
    assert over_http == in_process
    assert over_http[-3] == first.expected_cached_tokens
    assert over_http[-2] == second.expected_cached_tokens  # reordered spans, new offsets
    assert over_http[-1] == 0  # a salted tenant shares nothing
