"""All holes per engine step vs one hole per step, on ``minipic bench``'s accuracy batch.

Runs the accuracy phase twice on the same machine, back to back: the product schedule (every
hole of a prompt in one step) and ``MINIPIC_HOLES_PER_STEP=one`` (the schedule before
``engine_ext/holes/scheduler_steps.py``), then draws TTFT p50 per mode and the scheduler's
prefill-step histogram of both into one figure. Usage::

    python benchmarks/holes_per_step.py --out results/bench_holes          # ~13 min, 2 cores
    python benchmarks/holes_per_step.py --out results/bench_holes --plot-only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from minipic.span_contract.env import HOLES_PER_STEP_ENV

RUNS = {"all holes / step": ("all", "."), "one hole / step": ("one", "one_hole_per_step")}


def _run(out: Path) -> None:
    for per_step, sub in RUNS.values():
        env = {**os.environ, HOLES_PER_STEP_ENV: per_step}
        subprocess.run([sys.executable, "-m", "minipic", "bench", "--phases", "accuracy",
                        "--out", str(out / sub)], check=True, env=env)


def _plot(out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reports: dict[str, dict[str, Any]] = {
        name: json.loads((out / sub / "bench.json").read_text())["accuracy"]
        for name, (_, sub) in RUNS.items()}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    modes = list(next(iter(reports.values())))
    width = 0.38
    for i, (name, acc) in enumerate(reports.items()):
        xs = [m + (i - 0.5) * width for m in range(len(modes))]
        bars = ax1.bar(xs, [acc[m]["ttft_p50_s"] * 1e3 for m in modes], width, label=name)
        ax1.bar_label(bars, fmt="%.0f", fontsize=7)
    ax1.set_xticks(range(len(modes)), modes, fontsize=8)
    ax1.set_ylabel("TTFT p50 (ms)")
    ax1.set_title("accuracy batch of minipic bench (69 q x 4 passages)", fontsize=9)
    ax1.legend(fontsize=8)
    counts = sorted({int(k) for acc in reports.values()
                     for k in acc["boundary_recompute"].get("prefill_steps", {})})
    for i, (name, acc) in enumerate(reports.items()):
        hist = acc["boundary_recompute"].get("prefill_steps", {})
        ax2.bar([c + (i - 0.5) * width for c in counts], [hist.get(str(c), 0) for c in counts],
                width, label=name)
    ax2.set_xticks(counts)
    ax2.set_xlabel("engine steps to prefill one prompt (scheduler count)")
    ax2.set_ylabel("prompts (finals and span prefills)")
    ax2.set_title("boundary_recompute", fontsize=9)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    path = out / "holes_per_step.png"
    fig.savefig(path, dpi=120)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results/bench_holes"))
    parser.add_argument("--plot-only", action="store_true",
                        help="redraw from OUT/bench.json and OUT/one_hole_per_step/bench.json")
    args = parser.parse_args()
    if not args.plot_only:
        _run(args.out)
    print(_plot(args.out))


if __name__ == "__main__":
    main()
