"""``minipic bench``: the numbers users choose us by (JSON + PNG plots under ``results/``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from minipic.bench.runner import PHASES


def add_subparser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench", help="paper-style evaluation: throughput, TTFT, agent memory, accuracy",
        description=(
            "Runs stock vLLM (prefix caching, plugin off) and minipic side by side in one "
            "process on the default model and writes results/bench/bench.json plus PNG plots "
            "(KV memory in use included). "
            "Phases: throughput (vanilla vs minipic barrier vs ISPS, PIC-off overhead), ttft "
            "(~2k-token contexts, sweeps over span count and length), agent (tool memory), "
            "accuracy (full attention vs block_attention vs boundary_recompute). About 16 "
            "minutes at --scale 1 on 2 cores (measured: 16 min plus set-up)."
        ),
    )
    p.add_argument("--out", type=Path, default=Path("results/bench"),
                   help="output folder (default results/bench)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply workload sizes (default 1.0; e.g. 0.3 for a quick look)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--phases", default=",".join(PHASES),
                   help=f"comma-separated subset of {','.join(PHASES)}")
    p.add_argument("--plot-only", action="store_true",
                   help="redraw the plots and table from OUT/bench.json without running")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from minipic.bench.plots import write_plots
    from minipic.bench.summary import summary_table

    console = Console()
    phases = [p for p in args.phases.split(",") if p]
    unknown = set(phases) - set(PHASES)
    if unknown:
        console.print(f"[red]unknown phases {sorted(unknown)}; choose from {PHASES}")
        return 2
    if args.plot_only:
        source = args.out / "bench.json"
        if not source.is_file():
            console.print(f"[red]{source} not found: run `minipic bench --out {args.out}` first")
            return 2
        report = json.loads(source.read_text())
    else:
        report = _run_with_progress(console, args.out, phases, args.scale, args.seed)
    plots = write_plots(report, args.out)
    console.print(summary_table(report))
    written = [str(p) for p in plots] if args.plot_only else [str(args.out / "bench.json"),
                                                               *map(str, plots)]
    console.print(f"wrote {', '.join(written)}")
    return 0


def _run_with_progress(console: Any, out: Path, phases: list[str], scale: float,
                       seed: int) -> dict[str, Any]:
    """Run the phases under one progress bar: a step per engine start, batch, sweep point,
    agent turn or accuracy mode, with the current step's name and the elapsed time."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from minipic.bench.runner import Bench, run_sync

    total = Bench(scale, seed, lambda _: None).planned_steps(phases)
    columns = (TextColumn("[bold]bench[/]"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("{task.description}"))
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("starting", total=total)
        started = [False]

        def step(message: str) -> None:
            if started[0]:  # a new step starts: the previous one is done
                progress.advance(task)
            started[0] = True
            progress.update(task, description=message)

        report = run_sync(out, phases, scale, seed, step)
        progress.update(task, completed=total, description="done")
    return report
