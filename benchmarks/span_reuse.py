"""Partial warmth and cold finals: the engine's lookup past misses vs a prefix-only lookup.

Three engines, one run, same prompts (SmolLM2-135M, fp32, CPU): minipic with the ``holes``
feature (reuse every cached span, compute only the holes, every hole of a prompt in one engine
step), the same with one hole per engine step (``MINIPIC_HOLES_PER_STEP=one``: the schedule
before ``engine_ext/holes/scheduler_steps.py``), and minipic without it (``hash,rope``: the stock
lookup, which stops at the first miss — "today's lookup"). For each:

* **half warm**: final prompts of ``--spans`` spans of ``--span-tokens`` tokens each, half of the
  spans prefilled first at random positions; TTFT (one generated token), cached tokens, and the
  engine steps each final took to prefill (the scheduler's count).
* **cold vs prefilled** (holes engine): the same final prompt sent with no span prefill, then
  after its prefills; TTFT of both and whether the greedy tokens agree (they must: span
  isolation makes the output independent of what was cached).

Writes ``span_reuse.json`` and ``span_reuse.png`` under ``--out``. Usage::

    python benchmarks/span_reuse.py --out results/span_reuse [--prompts 12]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any


def _prompts(seed: int, n: int, n_spans: int, span_tokens: int, config: Any,
             vocab: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    avoid = {config.ssep_id, config.pdep_id, config.pad_id}

    def ids(k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            t = rng.randrange(200, vocab)
            if t not in avoid:
                out.append(t)
        return out

    bs = config.block_size
    items = []
    for _ in range(n):
        spans = []
        for _ in range(n_spans):
            body = [config.ssep_id, *ids(span_tokens - 1)]
            spans.append(body + [config.pad_id] * (-len(body) % bs))
        warm = sorted(rng.sample(range(n_spans), n_spans // 2))
        tokens = [t for s in spans for t in s] + [config.pdep_id, *ids(24)]
        items.append({"spans": spans, "warm": warm, "tokens": tokens})
    return items


CONFIGS = {  # report key -> (features, holes per step)
    "holes": (("hash", "rope", "holes"), "all"),
    "holes_one_per_step": (("hash", "rope", "holes"), "one"),
    "prefix_lookup": (("hash", "rope"), "all"),
}


def _measure(name: str, items: list[dict[str, Any]], max_model_len: int) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from minipic.engine_ext.holes.scheduler_steps import PER_STEP_ENV
    from minipic.engine_ext.recurrent.checkpoints import call_engine
    from minipic.span_contract.engine_config import (
        EngineSettings,
        build_llm,
        close_llm,
        patched_environ,
    )
    from minipic.span_contract.engine_utilities import HOLE_STATS_UTILITY
    from minipic.span_contract.span_config import SPANS_OPT_IN_KEY

    features, per_step = CONFIGS[name]
    holes = "holes" in features
    with patched_environ({PER_STEP_ENV: per_step}):
        llm = build_llm(EngineSettings(max_model_len=max_model_len, features=features))
    one = SamplingParams(max_tokens=1, temperature=0.0, extra_args={SPANS_OPT_IN_KEY: True})
    greedy = SamplingParams(max_tokens=8, temperature=0.0, extra_args={SPANS_OPT_IN_KEY: True})

    def run(prompts: list[list[int]], params: Any = one) -> tuple[float, list[Any]]:
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                            use_tqdm=False)
        return time.perf_counter() - start, outs

    try:
        run([items[0]["tokens"]])  # warm-up (allocations, first-step costs)
        llm.reset_prefix_cache()
        ttft, cached, prompt_tokens, steps = [], [], [], []
        for item in items:
            run([item["spans"][i] for i in item["warm"]])
            seconds, (out,) = run([item["tokens"]])
            ttft.append(seconds)
            cached.append(out.num_cached_tokens)
            prompt_tokens.append(len(item["tokens"]))
            if holes:  # the final is the scheduler's latest finished prefill
                steps.append(call_engine(llm, HOLE_STATS_UTILITY)["recent"][-1]["steps"])
        result: dict[str, Any] = {
            "features": list(features), "holes_per_step": per_step,
            "half_warm": {
                "ttft_s": ttft, "ttft_p50_s": statistics.median(ttft),
                "cached_tokens": cached, "prompt_tokens": prompt_tokens,
                "hit_rate": sum(cached) / sum(prompt_tokens),
                "prefill_steps": steps or None,
            },
        }
        if name == "holes":
            llm.reset_prefix_cache()
            cold_t, warm_t, agree = [], [], []
            for item in items:
                seconds, (cold,) = run([item["tokens"]], greedy)
                cold_t.append(seconds)
                llm.reset_prefix_cache()
                run(item["spans"])
                seconds, (warm,) = run([item["tokens"]], greedy)
                warm_t.append(seconds)
                agree.append(cold.outputs[0].token_ids == warm.outputs[0].token_ids)
                llm.reset_prefix_cache()
            result["cold_vs_prefilled"] = {
                "cold_latency_s": cold_t, "prefilled_latency_s": warm_t,
                "cold_p50_s": statistics.median(cold_t),
                "prefilled_p50_s": statistics.median(warm_t),
                "outputs_agree": sum(agree), "n": len(agree),
            }
        return result
    finally:
        close_llm(llm)


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [report[k]["half_warm"] for k in ("prefix_lookup", "holes_one_per_step", "holes")]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    names = ["prefix-only\nlookup", "past misses,\none hole/step", "past misses,\nall holes/step"]
    colors = ["#999", "#8bc", "#2a7"]
    ax1.bar(names, [r["ttft_p50_s"] * 1e3 for r in rows], color=colors)
    ax1.set_ylabel("TTFT p50 (ms)")
    ax1.set_title(f"half of the spans warm ({report['ttft_ratio']:.2f}x, "
                  f"{report['one_step_ratio']:.2f}x)", fontsize=9)
    ax2.bar(names, [r["hit_rate"] * 100 for r in rows], color=colors)
    ax2.set_ylabel("prompt tokens reused (%)")
    ax2.set_title("cache hits")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results/span_reuse"))
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--spans", type=int, default=8)
    parser.add_argument("--span-tokens", type=int, default=192)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    from minipic.span_contract.engine_config import EngineSettings

    settings = EngineSettings().resolved()
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(settings.model).vocab_size
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    items = _prompts(seed, args.prompts, args.spans, args.span_tokens, settings.span_config,
                     vocab)
    max_len = max(len(i["tokens"]) for i in items) + 64
    max_len = -(-max_len // 256) * 256
    report: dict[str, Any] = {"seed": seed, "prompts": args.prompts, "spans": args.spans,
                              "span_tokens": args.span_tokens}
    for name in CONFIGS:
        report[name] = _measure(name, items, max_len)
    p50 = {name: report[name]["half_warm"]["ttft_p50_s"] for name in CONFIGS}
    report["ttft_ratio"] = p50["prefix_lookup"] / p50["holes"]
    report["one_step_ratio"] = p50["holes_one_per_step"] / p50["holes"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "span_reuse.json").write_text(json.dumps(report, indent=1))
    _plot(report, args.out / "span_reuse.png")
    h, s = report["holes"], report["prefix_lookup"]
    print(json.dumps({
        "ttft_p50_ms": {name: p50[name] * 1e3 for name in CONFIGS},
        "ttft_ratio": report["ttft_ratio"], "one_step_ratio": report["one_step_ratio"],
        "prefill_steps": {name: report[name]["half_warm"]["prefill_steps"]
                          for name in ("holes", "holes_one_per_step")},
        "hit_rate": {"holes": h["half_warm"]["hit_rate"],
                     "prefix_lookup": s["half_warm"]["hit_rate"]},
        "cold_vs_prefilled": {k: v for k, v in h["cold_vs_prefilled"].items()
                              if not isinstance(v, list)},
    }, indent=1))


if __name__ == "__main__":
    main()
