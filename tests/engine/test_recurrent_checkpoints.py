"""Sparse recurrent-state checkpoints in a real vLLM engine (tiny Qwen3-Next hybrid, CPU).

Engine tests share two engines from the conftest pool: ``qwen3next_ckpt`` (prefix caching, plugin
feature ``ckpt``, server plan from a configured histogram) and ``qwen3next_nocache`` (prefix
caching off, the reference for exactness). Prompts are fresh random token ids every run.

What is retained is read from the EngineCore's own block pool through the utility method the
plugin adds (``minipic_ckpt_stats``, called with ``EngineCoreClient.call_utility``), so the engine
keeps its normal separate process — no ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` needed, and the plugin
is loaded fresh in the spawned EngineCore whatever other engines this pytest process built.

The policy itself (overrides, server plan, learning) is tested without an engine first.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from minipic.checkpoint_planner import plan_checkpoints
from minipic.engine_ext.recurrent.policy import (
    OVERRIDE_KEY,
    CheckpointConfig,
    CheckpointPolicy,
    parse_override,
    positions_in,
)

pytestmark = pytest.mark.shares(
    "qwen3next_ckpt", "qwen3next_ckpt_bfloat16", "qwen3next_ckpt_float32", "qwen3next_nocache",
)

# Tolerance for chosen-token logprobs (nats), resumed vs prefix caching off. The model runs bf16
# (vLLM's CPU GDN kernel accepts nothing else; the recurrent state is fp32), so any change of
# chunking moves logits by bf16 rounding, whose step at this random model's logit magnitudes
# (4..8) is 2**-5 = 0.031. Measured on 24 queries: vLLM *without any cache*, prefilling in
# 300-token chunks instead of one, differs by up to 0.061 (2 steps; median 0.0008) and even flips
# a near-tied greedy token; resuming from a checkpoint differed by up to 0.032 (test runs: up to
# 0.062; one CI run on fresh random inputs: 0.122 over 8 decoded tokens, whose bf16 roundings
# compound). So "exact" here means: equal up to 8 bf16 rounding steps of the logits, and the same
# greedy tokens except after a near-tie (top-2 margin within the tolerance); cached-token counts
# are asserted exactly, so a resume from the wrong position fails there.
LOGPROB_TOL = 0.25
# Resumed (from a bf16 checkpoint) vs recomputed, over 8 greedy steps. The first step's
# distribution is what the resumed state itself produces: held to LOGPROB_TOL. Later steps add
# each step's own bf16 noise on top (their max over 8 steps x 5 entries reached 0.59 on fresh
# random prompts in a CI run), so there only the greedy tokens are held: the same, except after a
# near-tie whose top-2 margin is within this; a wrong or shifted state moves whole
# distributions at the first step, nats, not tenths.
RESUME_MARGIN_TOL = 0.5
# The tiny Qwen3-Next's recurrent block is chosen by vLLM, never a constant here: vLLM enlarges
# the attention block until one attention page (2 KV heads x 64 x K,V x bf16 = 512 B/token)
# holds one GDN layer's state, rounded up to the requested block (32). That state's dtype
# depends on the CPU: vLLM's CPU platform keeps the model dtype (bf16: 288 tokens) unless the
# CPU has AVX-512 BF16, where it resets it to float32 (544 tokens). Tests read the block from
# the engine and check it against `hybrid_block_size` for the dtype the engine chose.
# random prompt ids stay clear of SmolLM2's special tokens (0..16) and below its vocab (49152)
TOKEN_RANGE = (1000, 40000)


def hybrid_block_size(vllm_config: Any, ssm_dtype: str) -> int:
    """The attention/recurrent block vLLM picks for a hybrid model, for a given SSM state dtype.

    Written from vLLM's rule (``Platform._align_hybrid_block_size``) on vLLM's own state shapes
    and page sizes: the smallest multiple of the requested block whose attention page holds one
    recurrent layer's state.
    """
    from vllm.model_executor.models import ModelRegistry
    from vllm.utils.math_utils import cdiv
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
    model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architecture,
                                                   model_config=model_config)
    chosen = cache_config.mamba_ssm_cache_dtype
    cache_config.mamba_ssm_cache_dtype = ssm_dtype
    try:
        state = MambaSpec(shapes=model_cls.get_mamba_state_shape_from_config(vllm_config),
                          dtypes=model_cls.get_mamba_state_dtype_from_config(vllm_config),
                          block_size=-1).page_size_bytes
    finally:
        cache_config.mamba_ssm_cache_dtype = chosen
    per_token = FullAttentionSpec(
        block_size=1, num_kv_heads=model_config.get_num_kv_heads(vllm_config.parallel_config),
        head_size=model_config.get_head_size(), dtype=model_config.dtype).page_size_bytes
    requested = REQUESTED_BLOCK
    return requested * cdiv(state, requested * per_token)


REQUESTED_BLOCK = 32  # minipic's engine block size (EngineSettings), before vLLM enlarges it


def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]


# --------------------------------------------------------------------------------------------
# policy (no engine)


@pytest.mark.fast
def test_parse_override_values():
    assert parse_override(None) == "server"
    assert parse_override("all") == "all"
    assert parse_override("vllm") == "vllm"
    assert parse_override([512, 256, 256]) == (256, 512)
    for bad in ("most", [1.5], [-1], {"a": 1}, [True]):
        with pytest.raises(ValueError):
            parse_override(bad)


@pytest.mark.fast
def test_policy_resolves_server_plan_and_overrides():
    g, n = 256, 4096
    hist = np.zeros(n + 1)
    hist[[700, 2100, 3000]] = [0.2, 0.5, 0.3]
    policy = CheckpointPolicy(CheckpointConfig(budget=2, histogram=hist.tolist()), g, n)
    assert policy.server_plan == tuple(plan_checkpoints(hist, 2, "dp", g)) == (2048, 2816)
    server = policy.resolve("server")
    assert server.positions == (2048, 2816) and server.strict
    assert policy.resolve("vllm") is None
    assert policy.resolve("all").positions == tuple(range(256, 4097, 256))
    # explicit positions are floored to the recurrent block; below one block means nothing
    assert policy.resolve((100, 300, 600, 700)).positions == (256, 512)
    keep = CheckpointPolicy(CheckpointConfig(budget=2, keep_tail=True), g, n)
    assert not keep.resolve("server").strict


@pytest.mark.fast
def test_policy_uniform_prior_and_learning():
    g, n = 256, 2048
    policy = CheckpointPolicy(CheckpointConfig(budget=3, learn=True, replan_every=5), g, n)
    uniform = np.full(n + 1, 1 / (n + 1))
    assert policy.server_plan == tuple(plan_checkpoints(uniform, 3, "dp", g))
    assert policy.plan_source == "uniform prior"
    for depth in (1800, 1810, 600, 1900):
        policy.observe(depth)
    assert policy.num_replans == 0  # not yet: replan_every=5
    policy.observe(700)
    assert policy.num_replans == 1 and policy.plan_source == "learned"
    learned = np.bincount([1800, 1810, 600, 1900, 700], minlength=n + 1) / 5
    assert policy.server_plan == tuple(plan_checkpoints(learned, 3, "dp", g))
    assert policy.stats()["observations"] == 5


@pytest.mark.fast
def test_config_validation_and_env_roundtrip(tmp_path):
    with pytest.raises(ValueError):
        CheckpointConfig(method="nope")
    with pytest.raises(ValueError):
        CheckpointConfig(histogram=[0.5, 0.4])  # neither counts nor probabilities
    with pytest.raises(ValueError):
        CheckpointConfig(histogram=[1, 1], histogram_file="x.json")
    cfg = CheckpointConfig(budget=3, method="balanced", learn=True, half_life=50.0)
    assert CheckpointConfig.from_env(cfg.to_env()) == cfg
    assert CheckpointConfig.from_env({}) == CheckpointConfig()
    short = CheckpointPolicy(CheckpointConfig(histogram=[1, 2, 3]), 256, 4096)
    assert short.server_plan == ()  # a histogram shorter than one block cannot place anything
    assert positions_in((256, 512, 768), 256, 768) == [512]


@pytest.mark.fast
def test_serve_flags_turn_on_ckpt(tmp_path):
    import argparse
    import json

    from minipic import serve

    parser = argparse.ArgumentParser()
    serve.add_subparser(parser.add_subparsers())
    hist = tmp_path / "h.json"
    hist.write_text(json.dumps({"depths": [300, 900, 900], "n": 1024}))
    args = parser.parse_args(["serve", "--model", "m", "--ckpt-budget", "2",
                              "--ckpt-histogram", str(hist)])
    settings = serve.settings_from_args(args)
    assert settings.features == ("ckpt",) and settings.dtype == "auto"
    assert settings.ckpt.histogram_file == str(hist) and not settings.ckpt.learn
    argv = settings.server_argv("127.0.0.1", 1, "x")
    i = argv.index("--prefix-cache-retention-interval")
    assert argv[i + 1] == "0" and "--enable-prefix-caching" in argv
    learn = serve.settings_from_args(parser.parse_args(["serve", "--ckpt-budget", "4"]))
    assert learn.ckpt.learn and learn.ckpt.budget == 4
    plain = serve.settings_from_args(parser.parse_args(["serve"]))
    assert plain.features == ("hash", "rope", "holes") and plain.ckpt is None
    assert plain.dtype == "float32"
    assert "--prefix-cache-retention-interval" not in plain.model_copy(
        update={"model": "m"}).server_argv("h", 1, "x")


def tiny_qwen3_next_config() -> Any:
    """vLLM's config of the tiny hybrid as the checkpoint engines run it (no engine started)."""
    from vllm.engine.arg_utils import EngineArgs

    from minipic.span_contract.models import tiny_qwen3_next_dir

    return EngineArgs(model=str(tiny_qwen3_next_dir()), dtype="bfloat16",
                      block_size=REQUESTED_BLOCK, enable_prefix_caching=True,
                      max_model_len=2048, enforce_eager=True).create_engine_config()


@pytest.mark.fast
def test_block_size_derivation_for_both_ssm_dtypes():
    """The derivation the engine tests check the engine against, for both SSM state dtypes vLLM
    may choose: bf16 (CPUs without AVX-512 BF16, e.g. AMD EPYC without AVX-512: 288 tokens seen
    there) and float32 (CPUs with it: 544 tokens seen there). So a machine of either kind checks
    what the other kind's engine will do."""
    config = tiny_qwen3_next_config()
    sizes = {dtype: hybrid_block_size(config, dtype) for dtype in ("bfloat16", "float32")}
    assert sizes == {"bfloat16": 288, "float32": 544}
    for g in sizes.values():  # what the engine tests below need of any block
        assert g % REQUESTED_BLOCK == 0 and 3 * g < 2048


# --------------------------------------------------------------------------------------------
# engine


def generate(llm: Any, ids: list[int], xargs: Any = None, max_tokens: int = 1,
             logprobs: int | None = None) -> Any:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = None if xargs is None else {OVERRIDE_KEY: xargs}
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs,
                            extra_args=extra)
    return llm.generate([TokensPrompt(prompt_token_ids=list(ids))], params, use_tqdm=False)[0]


def stats(llm: Any, ids: list[int] | None = None) -> dict[str, Any]:
    from minipic.engine_ext.recurrent.checkpoints import checkpoint_stats

    return checkpoint_stats(llm, ids)


@pytest.fixture(scope="module")
def ckpt_llm(engines: Any) -> Any:
    return engines.get("qwen3next_ckpt")


@pytest.fixture(scope="module")
def block(ckpt_llm: Any) -> int:
    st = stats(ckpt_llm)
    assert st["active"], "the ckpt feature did not attach to the scheduler"
    assert st["retention_interval"] == 0
    g = st["policy"]["block_size"]
    assert g == st["block_size"] == hybrid_block_size(ckpt_llm.llm_engine.vllm_config,
                                                      st["ssm_state_dtype"])
    assert 3 * g < 2048, "the tests below need three block boundaries below max_model_len"
    return g


def deepest(plan: list[int], k: int) -> int:
    return max((c for c in plan if c <= k), default=0)


@pytest.mark.engine
@pytest.mark.parametrize("source", ["server", "request"])
def test_resume_from_deepest_planned_checkpoint(ckpt_llm, block, source):
    """P[:k] + fresh suffix resumes from max{c in plan : c <= k} for k in every gap of the plan."""
    from support.engine_profiles import QWEN3NEXT_CKPT_HISTOGRAM

    rng = random.Random()
    g = block
    if source == "server":
        plan = stats(ckpt_llm)["policy"]["server_plan"]
        assert plan == plan_checkpoints(QWEN3NEXT_CKPT_HISTOGRAM, 2, "dp", g)
        xargs = None
    else:
        plan = [g, 3 * g]
        xargs = plan
    # past every planned position and 3g (the plan's positions move with g, i.e. with the CPU),
    # with room for a 60-token suffix below max_model_len (2048)
    prompt = rand_ids(rng, max(3 * g, *plan) + rng.randrange(50, 250))
    generate(ckpt_llm, prompt, xargs)
    edges = [0, *plan, len(prompt)]
    ks = [rng.randrange(max(lo, 1), hi) for lo, hi in zip(edges, edges[1:], strict=False)
          if hi > max(lo, 1)]
    ks += [c for c in plan]  # exactly at a checkpoint
    for k in ks:
        out = generate(ckpt_llm, prompt[:k] + rand_ids(rng, rng.randrange(20, 60)), xargs)
        assert out.num_cached_tokens == deepest(plan, k), (k, plan)


@pytest.mark.engine
def test_only_planned_positions_hold_state(ckpt_llm, block):
    """Retained recurrent state = the plan; vLLM's own tail / junction states are not kept.

    Counted in the EngineCore block pool: per GDN layer group, blocks that carry a prefix-cache
    hash (a state vLLM can resume from). Attention KV stays dense.
    """
    rng = random.Random()
    g = block
    assert ckpt_llm.reset_prefix_cache()
    base = stats(ckpt_llm)
    assert base["state_blocks_total"] == 0
    groups = base["mamba_groups"]
    per_block = sum(base["state_bytes_per_block"].values())

    # 1. request plan [g] on a prompt whose tail boundary (3g) and a later junction (2g) are
    #    unplanned: exactly one state position, one block per recurrent layer.
    prompt = rand_ids(rng, 3 * g + rng.randrange(20, 200))
    generate(ckpt_llm, prompt, [g])
    generate(ckpt_llm, prompt[:2 * g + 100] + rand_ids(rng, 30), [g])  # stock: junction at 2g
    st = stats(ckpt_llm, prompt)
    assert st["resumable_positions"] == [g]
    assert all(st["state_positions"][str(i)] == [g] for i in groups)
    dense = [g, 2 * g, 3 * g]
    assert st["attention_positions"] == {str(i): dense for i in base["attention_groups"]}
    assert st["state_blocks_total"] == len(groups)
    assert st["state_bytes_total"] == per_block

    # 2. server plan [2g, 3g] (from the profile's histogram) on a prompt shorter than 2g:
    #    nothing to keep — stock vLLM would keep its tail at g.
    short = rand_ids(rng, g + rng.randrange(50, g - 50))
    generate(ckpt_llm, short)
    assert stats(ckpt_llm, short)["resumable_positions"] == []
    assert stats(ckpt_llm)["state_blocks_total"] == len(groups)

    # 3. positive control: the same counter sees stock vLLM's tail checkpoint.
    stock = rand_ids(rng, 3 * g + rng.randrange(20, 200))
    generate(ckpt_llm, stock, "vllm")
    assert stats(ckpt_llm, stock)["resumable_positions"] == [3 * g]
    assert stats(ckpt_llm)["state_blocks_total"] == 2 * len(groups)

    # 4. keep_tail=True: vLLM's own tail checkpoint is kept next to the planned one.
    from minipic.engine_ext.recurrent.checkpoints import configure_checkpoints

    try:
        configure_checkpoints(ckpt_llm, CheckpointConfig(budget=0, keep_tail=True))
        tailed = rand_ids(rng, 3 * g + rng.randrange(20, 200))
        generate(ckpt_llm, tailed, [g])
        assert stats(ckpt_llm, tailed)["resumable_positions"] == [g, 3 * g]
    finally:
        configure_checkpoints(ckpt_llm, None)


@pytest.mark.engine
def test_the_other_ssm_dtype_engine(engines, ckpt_llm, block):
    """An engine with the SSM state dtype this CPU does *not* choose (forced with vLLM's
    ``mamba_ssm_cache_dtype``): its block is the derivation's for that dtype, its plan follows
    that block, and resumes land on it. So one machine checks both machine kinds' layouts."""
    from support.engine_profiles import QWEN3NEXT_CKPT_HISTOGRAM

    chosen = stats(ckpt_llm)["ssm_state_dtype"]
    other = "bfloat16" if chosen == "float32" else "float32"
    llm = engines.get(f"qwen3next_ckpt_{other}")
    st = stats(llm)
    g = st["block_size"]
    assert st["ssm_state_dtype"] == other and st["policy"]["block_size"] == g
    assert g == hybrid_block_size(llm.llm_engine.vllm_config, other) != block
    plan = st["policy"]["server_plan"]
    assert plan == plan_checkpoints(QWEN3NEXT_CKPT_HISTOGRAM, 2, "dp", g)
    rng = random.Random()
    prompt = rand_ids(rng, max(3 * g, *plan) + rng.randrange(50, 250))
    generate(llm, prompt)
    edges = [0, *plan, len(prompt)]
    for lo, hi in zip(edges, edges[1:], strict=False):
        k = rng.randrange(lo + 1, hi)
        assert generate(llm, prompt[:k] + rand_ids(rng, 30)).num_cached_tokens == deepest(plan, k)


def greedy_difference(got: Any, ref: Any, margin: float = LOGPROB_TOL) -> float:
    """Largest chosen-token logprob difference; asserts the greedy tokens agree (up to a tie:
    a reference top-2 margin within ``margin``)."""
    worst = 0.0
    for tok_a, tok_b, lp_a, lp_b in zip(got.token_ids, ref.token_ids, got.logprobs,
                                        ref.logprobs, strict=True):
        top = sorted((v.logprob for v in lp_b.values()), reverse=True)
        if tok_a != tok_b:  # only allowed where the reference itself had a near-tie
            assert top[0] - top[1] <= margin, (got.token_ids, ref.token_ids)
            assert abs(lp_a[tok_a].logprob - top[0]) <= margin
            break
        worst = max(worst, abs(lp_a[tok_a].logprob - lp_b[tok_b].logprob))
    return worst


def first_step_difference(got: Any, ref: Any) -> float:
    """Largest |logprob difference| over the first decoded step's top-k entries both returned:
    the distribution the prompt's final state produces, before any decode noise."""
    a, b = got.logprobs[0], ref.logprobs[0]
    return max(abs(a[t].logprob - b[t].logprob) for t in a.keys() & b.keys())


@pytest.mark.engine
def test_exact_resume_matches_no_prefix_cache(engines, ckpt_llm, block, rng):
    """Greedy tokens and logprobs after resuming from a checkpoint = prefix caching off.

    Three resumes: from 2g with a final chunk inside one block, from 2g with a final chunk that
    crosses the 3g boundary, and from g crossing 2g. Crossing finals are where the strict mode
    lifts vLLM's prompt-tail stop, so the state is carried over boundaries without a stop.
    """
    g = block
    p1, p2 = rand_ids(rng, 3 * g + 100), rand_ids(rng, 3 * g + 100)
    generate(ckpt_llm, p1, [g, 2 * g])
    generate(ckpt_llm, p2, [g])
    cases = [  # (query, plan, expected cached tokens)
        (p1[:2 * g + rng.randrange(10, 200)] + rand_ids(rng, 40), [g, 2 * g], 2 * g),
        (p1[:3 * g + rng.randrange(10, 90)] + rand_ids(rng, 40), [g, 2 * g], 2 * g),
        (p2[:2 * g + rng.randrange(100, 300)] + rand_ids(rng, 40), [g], g),
    ]
    nocache = engines.get("qwen3next_nocache")
    first = 0.0
    for query, plan, hit in cases:
        got = generate(ckpt_llm, query, plan, max_tokens=8, logprobs=5)
        ref = generate(nocache, query, max_tokens=8, logprobs=5)
        assert got.num_cached_tokens == hit
        assert ref.num_cached_tokens == 0
        first = max(first, first_step_difference(got.outputs[0], ref.outputs[0]))
        later = greedy_difference(got.outputs[0], ref.outputs[0], RESUME_MARGIN_TOL)
        print(f"resumed vs no prefix caching, max |logprob difference|: first step {first:.2e}"
              f", chosen tokens of 8 steps {later:.2e}")
    assert first <= LOGPROB_TOL


@pytest.mark.engine
def test_learned_plan_follows_observed_depths(ckpt_llm, block):
    """With ``learn`` the server plan moves to where requests actually overlap."""
    from minipic.engine_ext.recurrent.checkpoints import configure_checkpoints

    rng = random.Random()
    g = block
    try:
        st = configure_checkpoints(ckpt_llm, CheckpointConfig(budget=1, learn=True,
                                                              replan_every=4))
        assert st["policy"]["server_plan"] == plan_checkpoints(
            np.full(2049, 1 / 2049), 1, "dp", g)  # uniform prior
        prompt = rand_ids(rng, 3 * g + 150)
        generate(ckpt_llm, prompt)  # observed depth 0
        for _ in range(3):  # observed depth: the attention hit, 3g
            generate(ckpt_llm, prompt[:3 * g + rng.randrange(10, 140)] + rand_ids(rng, 20))
        policy = stats(ckpt_llm)["policy"]
        assert policy["plan_source"] == "learned" and policy["observations"] == 4
        assert policy["server_plan"] == [3 * g]
        fresh = rand_ids(rng, 3 * g + 150)
        generate(ckpt_llm, fresh)
        assert stats(ckpt_llm, fresh)["resumable_positions"] == [3 * g]
    finally:
        configure_checkpoints(ckpt_llm, None)


@pytest.mark.server
@pytest.mark.slow
def test_serve_ckpt_over_http(tmp_path):
    """`minipic serve --ckpt-budget` end to end: server plan from a histogram file, a per-request
    plan through the OpenAI ``vllm_xargs`` field, and a bad override answered with 400."""
    import json

    import httpx
    from support.engine_profiles import QWEN3NEXT_CKPT_HISTOGRAM
    from support.servers import ServerProcess

    hist = tmp_path / "depths.json"
    hist.write_text(json.dumps(QWEN3NEXT_CKPT_HISTOGRAM))
    server = ServerProcess("--model", "tiny-qwen3-next", "--max-model-len", "2048",
                           "--ckpt-budget", "2", "--ckpt-histogram", str(hist)).start()
    try:
        config = httpx.get(server.base_url + "/minipic/config").json()
        assert config["features"] == ["ckpt"] and config["ckpt"]["active"]
        g = config["ckpt"]["block_size"]  # chosen by the engine (depends on the CPU)
        assert g == hybrid_block_size(tiny_qwen3_next_config(), config["ckpt"]["ssm_state_dtype"])

        def cached(ids: list[int], xargs: Any = None) -> httpx.Response:
            body: dict[str, Any] = {"model": "minipic", "prompt": ids, "max_tokens": 1}
            if xargs is not None:
                body["vllm_xargs"] = {OVERRIDE_KEY: xargs}
            return httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)

        def hit(ids: list[int], xargs: Any = None) -> int:
            resp = cached(ids, xargs)
            assert resp.status_code == 200, resp.text
            return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        rng = random.Random()
        prompt = rand_ids(rng, 1900)
        hit(prompt)
        plan = plan_checkpoints(QWEN3NEXT_CKPT_HISTOGRAM, 2, "dp", g)
        assert config["ckpt"]["server_plan"] == plan
        edges = [0, *plan, len(prompt)]  # one depth in each gap of the engine's plan
        for lo, hi in zip(edges, edges[1:], strict=False):
            k = rng.randrange(lo + 1, hi)
            assert hit(prompt[:k] + rand_ids(rng, 30)) == deepest(plan, k)
        other = rand_ids(rng, 1900)
        hit(other, [g])
        assert hit(other[:2 * g + 10] + rand_ids(rng, 30), [g]) == g
        bad = cached(other, "bogus")
        assert bad.status_code == 400 and OVERRIDE_KEY in bad.text
    finally:
        server.stop()
