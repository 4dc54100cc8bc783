"""Sparse recurrent-state checkpoints in a real vLLM engine: recompute vs state memory vs time.

    python benchmarks/hybrid_checkpoints.py --out results/hybrid

One engine (tiny random Qwen3-Next hybrid, bf16, CPU, plugin feature ``ckpt``) serves a trace of
requests ``doc[:t] + question`` whose overlap depths ``t`` follow the planner's evaluation shapes
(``benchmarks/planner_eval.py``: QuALITY-like, NarrativeQA-like, system-prompt-like), scaled to a
document of N = 14 recurrent blocks. The same trace is replayed, after a prefix-cache reset, under
each retention policy, all chosen per request through ``vllm_xargs``/``extra_args``:

* ``dp``            — the optimal plan for the trace's depth distribution, budget M;
* ``balanced``      — M equally spaced checkpoints (optimal for uniform depths), same M;
* ``every_block``   — state kept at every block boundary: vLLM "align" caching with dense
                      retention (chunk ends forced to every boundary, as with
                      ``max_num_batched_tokens = block``);
* ``vllm_default``  — stock vLLM 0.32 (``prefix_cache_retention_interval=0``): it keeps each
                      prompt's tail and, Marconi-style, the junction where a request's dense
                      attention hit outran its recurrent hit;
* ``dp_learned``    — the server plan learned online from observed hits (``learn``, budget M,
                      re-planned every 8 requests, uniform prior before that);
* ``dp_match``      — dp with the smallest budget whose *expected* recompute is within 10% of
                      every-block's (from the planner sweep): the memory that target really costs.

Measured per policy: recomputed prompt tokens (prompt − cached, vLLM's ``num_cached_tokens``),
its part inside the shared document (``t − cached``), recurrent-state memory held at the end
(hashed GDN state blocks in the EngineCore block pool × state bytes per block), and prefill time
(wall time of the ``max_tokens=1`` requests). The document is warmed once per policy (``doc``
itself, not counted). ``M = floor(K / 4)`` for K document blocks, so dp holds at most a quarter of
every-block's document checkpoints. A planner-only sweep (no engine) adds the expected recompute
of dp / balanced / every-block for every budget at the engine's block size.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

SEED = 20260611
BLOCKS = 14  # document length in recurrent blocks
MAX_MODEL_LEN = 8192  # the tiny model's config says 4096; hf_overrides lifts it (random weights)
SUFFIX = (32, 96)  # question length range
TOKEN_RANGE = (1000, 40000)
POLICIES = ("dp", "balanced", "every_block", "vllm_default", "dp_learned", "dp_match")
COLORS = {"dp": "tab:blue", "balanced": "tab:orange", "every_block": "tab:green",
          "vllm_default": "tab:gray", "dp_learned": "tab:purple", "dp_match": "tab:cyan"}


def distributions(n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The three shapes of ``planner_eval.py``, at prefix length n."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import planner_eval

    return {
        "quality": planner_eval.quality_like(n, rng),
        "narrativeqa": planner_eval.narrativeqa_like(n, rng),
        "sysprompt": planner_eval.sysprompt_like(n, rng, planner_eval.system_prompt_lengths()),
    }


def run_trace(llm: Any, doc: list[int], trace: list[tuple[int, list[int]]],
              xargs: Any) -> dict[str, Any]:
    """Warm ``doc``, replay the trace, read what the engine retained."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from minipic.engine_ext.recurrent.checkpoints import checkpoint_stats
    from minipic.engine_ext.recurrent.policy import OVERRIDE_KEY

    params = SamplingParams(max_tokens=1, temperature=0.0,
                            extra_args=None if xargs is None else {OVERRIDE_KEY: xargs})

    def one(ids: list[int]) -> tuple[int, float]:
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        return out.num_cached_tokens, time.perf_counter() - t0

    assert llm.reset_prefix_cache(), "prefix cache reset refused"
    _, warm_s = one(doc)
    cached, seconds, prompt_tokens, prefix_recompute = [], [], [], []
    for depth, suffix in trace:
        ids = doc[:depth] + suffix
        c, s = one(ids)
        cached.append(c)
        seconds.append(s)
        prompt_tokens.append(len(ids))
        prefix_recompute.append(depth - min(c, depth))
    st = checkpoint_stats(llm, doc)
    n_groups = len(st["mamba_groups"])
    return {
        "warm_seconds": warm_s,
        "prefill_seconds": float(sum(seconds)),
        "recomputed_tokens": int(sum(prompt_tokens) - sum(cached)),
        "prompt_tokens": int(sum(prompt_tokens)),
        "prefix_recompute_tokens": int(sum(prefix_recompute)),
        "mean_prefix_recompute": float(np.mean(prefix_recompute)),
        "cached_tokens": cached,
        "state_blocks": st["state_blocks_total"],
        "state_positions": st["state_blocks_total"] / n_groups,
        "state_bytes": st["state_bytes_total"],
        "state_page_bytes": st["state_page_bytes_total"],
        "doc_checkpoints": st["resumable_positions"],
        "attention_blocks": sum(st["attention_blocks"].values()),
        "server_plan": (st["policy"] or {}).get("server_plan"),
    }


def planner_sweep(dists: dict[str, np.ndarray], g: int) -> dict[str, Any]:
    """Expected recompute per request in the document vs budget (planner only, no engine)."""
    from minipic.checkpoint_planner import expected_recompute, plan_checkpoints

    out: dict[str, Any] = {}
    for name, p in dists.items():
        k = (p.size - 1) // g
        every = expected_recompute(p, plan_checkpoints(p, k, "block", g))
        rec = {"budgets": list(range(0, k + 1)), "every_block": every,
               "dp": [], "balanced": []}
        for m in rec["budgets"]:
            for method in ("dp", "balanced"):
                rec[method].append(expected_recompute(p, plan_checkpoints(p, m, method, g)))
        within = [m for m, v in zip(rec["budgets"], rec["dp"], strict=True)
                  if v <= 1.1 * every + 1e-9]
        rec["min_budget_dp_within_10pct_of_every_block"] = within[0] if within else None
        out[name] = rec
    return out


def plot(results: dict[str, Any], sweep: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dists = list(results)
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.6))
    width = 0.8 / len(POLICIES)
    panels = [
        ("mean_prefix_recompute", "recomputed document tokens / request", 1.0),
        ("state_bytes", "recurrent state held (MiB; hatched: off-document)", 1 / 2**20),
        ("prefill_seconds", "prefill time of the trace (s)", 1.0),
    ]
    for ax, (key, label, scale) in zip(axes, panels, strict=False):
        for i, pol in enumerate(POLICIES):
            recs = [results[d]["policies"][pol] for d in dists]
            x = np.arange(len(dists)) + (i - (len(POLICIES) - 1) / 2) * width
            vals = np.array([r[key] * scale for r in recs])
            if key != "state_bytes":
                ax.bar(x, vals, width, label=pol, color=COLORS[pol])
                continue
            # solid: checkpoints on the shared document; hatched: on requests' own suffixes
            per_pos = np.array([r["state_bytes"] / max(r["state_positions"], 1) for r in recs])
            doc = np.array([len(r["doc_checkpoints"]) for r in recs]) * per_pos * scale
            ax.bar(x, doc, width, label=pol, color=COLORS[pol])
            ax.bar(x, vals - doc, width, bottom=doc, color=COLORS[pol], alpha=0.45,
                   hatch="//", edgecolor="white")
        ax.set_xticks(np.arange(len(dists)), dists)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    ax = axes[3]
    for name, rec in sweep.items():
        line = ax.plot(rec["budgets"], rec["dp"], marker="o", ms=3, label=f"{name} dp")[0]
        ax.plot(rec["budgets"], rec["balanced"], ls=":", color=line.get_color(),
                label=f"{name} balanced")
        ax.axhline(rec["every_block"], ls="--", lw=0.8, color=line.get_color())
    ax.set_xlabel("budget M (checkpoints)")
    ax.set_ylabel("expected recompute / request (planner)")
    ax.set_title("dashed: every block", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    g = next(iter(results.values()))["block_size"]
    m = next(iter(results.values()))["budget"]
    fig.suptitle(f"tiny Qwen3-Next on vLLM CPU: recurrent block {g} tokens, document "
                 f"{BLOCKS} blocks, budget M={m} for dp/balanced")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/hybrid")
    parser.add_argument("--requests", type=int, default=96, help="trace length per distribution")
    parser.add_argument("--dists", default="quality,narrativeqa,sysprompt")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from minipic.checkpoint_planner import expected_recompute, plan_checkpoints
    from minipic.engine_ext.recurrent.checkpoints import checkpoint_stats, configure_checkpoints
    from minipic.engine_ext.recurrent.policy import CheckpointConfig
    from minipic.span_contract.engine_config import EngineSettings, build_llm, close_llm

    t_start = time.perf_counter()
    settings = EngineSettings(
        model="tiny-qwen3-next", dtype="bfloat16", pic=True, features=("ckpt",),
        max_model_len=MAX_MODEL_LEN, ckpt=CheckpointConfig(budget=0),
        extra={"hf_overrides": {"max_position_embeddings": MAX_MODEL_LEN}},
    )
    llm = build_llm(settings)
    startup = time.perf_counter() - t_start
    try:
        base = checkpoint_stats(llm)
        g = base["policy"]["block_size"]
        n = BLOCKS * g
        if n + SUFFIX[1] > MAX_MODEL_LEN:
            raise SystemExit(f"recurrent block {g}: a {BLOCKS}-block document does not fit")
        budget = BLOCKS // 4
        rng = np.random.default_rng(SEED)
        dists = {k: v for k, v in distributions(n, rng).items() if k in args.dists.split(",")}
        sweep = planner_sweep(dists, g)
        results: dict[str, Any] = {}
        for name, p in dists.items():
            doc = rng.integers(*TOKEN_RANGE, size=n).tolist()
            depths = rng.choice(n + 1, size=args.requests, p=p)
            trace = [(int(t), rng.integers(*TOKEN_RANGE, size=int(rng.integers(*SUFFIX)))
                      .tolist()) for t in depths]
            plans = {m: plan_checkpoints(p, budget, m, g) for m in ("dp", "balanced")}
            m_match = sweep[name]["min_budget_dp_within_10pct_of_every_block"]
            plans["dp_match"] = plan_checkpoints(p, m_match, "dp", g)
            rec: dict[str, Any] = {
                "block_size": g, "n": n, "budget": budget, "requests": args.requests,
                "depths": depths.tolist(), "plans": plans, "policies": {},
                "expected_prefix_recompute": {
                    m: expected_recompute(p, pos) for m, pos in plans.items()
                } | {"every_block": expected_recompute(p, list(range(g, n + 1, g)))},
            }
            for pol in POLICIES:
                t0 = time.perf_counter()
                if pol == "dp_learned":
                    configure_checkpoints(llm, CheckpointConfig(budget=budget, learn=True,
                                                                replan_every=8))
                    xargs = None
                else:
                    configure_checkpoints(llm, CheckpointConfig(budget=0))
                    xargs = {"every_block": "all", "vllm_default": "vllm"}.get(pol, plans.get(pol))
                res = run_trace(llm, doc, trace, xargs)
                res["policy_seconds"] = time.perf_counter() - t0
                rec["policies"][pol] = res
                print(f"{name:12s} {pol:13s} prefix recompute {res['mean_prefix_recompute']:7.1f}"
                      f"/req  state {res['state_positions']:5.1f} ckpts "
                      f"{res['state_bytes'] / 2**20:6.2f} MiB  prefill "
                      f"{res['prefill_seconds']:6.2f}s  doc ckpts {res['doc_checkpoints']}",
                      file=sys.stderr, flush=True)
            pols = rec["policies"]
            every, dp, bal = pols["every_block"], pols["dp"], pols["balanced"]
            rec["summary"] = {
                "dp_recompute_vs_every_block": dp["recomputed_tokens"]
                / max(every["recomputed_tokens"], 1),
                "dp_prefix_recompute_vs_every_block": dp["prefix_recompute_tokens"]
                / max(every["prefix_recompute_tokens"], 1),
                "dp_state_vs_every_block": dp["state_bytes"] / max(every["state_bytes"], 1),
                "dp_doc_ckpts_vs_every_block": len(dp["doc_checkpoints"])
                / max(len(every["doc_checkpoints"]), 1),
                "dp_beats_balanced": dp["recomputed_tokens"] < bal["recomputed_tokens"],
                "dp_within_10pct_of_every_block": dp["recomputed_tokens"]
                <= 1.1 * every["recomputed_tokens"],
                "dp_state_at_most_quarter": dp["state_bytes"] <= 0.25 * every["state_bytes"],
                "dp_match_budget": m_match,
                "dp_match_recompute_vs_every_block": pols["dp_match"]["recomputed_tokens"]
                / max(every["recomputed_tokens"], 1),
                "dp_match_state_vs_every_block": pols["dp_match"]["state_bytes"]
                / max(every["state_bytes"], 1),
            }
            results[name] = rec
        configure_checkpoints(llm, None)
    finally:
        close_llm(llm)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "engine": {"model": "tiny-qwen3-next (3 GDN + 1 attention layer, random, bf16)",
                   "max_model_len": MAX_MODEL_LEN, "startup_seconds": startup,
                   "state_bytes_per_block": base["state_bytes_per_block"],
                   "page_bytes_per_block": base["page_bytes_per_block"]},
        "results": results, "planner_sweep": sweep,
        "total_seconds": time.perf_counter() - t_start,
    }
    (out / "hybrid_checkpoints.json").write_text(json.dumps(report, indent=1))
    plot(results, sweep, out / "hybrid_checkpoints.png")
    print(json.dumps({d: r["summary"] for d, r in results.items()}, indent=1))
    print(f"total {report['total_seconds']:.0f}s -> {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
