"""All holes of a prompt in one engine step, in a real vLLM engine (CPU, fp32, tiny llama).

Steps are counted by the scheduler (``minipic_hole_stats``, an EngineCore utility call), never
by timing. Every output is checked against the transformers references of
``tests/engine/test_span_reuse.py`` (block mask for opted-in prompts, plain causal for the rest):

* a ``boundary_recompute`` final with 4 passages (5 holes: 4 heads and the question) finishes
  its prefill in **1 step**; a prompt whose holes exceed the token budget takes exactly
  ``ceil(hole tokens / budget)`` steps;
* KV pressure preempts a multi-hole request mid-prefill, another is aborted mid-prefill:
  the block pool's free count comes back whole, and the preempted one's output equals the
  reference;
* one batch of multi-hole prefills, decodes and plain (not opted-in) requests: each equals its
  reference (plain ones: stock vLLM's causal model), and the holed prompts still took one step.

The existing warm / cold / evicted / batched / boundary references
(``tests/engine/test_span_reuse.py``, ``tests/engine/test_position_free.py``) run on the same code
unchanged.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator

import pytest
from support.pic_engine import generate, pic_sampling, random_prompt
from support.pic_reference import (
    REFERENCE_TOL,
    PicReference,
    build_pic_prompt,
    random_ordinary_ids,
    reference_error,
    span_part_runs,
)

from minipic.engine_ext.recurrent.checkpoints import call_engine
from minipic.span_contract.engine_utilities import HOLE_STATS_UTILITY

pytestmark = [pytest.mark.engine, pytest.mark.shares("tiny_pic")]

BUDGET = 64  # tokens per step of the small engine
POOL_BLOCKS = 33  # KV blocks of the small engine (32 usable: one is vLLM's null block)


@pytest.fixture(scope="module")
def small_engine(engines) -> Iterator[object]:
    """A tiny engine with a 64-token step budget and a 33-block pool; vLLM's full-sequence
    admission gate off, so KV pressure preempts running prefills instead of holding them."""
    from minipic.span_contract.engine_config import EngineSettings, build_llm, close_llm

    llm = build_llm(EngineSettings(
        model="tiny-llama", pic=True, max_model_len=1024,
        extra={"max_num_batched_tokens": BUDGET, "max_num_seqs": 4,
               "num_gpu_blocks_override": POOL_BLOCKS, "scheduler_reserve_full_isl": False}))
    yield llm
    close_llm(llm)


@pytest.fixture(scope="module")
def tiny_ref(engines) -> Iterator[PicReference]:
    yield PicReference(engines.get("tiny_pic").minipic_settings.model)


def _stats(llm) -> dict:
    return call_engine(llm, HOLE_STATS_UTILITY)


def _steps_of(llm, request_id: str) -> dict:
    """The scheduler's record of a finished prefill (engine ids carry a suffix)."""
    for entry in reversed(_stats(llm)["recent"]):
        rid = entry["request_id"]
        if rid == request_id or rid.startswith(f"{request_id}-"):
            return entry
    raise AssertionError(f"no prefill record for request {request_id}")


def test_boundary_recompute_with_four_passages_is_one_step(engines, tiny_ref, seed) -> None:
    from minipic.prompt_builder import PromptBuilder

    llm = engines.get("tiny_pic")
    cfg = llm.minipic_settings.span_config
    builder = PromptBuilder.from_pretrained(None, block_size=cfg.block_size,
                                            chat_template=False)
    rng = random.Random(seed)
    words = "amber basalt cedar delta ember fjord granite harbor iris juniper kelp".split()
    docs = [" ".join(rng.choice(words) for _ in range(rng.randrange(50, 110))) for _ in range(4)]
    built = builder.build(system="Answer from the documents.", spans=docs,
                          question="Which word comes first?", mode="boundary_recompute")
    generate(llm, built.span_prefills, pic_sampling(max_tokens=1))
    out = generate(llm, [built.prompt_token_ids], pic_sampling())[0]
    assert out.num_cached_tokens == built.expected_cached_tokens, f"seed={seed}"
    record = _steps_of(llm, out.request_id)
    holes = len(built.prompt_token_ids) - built.expected_cached_tokens
    assert record["steps"] == 1 and record["computed_tokens"] == holes, f"{record} seed={seed}"
    runs = span_part_runs(built)
    assert sum(part == "whole" for _, _, part in runs) == 4
    err = reference_error(out, built.prompt_token_ids, runs, tiny_ref)
    assert err < REFERENCE_TOL, f"off the reference by {err:.2e} (seed={seed})"


def test_holes_beyond_the_budget_take_ceil_steps(small_engine, tiny_ref, seed) -> None:
    llm = small_engine
    rng = random.Random(seed)
    prompt = random_prompt(llm, rng, tiny_ref.vocab_size,
                     [rng.randrange(20, 60), rng.randrange(70, 150), rng.randrange(20, 60),
                      rng.randrange(40, 120), rng.randrange(20, 60)])
    warm = [0, 2, 4]
    llm.reset_prefix_cache()
    generate(llm, [prompt.span_prefills[i] for i in warm], pic_sampling(max_tokens=1))
    out = generate(llm, [prompt.token_ids], pic_sampling())[0]
    cached = sum(prompt.spans[i][1] - prompt.spans[i][0] for i in warm)
    assert out.num_cached_tokens == cached, f"seed={seed}"
    holes = len(prompt.token_ids) - cached
    record = _steps_of(llm, out.request_id)
    assert record["computed_tokens"] == holes, f"{record} seed={seed}"
    assert record["steps"] == math.ceil(holes / BUDGET), f"{record}, {holes} hole tokens, " \
        f"seed={seed}"
    err = reference_error(out, prompt.token_ids, prompt.spans, tiny_ref)
    assert err < REFERENCE_TOL, f"off the reference by {err:.2e} (seed={seed})"


def _run_until_done(llm, timeout: float = 300.0) -> dict[str, object]:
    finals: dict[str, object] = {}
    deadline = time.monotonic() + timeout
    while llm.llm_engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "engine did not finish"
        for out in llm.llm_engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def _wait_for(predicate, llm, timeout: float = 60.0) -> dict:
    """Poll the scheduler's stats (answered between engine steps) until ``predicate``."""
    deadline = time.monotonic() + timeout
    while True:
        stats = _stats(llm)
        if predicate(stats):
            return stats
        assert time.monotonic() < deadline, f"condition not reached: {stats}"


def test_preempted_and_aborted_holed_requests_leak_nothing(small_engine, tiny_ref,
                                                            seed) -> None:
    from vllm.inputs import TokensPrompt

    llm = small_engine
    engine = llm.llm_engine
    rng = random.Random(seed)
    llm.reset_prefix_cache()
    idle = _stats(llm)
    assert idle["free_blocks"] == idle["total_blocks"] - 1 == POOL_BLOCKS - 1
    # X: warm spans of 2 blocks around cold spans of 3 blocks (7 blocks to compute)
    prompt = random_prompt(llm, rng, tiny_ref.vocab_size,
                     [rng.randrange(33, 63), rng.randrange(65, 95), rng.randrange(33, 63),
                      rng.randrange(65, 95), rng.randrange(33, 63)])
    warm = [0, 2, 4]
    generate(llm, [prompt.span_prefills[i] for i in warm], pic_sampling(max_tokens=1))
    before = _stats(llm)["freed_mid_holes"]

    # D, a plain decode, fills the pool until X (pinning its 6 warm blocks) cannot get its 7
    # hole blocks while D runs: X is preempted mid-prefill, resumes after D finishes.
    decode_ids = random_ordinary_ids(rng, 64, tiny_ref.vocab_size, ())
    engine.add_request("decode", TokensPrompt(prompt_token_ids=decode_ids),
                       pic_sampling(max_tokens=26 * 32, opt_in=False, ignore_eos=True))
    _wait_for(lambda s: s["free_blocks"] <= POOL_BLOCKS - 1 - 21, llm)
    engine.add_request("holed", TokensPrompt(prompt_token_ids=prompt.token_ids), pic_sampling())
    finals = _run_until_done(llm)
    stats = _stats(llm)
    preempted = stats["freed_mid_holes"].get("preempted", 0) - before.get("preempted", 0)
    assert preempted >= 1, f"the holed request was never preempted mid-prefill: {stats}"
    assert stats["free_blocks"] == POOL_BLOCKS - 1, f"blocks leaked: {stats} (seed={seed})"
    err = reference_error(finals["holed"], prompt.token_ids, prompt.spans, tiny_ref)
    assert err < REFERENCE_TOL, f"preempted: off the reference by {err:.2e} (seed={seed})"
    assert reference_error(finals["decode"], decode_ids, (), tiny_ref) < REFERENCE_TOL

    # Abort: a prompt whose holes take several steps, aborted while they are being computed.
    big = random_prompt(llm, rng, tiny_ref.vocab_size,
                  [rng.randrange(20, 60), rng.randrange(200, 260), rng.randrange(20, 60),
                   rng.randrange(200, 260), rng.randrange(20, 60)])
    generate(llm, [big.span_prefills[i] for i in warm], pic_sampling(max_tokens=1))
    before = _stats(llm)["freed_mid_holes"].get("finished", 0)
    engine.add_request("aborted", TokensPrompt(prompt_token_ids=big.token_ids), pic_sampling())
    _wait_for(lambda s: any(r.startswith("aborted") and a["computed"] > 0
                            for r, a in s["active"].items()), llm)
    engine.abort_request(["aborted"])
    _run_until_done(llm)
    stats = _stats(llm)
    assert stats["freed_mid_holes"].get("finished", 0) == before + 1, stats
    assert stats["free_blocks"] == POOL_BLOCKS - 1, f"blocks leaked: {stats} (seed={seed})"


def test_mixed_batch_of_holes_decodes_and_plain_requests(engines, tiny_ref, seed) -> None:
    from vllm.inputs import TokensPrompt

    llm = engines.get("tiny_pic")
    engine = llm.llm_engine
    rng = random.Random(seed)
    vocab = tiny_ref.vocab_size
    cfg = llm.minipic_settings.span_config
    avoid = (cfg.ssep_id, cfg.pdep_id, cfg.pad_id)
    llm.reset_prefix_cache()
    first = random_prompt(llm, rng, vocab, [rng.randrange(20, 90) for _ in range(5)])
    bodies = [p[1:] for p in first.span_prefills]
    # the same spans at other offsets, with other cold spans between them
    second = build_pic_prompt(cfg, [bodies[4], random_ordinary_ids(rng, 50, vocab, avoid),
                                    bodies[2], random_ordinary_ids(rng, 70, vocab, avoid),
                                    bodies[0]], random_ordinary_ids(rng, 9, vocab, avoid))
    generate(llm, [first.span_prefills[i] for i in (0, 2, 4)], pic_sampling(max_tokens=1))
    before = _stats(llm)["shared_multi_hole_steps"]

    decodes = {f"decode{i}": random_ordinary_ids(rng, rng.randrange(20, 80), vocab, ())
               for i in range(2)}
    for rid, ids in decodes.items():
        engine.add_request(rid, TokensPrompt(prompt_token_ids=ids),
                           pic_sampling(max_tokens=48, opt_in=False, ignore_eos=True))
    engine.step()  # the decodes are admitted first and keep decoding below
    plain = random_ordinary_ids(rng, 150, vocab, ())
    requests = {"holed0": (first.token_ids, first.spans, True),
                "holed1": (second.token_ids, second.spans, True),
                "plain": (plain, (), False),
                # span markers in a request that did not opt in: stock semantics
                "plain_markers": (first.token_ids, (), False)}
    for rid, (ids, _, opt_in) in requests.items():
        engine.add_request(rid, TokensPrompt(prompt_token_ids=list(ids)),
                           pic_sampling(opt_in=opt_in))
    finals = _run_until_done(llm)
    stats = _stats(llm)
    assert stats["shared_multi_hole_steps"] > before, stats
    for rid in ("holed0", "holed1"):
        record = _steps_of(llm, finals[rid].request_id)
        assert record["steps"] == 1, f"{rid}: {record} (seed={seed})"
    warm = sum(first.spans[i][1] - first.spans[i][0] for i in (0, 2, 4))
    assert finals["holed0"].num_cached_tokens == warm, f"seed={seed}"
    for rid, (ids, spans, opt_in) in requests.items():
        err = reference_error(finals[rid], ids, spans, tiny_ref, opted_in=opt_in)
        assert err < REFERENCE_TOL, f"{rid}: off its reference by {err:.2e} (seed={seed})"
    for rid, ids in decodes.items():
        err = reference_error(finals[rid], ids, (), tiny_ref)
        assert err < REFERENCE_TOL, f"{rid}: off stock by {err:.2e} (seed={seed})"
