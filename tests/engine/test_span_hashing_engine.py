"""SSEP/PDEP block hashing inside a real vLLM engine (CPU), plugin on vs off.

Counts are vLLM's own ``num_cached_tokens``. Prompts are built by the real prompt builder on the
real SmolLM2 tokenizer (the tiny model shares it), from fresh random text every run.
"""

from __future__ import annotations

import random

import pytest

from minipic.prompt_builder import PromptBuilder
from minipic.span_contract.span_config import SPANS_OPT_IN_KEY

pytestmark = [pytest.mark.engine, pytest.mark.shares("tiny_pic", "tiny_stock")]

WORDS = ("river mountain harbor lantern copper meadow violet orbit falcon quartz willow ember "
         "glacier tundra saffron cobalt prairie canyon beacon thistle").split()


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


@pytest.fixture(scope="module")
def builder() -> PromptBuilder:
    return PromptBuilder.from_pretrained(None, block_size=32, chat_template=False)


def cached(llm, ids: list[int], salt: str | None = None) -> int:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=list(ids))
    if salt:
        prompt["cache_salt"] = salt
    params = SamplingParams(max_tokens=1, extra_args={SPANS_OPT_IN_KEY: True})
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    return out.num_cached_tokens


def warm(llm, built, salt: str | None = None) -> None:
    for ids in built.span_prefills:
        cached(llm, ids, salt)


@pytest.mark.parametrize("profile", ["tiny_pic", "tiny_stock"])
def test_span_after_two_different_system_prompts(engines, builder, profile):
    llm = engines.get(profile)
    rng = random.Random()
    doc = sentence(rng, 60)
    a = builder.build(system=sentence(rng, 12), spans=[doc], question=sentence(rng, 8))
    b = builder.build(system=sentence(rng, 12), spans=[doc], question=sentence(rng, 8))
    warm(llm, a)
    warm(llm, b)  # the shared span is already warm; this warms b's system span
    cached(llm, a.prompt_token_ids)
    span_tokens = a.spans[1].end - a.spans[1].start
    got = cached(llm, b.prompt_token_ids)
    system_tokens = b.spans[0].end
    if profile == "tiny_pic":
        assert got == b.expected_cached_tokens == system_tokens + span_tokens
    else:  # stock vLLM: only the system prefix; the span's blocks chain from another prefix
        assert got == system_tokens


def test_same_span_at_two_offsets(engines, builder):
    llm = engines.get("tiny_pic")
    rng = random.Random()
    system, d1, d2 = sentence(rng, 10), sentence(rng, 50), sentence(rng, 30)
    first = builder.build(system=system, spans=[d1, d2], question=sentence(rng, 6))
    second = builder.build(system=system, spans=[d2], question=sentence(rng, 6))
    warm(llm, first)
    assert cached(llm, first.prompt_token_ids) == first.expected_cached_tokens
    d2_first = next(s for s in first.spans if s.kind == "span" and s.index == 1)
    d2_second = next(s for s in second.spans if s.kind == "span")
    assert d2_first.start != d2_second.start  # really a different offset
    assert cached(llm, second.prompt_token_ids) == second.expected_cached_tokens
    assert second.expected_cached_tokens == d2_second.end


@pytest.mark.parametrize("use_pdep", [True, False])
def test_pdep_question_block_needs_identical_prefix(engines, builder, use_pdep):
    """With PDEP the question's full block only hits after the same prompt; a plain block
    after a span chains from the (position-free) span hash and would hit after any prefix."""
    llm = engines.get("tiny_pic")
    rng = random.Random()
    cfg = builder.span_config
    doc = builder.build(system=None, spans=[sentence(rng, 40)], question="x").span_prefills[0]
    sys_a = builder.build(system=None, spans=[sentence(rng, 10)], question="x").span_prefills[0]
    sys_b = builder.build(system=None, spans=[sentence(rng, 10)], question="x").span_prefills[0]
    question = [rng.randrange(100, 40000) for _ in range(40)]  # one full block + 8
    question[0] = cfg.pdep_id if use_pdep else rng.randrange(100, 40000)
    for ids in (sys_a, sys_b, doc):
        cached(llm, ids)
    cached(llm, sys_a + doc + question)
    got = cached(llm, sys_b + doc + question)
    shared = len(sys_b) + len(doc)
    assert got == (shared if use_pdep else shared + 32)


def test_cache_salt_isolates_spans(engines, builder):
    llm = engines.get("tiny_pic")
    rng = random.Random()
    built = builder.build(system=sentence(rng, 10), spans=[sentence(rng, 45)],
                          question=sentence(rng, 6))
    system_ids, span_ids = built.span_prefills
    cached(llm, span_ids, salt="tenant-1")        # span warm under tenant-1 only
    cached(llm, system_ids, salt="tenant-2")
    cached(llm, system_ids)
    system_tokens = len(system_ids)
    # other salt, or no salt: the span must not be shared
    assert cached(llm, built.prompt_token_ids, salt="tenant-2") == system_tokens
    assert cached(llm, built.prompt_token_ids) == system_tokens
    # same salt: reused
    cached(llm, system_ids, salt="tenant-1")
    assert cached(llm, built.prompt_token_ids, salt="tenant-1") == built.expected_cached_tokens


def test_plugin_on_without_special_tokens_equals_stock(engines):
    """A mixed workload of plain prompts (fresh, repeated, shared prefixes, salted): the
    plugin-on engine reports exactly the stock engine's cached-token counts."""
    rng = random.Random()
    base = [rng.randrange(100, 40000) for _ in range(100)]
    workload = []
    # Every kind twice, in a fresh order: two "shared" or two "salted" prompts always share
    # full blocks, so the counts below can never all be zero by the luck of the draw.
    kinds = ["fresh", "repeat", "shared", "salted"] * 2
    rng.shuffle(kinds)
    for kind in ["fresh"] + kinds:
        if kind == "fresh" or not workload:
            workload.append(([rng.randrange(100, 40000) for _ in range(rng.randrange(20, 150))],
                             None))
        elif kind == "repeat":
            workload.append(rng.choice(workload))
        elif kind == "shared":
            workload.append((base[: rng.randrange(33, 100)] + [rng.randrange(100, 40000)] * 9,
                             None))
        else:
            workload.append((base, "s1"))
    counts = {}
    for profile in ("tiny_stock", "tiny_pic"):
        llm = engines.get(profile)
        llm.reset_prefix_cache()
        counts[profile] = [cached(llm, ids, salt) for ids, salt in workload]
    assert counts["tiny_pic"] == counts["tiny_stock"]
    assert any(counts["tiny_stock"])  # the workload really exercises the cache
