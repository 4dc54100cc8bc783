"""`minipic serve` over HTTP with a plain httpx client: the same cached-token counts as the
in-process engine, and a config endpoint a client can check its span ids against."""

from __future__ import annotations

import random

import httpx
import pytest

from minipic.prompt_builder import PromptBuilder
from minipic.span_contract.span_config import SPANS_OPT_IN_KEY

pytestmark = [pytest.mark.server, pytest.mark.shares("smol_server", "smol_pic")]

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
    assert cfg["span_config"] == builder.span_config.model_dump(mode="json")


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


def _first_logprob(base_url: str, prompt: list[int] | str, salt: str | None = None,
                   opt_in: bool = False) -> tuple[float, int]:
    """First generated token's logprob and the prompt's cached tokens, over plain HTTP."""
    body: dict = {"model": "minipic", "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
                  "logprobs": 1}
    if salt:
        body["cache_salt"] = salt
    if opt_in:
        body["vllm_xargs"] = {SPANS_OPT_IN_KEY: True}
    resp = httpx.post(base_url + "/v1/completions", json=body, timeout=120)
    resp.raise_for_status()
    data = resp.json()
    details = data["usage"]["prompt_tokens_details"] or {}
    return data["choices"][0]["logprobs"]["token_logprobs"][0], details.get("cached_tokens") or 0


def test_plain_client_text_never_changes_attention(smol_server):
    """A client that did not opt in: SSEP (``<file_sep>``) at a block boundary of its prompt
    neither reuses a span cached by an SDK request after other text, nor changes attention —
    its logprobs equal the same request under a fresh salt (which can hit nothing)."""
    builder = PromptBuilder.from_pretrained(None, block_size=32)
    cfg = builder.span_config
    rng = random.Random()
    ordinary = [rng.randrange(200, 40000) for _ in range(200)]
    ordinary = [t for t in ordinary if t not in (cfg.ssep_id, cfg.pdep_id, cfg.pad_id)]
    span = [cfg.ssep_id, *ordinary[:63]]  # two blocks led by SSEP
    before_a, before_b = ordinary[64:96], ordinary[96:128]
    # An SDK request caches the span after prefix A (span semantics: span-local hashes).
    _first_logprob(smol_server.base_url, before_a + span + [cfg.pdep_id, 5000], opt_in=True)
    plain = before_b + span + ordinary[128:140]
    lp, cached = _first_logprob(smol_server.base_url, plain)
    fresh_lp, fresh_cached = _first_logprob(smol_server.base_url, plain,
                                            salt=f"fresh-{rng.random()}")
    assert cached == 0 and fresh_cached == 0, "a plain request reused span-hashed blocks"
    assert abs(lp - fresh_lp) < 1e-4
    # The same through text: "<file_sep>" in an ordinary prompt is just text to minipic.
    text_prompt = text(rng, 20) + " <file_sep> " + text(rng, 30)
    lp_text, _ = _first_logprob(smol_server.base_url, text_prompt)
    fresh_text, _ = _first_logprob(smol_server.base_url, text_prompt, salt=f"f-{rng.random()}")
    assert abs(lp_text - fresh_text) < 1e-4


def test_official_openai_client_cold_and_warm_agree(smol_server):
    """The official ``openai`` client, as an application would use it: a span-laid-out prompt
    sent cold (no span prefill) and after its prefills gives the same text; the warm one reports
    the layout's cached tokens; streaming and chat work for a plain client."""
    import openai

    client = openai.OpenAI(base_url=smol_server.base_url + "/v1", api_key="unused",
                           max_retries=0, timeout=120)
    builder = PromptBuilder.from_pretrained(None, block_size=32)
    rng = random.Random()
    built = builder.build(system=text(rng, 10), spans=[text(rng, 40), text(rng, 30)],
                          question="Which words appear twice?")
    salt = f"openai-{rng.random()}"
    spans = {"vllm_xargs": {SPANS_OPT_IN_KEY: True}, "cache_salt": salt}

    def complete(ids: list[int], max_tokens: int = 8):
        return client.completions.create(model="minipic", prompt=ids, max_tokens=max_tokens,
                                         temperature=0.0, extra_body=spans)

    cold = complete(built.prompt_token_ids)
    assert cold.usage.prompt_tokens_details.cached_tokens in (0, None)
    # warm in a fresh salt scope, so nothing the cold request cached can be reused
    spans["cache_salt"] = salt + "-warm"
    for ids in built.span_prefills:
        complete(ids, max_tokens=1)
    warm = complete(built.prompt_token_ids)
    assert warm.usage.prompt_tokens_details.cached_tokens == built.expected_cached_tokens
    assert warm.choices[0].text == cold.choices[0].text
    streamed = client.completions.create(model="minipic", prompt=built.prompt_token_ids,
                                         max_tokens=8, temperature=0.0, stream=True,
                                         extra_body=spans)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cold.choices[0].text
    chat = client.chat.completions.create(
        model="minipic", max_tokens=4, temperature=0.0,
        messages=[{"role": "user", "content": "Say hello. <file_sep> Then stop."}])
    assert chat.choices[0].message.content is not None and chat.usage.completion_tokens <= 4
