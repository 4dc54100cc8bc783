"""``minipic eval``: how much each mode changes the answers, paired against full attention.

    minipic eval                                   # built-in QA, n=300, embedded default model
    minipic eval --data mine.jsonl --url http://127.0.0.1:8000
    minipic eval --n 40 --modes prefix,block_attention --out /tmp/eval

For every item and mode: KL(full ‖ mode) and top-1 agreement of the next-token distributions
over the full-attention answer (teacher-forced; the engine's top-20 log-probs), greedy exact
match with full attention and the first divergence, EM / F1 against the gold answer, and the
mode's warm TTFT, in one run; paired bootstrap CIs throughout (``minipic/eval/metrics.py``).
Writes ``eval.json`` (summary, per item, per-line errors), ``eval.md`` (the table) and
``eval.png`` (quality vs TTFT) to ``--out``. ``evaluate()`` is the same from Python.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from minipic.eval.datasets import EvalItem, builtin_items, load_jsonl
from minipic.eval.runner import DEFAULT_MODES, TOP_K, finite, run_items, summarize, verdict

__all__ = ["evaluate", "add_subparser"]


async def evaluate(orc: Any, items: Sequence[EvalItem], modes: Sequence[str] = DEFAULT_MODES,
                   *, max_tokens: int = 16, k: int = TOP_K, errors: Sequence[dict] = (),
                   progress: bool = True, seed: int = 0, concurrency: int = 1
                   ) -> dict[str, Any]:
    """The report for ``items`` on ``orc`` (an ``Orchestrator``): summary, records, errors."""
    from tqdm import tqdm

    bar = tqdm(total=len(items), desc="eval", unit="item", disable=not progress)
    started = time.perf_counter()
    try:
        records, failed = await run_items(orc, items, modes, max_tokens=max_tokens, k=k,
                                          concurrency=concurrency, progress=bar.update)
    finally:
        bar.close()
    summary = summarize(records, modes, seed=seed)
    info = orc.backend.info
    return finite({
        "engine": {"kind": info.kind, "model": info.model, "max_model_len": info.max_model_len},
        "machine": {"cpu": platform.processor() or platform.machine(),
                    "python": platform.python_version()},
        "settings": {"modes": list(modes), "max_tokens": max_tokens, "top_k": k,
                     "concurrency": concurrency, "items": len(items),
                     "kl": "top-k, tail-bucketed (minipic/eval/metrics.py)", "seed": seed},
        "wall_s": time.perf_counter() - started,
        "summary": summary, "verdict": verdict(summary),
        "errors": [*errors, *failed], "items": records,
    })


def table(report: dict[str, Any]) -> str:
    """The summary as a Markdown table."""
    s = report["summary"]
    lines = [f"n = {s['n']} items; KL over the full-attention answer tokens (top-"
             f"{report['settings']['top_k']}); 95% paired bootstrap CIs", "",
             "| mode | KL mean [CI] | KL p95 | top-1 agree [CI] | greedy = full | EM | F1 "
             "| F1 − full [CI] | TTFT p50 | hit rate |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def fmt(d: dict[str, Any] | None, pct: bool = False) -> str:
        if not d:
            return "—"
        scale = 100 if pct else 1
        low, high = d["ci95"]
        return f"{d['mean'] * scale:.3g} [{low * scale:.3g}, {high * scale:.3g}]"

    full = s.get("full_attention", {})
    lines.append(f"| full attention | 0 | 0 | 100% | 100% | {fmt(full.get('em'), True)} "
                 f"| {fmt(full.get('f1'), True)} | — | {full.get('ttft_p50_ms', 0):.0f} ms | — |")
    for mode, m in s["modes"].items():
        lines.append(
            f"| {mode} | {fmt(m['kl_mean'])} | {m['kl_p95']:.3g} | {fmt(m['top1_agreement'], True)}"
            f" | {m['exact_match_full']['mean']:.0%} | {fmt(m.get('em'), True)} "
            f"| {fmt(m.get('f1'), True)} | {fmt(m.get('f1_minus_full'), True)} "
            f"| {m['ttft_p50_ms']:.0f} ms | {m['hit_rate']:.0%} |")
    for name, c in s.get("comparisons", {}).items():
        lines.append(f"\n{name}: KL {fmt(c['kl_mean'])}, top-1 agreement "
                     f"{fmt(c['top1_agreement'], True)} (points)")
    if report.get("verdict"):
        lines.append(f"\n**{report['verdict']}**")
    if report.get("errors"):
        lines.append(f"\n{len(report['errors'])} item(s) or line(s) not evaluated: see eval.json")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = report["summary"]
    fig, ax = plt.subplots(figsize=(6, 4))
    full = s.get("full_attention", {})
    quality = "f1" if "f1" in full else None
    for mode, m in s["modes"].items():
        y = m[quality]["mean"] * 100 if quality else m["top1_agreement"]["mean"] * 100
        err = (m[quality] if quality else m["top1_agreement"])["half_width"] * 100
        ax.errorbar(m["ttft_p50_ms"], y, yerr=err, fmt="o", capsize=4, label=mode)
    if quality:
        ax.errorbar(full["ttft_p50_ms"], full["f1"]["mean"] * 100,
                    yerr=full["f1"]["half_width"] * 100, fmt="s", capsize=4, color="k",
                    label="full attention")
    ax.set_xlabel("TTFT p50 (ms, warm spans)")
    ax.set_ylabel("F1 (%)" if quality else "top-1 agreement with full attention (%)")
    ax.set_title(f"quality vs TTFT, n = {s['n']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(report, indent=1))
    (out / "eval.md").write_text(table(report))
    if report["summary"]["n"]:
        plot(report, out / "eval.png")


def add_subparser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "eval", help="answer quality of each mode vs full attention, beside its TTFT",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="builtin",
                   help="builtin (fanoutqa + BIG-bench knowledge conflicts), fanoutqa, cpkc, or "
                        "a JSONL of {question, documents, answer?, system?} (default builtin)")
    p.add_argument("--n", type=int, default=300, help="items (built-in data; default 300)")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help=f"comma-separated (default {','.join(DEFAULT_MODES)}); "
                        f"boundary_recompute@TOKENS sets its head length (default one block)")
    p.add_argument("--passages", default="3-10",
                   help="documents per built-in item, MIN-MAX (default 3-10)")
    p.add_argument("--max-tokens", type=int, default=16, help="answer length (default 16)")
    p.add_argument("--url", help="a running `minipic serve` (default: an embedded engine)")
    p.add_argument("--model", default=None, help="embedded model (default SmolLM2-135M)")
    p.add_argument("--concurrency", type=int, default=1,
                   help="items at once (their requests share engine steps; default 1)")
    p.add_argument("--max-words", type=int, default=80,
                   help="built-in passages are cut to this many words (default 80)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("results/eval"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from minipic.eval.runner import parse_mode

    modes = [m for m in args.modes.split(",") if m]
    try:
        for spec in modes:
            parse_mode(spec)
        if not modes:
            raise ValueError("--modes is empty")
    except ValueError as exc:
        print(f"minipic eval: {exc}")
        return 2
    try:
        low, high = (int(x) for x in args.passages.split("-"))
        assert 1 <= low <= high
    except (ValueError, AssertionError):
        print(f"minipic eval: --passages must be MIN-MAX, got {args.passages!r}")
        return 2
    errors: list[dict[str, Any]] = []
    if args.data.endswith(".jsonl"):
        if not Path(args.data).is_file():
            print(f"minipic eval: {args.data} not found")
            return 2
        loaded = load_jsonl(args.data)
        items, errors = loaded.items, loaded.errors
    else:
        items = builtin_items(args.data, args.n, args.seed, (low, high), args.max_words)
    print(f"minipic eval: {len(items)} items, modes {modes}, "
          f"{'server ' + args.url if args.url else 'embedded engine'}")
    from orchestrator import Orchestrator

    orc = Orchestrator.connect(args.url) if args.url else Orchestrator.embedded(args.model)
    report = asyncio.run(_run(args, orc, items, modes, errors))
    write(report, args.out)
    print(table(report))
    print(f"wrote {args.out}/eval.json, eval.md, eval.png")
    return 0


async def _run(args: argparse.Namespace, orc: Any, items: list[EvalItem], modes: list[str],
               errors: list[dict[str, Any]]) -> dict[str, Any]:
    try:
        return await evaluate(orc, items, modes, max_tokens=args.max_tokens, errors=errors,
                              seed=args.seed, concurrency=args.concurrency)
    finally:
        await orc.backend.aclose()
