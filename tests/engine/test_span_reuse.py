"""Every cached span reused, only the holes computed, the same output whatever the cache holds.

Real vLLM on CPU (fp32), fresh random token ids every run (``MINIPIC_TEST_SEED`` replays one),
against the transformers block-mask reference of docs/design.md §2
(``tests/support/pic_reference.py``):

* spans [warm, cold, warm, cold, warm]: the warm ones are reused although cold spans precede
  them (vLLM's own lookup stops at the first miss), cached tokens = the warm spans' tokens, and
  the output equals the reference — the cold spans were computed *in isolation* inside the final;
* determinism: the same final prompt (a) after its span prefills, (b) sent cold with no prefill,
  (c) after the cache was reset between prefills and final, (d) in one batch with requests that
  hold the same spans at other offsets — identical greedy tokens, all equal to the reference;
* boundary_recompute: whole spans reused after their recomputed heads, output = the reference
  (each span alone, its copy of the head hidden; heads and question in context over them);
* selective@B: the same reference whatever the cache holds (cold, warm, evicted, in a
  batch), and the recomputed heads stay private: a prompt with the same documents in another
  order reuses their spans, never another prompt's heads;
* tenants: a salted request never reuses a span cached under another salt, at any position;
* opt-in: a request that did not ask for span semantics gets stock hashing and attention even
  when its tokens contain SSEP/PDEP at block starts, and shares no block with span requests.

Tolerance: max |delta logprob| over every returned top-k entry, 1e-4 (fp32 kernels vs
transformers, different summation order; measured ~2e-6).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
from support.pic_engine import (
    generate,
    pic_sampling,
    prefill,
    random_documents,
    random_prompt,
    selective_prompt,
)
from support.pic_reference import (
    REFERENCE_TOL,
    PicReference,
    build_pic_prompt,
    max_logprob_error,
    prompt_error,
    random_ordinary_ids,
    span_part_runs,
)

pytestmark = [pytest.mark.engine, pytest.mark.shares("tiny_pic")]


@pytest.fixture(scope="module")
def tiny_ref(engines) -> Iterator[PicReference]:
    yield PicReference(engines.get("tiny_pic").minipic_settings.model)


def test_warm_spans_after_cold_ones_are_reused_and_exact(engines, tiny_ref, seed) -> None:
    llm = engines.get("tiny_pic")
    rng = random.Random(seed)
    prompt = random_prompt(llm, rng, tiny_ref.vocab_size, [20, 45, 30, 50, 40])
    warm = [0, 2, 4]
    prefill(llm, [prompt.span_prefills[i] for i in warm])
    out = generate(llm, [prompt.token_ids], pic_sampling())[0]
    warm_tokens = sum(prompt.spans[i][1] - prompt.spans[i][0] for i in warm)
    assert out.num_cached_tokens == warm_tokens == 128, f"seed={seed}"
    err = prompt_error(out, prompt, tiny_ref)
    assert err < REFERENCE_TOL, f"off the reference by {err:.2e} (seed={seed})"
    # The holes were computed in isolation and cached under their span-local hashes: the same
    # prompt now reuses every span, and still equals the reference.
    again = generate(llm, [prompt.token_ids], pic_sampling())[0]
    assert again.num_cached_tokens == prompt.span_tokens, f"seed={seed}"
    assert again.outputs[0].token_ids == out.outputs[0].token_ids
    assert prompt_error(again, prompt, tiny_ref) < REFERENCE_TOL, f"seed={seed}"


def test_same_output_whatever_the_cache_holds(engines, tiny_ref, seed) -> None:
    llm = engines.get("tiny_pic")
    rng = random.Random(seed)
    vocab = tiny_ref.vocab_size
    prompt = random_prompt(llm, rng, vocab, [15, 40, 70, 33])
    cfg = llm.minipic_settings.span_config
    avoid = (cfg.ssep_id, cfg.pdep_id, cfg.pad_id)
    question = random_ordinary_ids(rng, 9, vocab, avoid)
    bodies = [p[1:] for p in prompt.span_prefills]  # (padding included; harmless)
    # The same spans at other offsets: reversed order, and behind an extra span.
    other = build_pic_prompt(cfg, bodies[::-1], question)
    extra = random_ordinary_ids(rng, 28, vocab, avoid)
    shifted = build_pic_prompt(cfg, [extra, *bodies], question)

    llm.reset_prefix_cache()
    cold = generate(llm, [prompt.token_ids], pic_sampling())[0]  # (b) no prefill at all
    llm.reset_prefix_cache()
    prefill(llm, prompt.span_prefills)
    warm = generate(llm, [prompt.token_ids], pic_sampling())[0]  # (a) the documented flow
    assert warm.num_cached_tokens == prompt.span_tokens
    prefill(llm, prompt.span_prefills)
    llm.reset_prefix_cache()
    evicted = generate(llm, [prompt.token_ids], pic_sampling())[0]  # (c) lost between the two
    assert evicted.num_cached_tokens == 0
    llm.reset_prefix_cache()
    batch = generate(llm, [other.token_ids, prompt.token_ids, shifted.token_ids], pic_sampling())
    concurrent = batch[1]  # (d) one batch, same spans at three offsets, nothing warm

    results = {"cold": cold, "warm": warm, "evicted": evicted, "concurrent": concurrent}
    for name, out in results.items():
        assert out.outputs[0].token_ids == cold.outputs[0].token_ids, f"{name} (seed={seed})"
        err = prompt_error(out, prompt, tiny_ref)
        assert err < REFERENCE_TOL, f"{name}: off the reference by {err:.2e} (seed={seed})"
    for out, p in ((batch[0], other), (batch[2], shifted)):
        assert prompt_error(out, p, tiny_ref) < REFERENCE_TOL, f"seed={seed}"


def test_boundary_recompute_reuses_whole_spans_after_heads(engines, tiny_ref, seed) -> None:
    from minipic.prompt_builder import PromptBuilder

    llm = engines.get("tiny_pic")
    cfg = llm.minipic_settings.span_config
    builder = PromptBuilder.from_pretrained(None, block_size=cfg.block_size,
                                            chat_template=False)
    assert builder.span_config == cfg
    rng = random.Random(seed)
    words = "amber basalt cedar delta ember fjord granite harbor iris juniper kelp".split()
    docs = [" ".join(rng.choice(words) for _ in range(rng.randrange(40, 90))) for _ in range(3)]
    built = builder.build(system="Answer from the documents.", spans=docs,
                          question="Which word comes first?", mode="boundary_recompute")
    runs = span_part_runs(built)
    wholes = [(a, b) for a, b, part in runs if part == "whole"]
    assert len(wholes) == 3 and built.leading_cached_tokens < built.expected_cached_tokens
    prefill(llm, built.span_prefills)
    out = generate(llm, [built.prompt_token_ids], pic_sampling())[0]
    assert out.num_cached_tokens == built.expected_cached_tokens == built.reusable_tokens
    assert out.num_cached_tokens == built.spans[0].end + sum(e - s for s, e in wholes)
    # The reference: each whole span attends only within itself, its copy of the head seen by
    # it alone; heads, system and question attend to everything shown before them.
    full = built.prompt_token_ids + list(out.outputs[0].token_ids)
    ref = tiny_ref.logprobs(full, runs, prompt_len=len(built.prompt_token_ids))
    err = max_logprob_error(out.outputs[0], len(built.prompt_token_ids), ref)
    assert err < REFERENCE_TOL, f"off the reference by {err:.2e} (seed={seed})"


def test_selective_same_output_whatever_the_cache_holds(engines, tiny_ref, seed) -> None:
    llm = engines.get("tiny_pic")
    rng = random.Random(seed)
    share = rng.choice([0.2, 0.35, 0.5, 0.65])
    docs = random_documents(rng)
    built, runs = selective_prompt(llm, rng, share, "Which word comes first?", docs)
    prompt = built.prompt_token_ids
    assert any(s.part == "head" for s in built.segments), f"share {share} (seed={seed})"

    def ref_error(out, ids, isolated) -> float:
        ref = tiny_ref.logprobs(list(ids) + list(out.outputs[0].token_ids), isolated,
                                prompt_len=len(ids))
        return max_logprob_error(out.outputs[0], len(ids), ref)

    llm.reset_prefix_cache()
    cold = generate(llm, [prompt], pic_sampling())[0]
    llm.reset_prefix_cache()
    prefill(llm, built.span_prefills)
    warm = generate(llm, [prompt], pic_sampling())[0]
    assert warm.num_cached_tokens == built.expected_cached_tokens, f"seed={seed}"
    # The heads that final recomputed are private to its prefix: the same documents in the
    # reverse order reuse every body and whole span (warm above), and no head of the first one.
    reordered, reordered_runs = selective_prompt(llm, rng, share, "Which word comes first?",
                                                 docs[::-1])
    again = generate(llm, [reordered.prompt_token_ids], pic_sampling())[0]
    assert again.num_cached_tokens == reordered.expected_cached_tokens, f"seed={seed}"
    assert ref_error(again, reordered.prompt_token_ids, reordered_runs) < REFERENCE_TOL
    prefill(llm, built.span_prefills)
    llm.reset_prefix_cache()
    evicted = generate(llm, [prompt], pic_sampling())[0]
    assert evicted.num_cached_tokens == 0
    llm.reset_prefix_cache()
    other, other_runs = selective_prompt(llm, rng, share, "Which word comes last?", docs)
    batch = generate(llm, [other.prompt_token_ids, prompt], pic_sampling())
    for name, out in {"cold": cold, "warm": warm, "evicted": evicted,
                      "batched": batch[1]}.items():
        assert out.outputs[0].token_ids == cold.outputs[0].token_ids, f"{name} (seed={seed})"
        err = ref_error(out, prompt, runs)
        assert err < REFERENCE_TOL, (f"{name}: off the reference by {err:.2e} "
                                     f"(share {share}, seed={seed})")
    assert ref_error(batch[0], other.prompt_token_ids, other_runs) < REFERENCE_TOL


def test_salted_request_never_hits_another_tenants_span(engines, tiny_ref, seed) -> None:
    llm = engines.get("tiny_pic")
    rng = random.Random(seed)
    prompt = random_prompt(llm, rng, tiny_ref.vocab_size, [20, 45, 30, 50])
    # Tenant A warms spans 0, 2, 3: they sit after a cold span in the final prompt.
    prefill(llm, [prompt.span_prefills[i] for i in (0, 2, 3)], salt="tenant-a")
    other = generate(llm, [prompt.token_ids], pic_sampling(), salt="tenant-b")[0]
    unsalted = generate(llm, [prompt.token_ids], pic_sampling())[0]
    assert other.num_cached_tokens == 0 and unsalted.num_cached_tokens == 0, f"seed={seed}"
    own = generate(llm, [prompt.token_ids], pic_sampling(), salt="tenant-a")[0]
    warm = sum(prompt.spans[i][1] - prompt.spans[i][0] for i in (0, 2, 3))
    assert own.num_cached_tokens == warm, f"seed={seed}"


def test_request_without_opt_in_gets_stock_semantics(engines, tiny_ref, seed) -> None:
    """SSEP/PDEP ids in a plain request change neither its hashes nor its attention."""
    llm = engines.get("tiny_pic")
    rng = random.Random(seed)
    prompt = random_prompt(llm, rng, tiny_ref.vocab_size, [20, 45, 30])
    prefill(llm, prompt.span_prefills)  # span-cached, as an SDK user would
    plain = generate(llm, [prompt.token_ids], pic_sampling(opt_in=False))[0]
    # Stock chain, and no block of a span request: even the first one (offset 0, nothing
    # before it, the same tokens) holds other KV, its SSEP and pads hidden by rule 1.
    assert plain.num_cached_tokens == 0, f"seed={seed}"
    full = prompt.token_ids + list(plain.outputs[0].token_ids)
    err = max_logprob_error(plain.outputs[0], len(prompt.token_ids),
                            tiny_ref.logprobs(full, opted_in=False))
    assert err < REFERENCE_TOL, f"plain request off the causal reference by {err:.2e}"
