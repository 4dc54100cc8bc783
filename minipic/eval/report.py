"""The ``minipic eval`` report: built from a run (``evaluate``), as a Markdown table, as a
quality-vs-TTFT plot, and written to a folder."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from minipic.eval.datasets import EvalItem
from minipic.eval.runner import DEFAULT_MODES, TOP_K, finite, run_items, summarize, verdict

__all__ = ["evaluate", "plot", "table", "write"]


async def evaluate(orc: Any, items: Sequence[EvalItem], modes: Sequence[str] = DEFAULT_MODES,
                   *, max_tokens: int = 16, k: int = TOP_K, errors: Sequence[dict] = (),
                   progress: bool = True, seed: int = 0, concurrency: int = 1,
                   reference_orc: Any = None) -> dict[str, Any]:
    """The report for ``items`` on ``orc`` (an ``Orchestrator``): summary, records, errors.
    ``reference_orc``: the engine whose full attention every mode is compared with (default
    ``orc``; the base model when ``orc`` serves a tuned one)."""
    from tqdm import tqdm

    bar = tqdm(total=len(items), desc="eval", unit="item", disable=not progress)
    started = time.perf_counter()
    try:
        records, failed = await run_items(orc, items, modes, max_tokens=max_tokens, k=k,
                                          concurrency=concurrency, progress=bar.update,
                                          reference_orc=reference_orc)
    finally:
        bar.close()
    summary = summarize(records, modes, seed=seed)
    info = orc.backend.info
    return finite({
        "engine": {"kind": info.kind, "model": info.model, "max_model_len": info.max_model_len,
                   "reference_model": (reference_orc or orc).backend.info.model,
                   "span_config": (info.span_config.model_dump(mode="json")
                                   if info.span_config is not None else None)},
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
