"""Quality against TTFT across ``minipic eval`` runs: the rows users choose a mode by.

    python benchmarks/fidelity_frontier.py base=results/fidelity/base/eval.json \\
        tuned=results/fidelity/tuned/eval.json --out results/fidelity

Each input is one ``minipic eval`` report (its own engine, its full-attention reference and
TTFTs measured side by side in that run). Every mode of every run becomes a row: KL(full ‖ mode)
and top-1 agreement with paired CIs, greedy = full, warm TTFT p50 and its ratio to the same run's
full attention and block_attention, and whether it meets the fidelity goal of issue 37 (top-1
≥ 90%, KL ≤ 0.10, greedy = full ≥ 50%, TTFT ≤ 1.5× block_attention and ≤ 0.3× full attention).
The Pareto frontier (lower KL, lower TTFT ratio) is drawn over all rows.

``--paired OLD:NEW`` (labels of two runs on the same items, e.g. the code before and after a
change) adds, per mode both ran, the paired per-item difference NEW − OLD of KL and top-1 with
a bootstrap 95% CI: the items are the same, so the difference's CI is far narrower than the two
rows' CIs side by side.

``--transformers LABEL=levers.json[:VARIANT,...]`` adds rows measured in transformers alone
(``benchmarks/layout_levers.py``, ``benchmarks/span_selection.py``: layouts the engine does not
run, such as other sink gaps or other selections): KL, top-1 and greedy = full with their CIs,
no TTFT (not timed, so not on the frontier). Their KL is over the whole vocabulary, the engine's
over its top 20 with the rest in one bucket; the ``measured`` column says which.

Writes ``frontier.json``, ``frontier.md`` and ``frontier.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

GOAL = {"top1": 0.90, "kl": 0.10, "greedy": 0.50, "ttft_vs_block": 1.5, "ttft_vs_full": 0.3}


def rows_of(label: str, report: dict[str, Any]) -> list[dict[str, Any]]:
    s = report["summary"]
    full_ms = s["full_attention"]["ttft_p50_ms"]
    block = s["modes"].get("block_attention")
    out = []
    for mode, m in s["modes"].items():
        ttft = m["ttft_p50_ms"]
        row = {
            "run": label, "mode": mode, "n": s["n"], "measured": "engine",
            "model": report["engine"]["model"],
            "reference_model": report["engine"].get("reference_model", report["engine"]["model"]),
            "kl": m["kl_mean"]["mean"], "kl_ci": m["kl_mean"]["ci95"],
            "top1": m["top1_agreement"]["mean"], "top1_ci": m["top1_agreement"]["ci95"],
            "greedy": m["exact_match_full"]["mean"],
            "ttft_ms": ttft, "full_ttft_ms": full_ms, "ttft_vs_full": ttft / full_ms,
            "ttft_vs_block": ttft / block["ttft_p50_ms"] if block else None,
        }
        row["goal"] = {
            "top1": row["top1"] >= GOAL["top1"], "kl": row["kl"] <= GOAL["kl"],
            "greedy": row["greedy"] >= GOAL["greedy"],
            "ttft_vs_full": row["ttft_vs_full"] <= GOAL["ttft_vs_full"],
            "ttft_vs_block": (row["ttft_vs_block"] is not None
                              and row["ttft_vs_block"] <= GOAL["ttft_vs_block"]),
        }
        out.append(row)
    return out


def transformers_rows(label: str, report: dict[str, Any],
                      variants: list[str] | None = None) -> list[dict[str, Any]]:
    """Rows of a transformers benchmark's summary (``variants``: those only, in that order)."""
    nan = float("nan")
    summary = report["summary"]
    unknown = [v for v in variants or [] if v not in summary]
    if unknown:
        raise ValueError(f"{label}: no variant {unknown} (it has {list(summary)})")
    out = []
    for name in variants or list(summary):
        m = summary[name]
        out.append({
            "run": label, "mode": name, "n": report["meta"]["n"],
            "measured": "transformers", "model": report["meta"].get("model_name", ""),
            "reference_model": report["meta"].get("model_name", ""),
            "kl": m["kl"]["mean"], "kl_ci": m["kl"]["ci95"],
            "top1": m["top1"]["mean"], "top1_ci": m["top1"]["ci95"],
            "greedy": m["greedy_same"], "ttft_ms": nan, "full_ttft_ms": nan,
            "ttft_vs_full": nan, "ttft_vs_block": nan, "ttft_source": "not timed",
            "goal": {"top1": m["top1"]["mean"] >= GOAL["top1"], "kl": m["kl"]["mean"] <= GOAL["kl"],
                     "greedy": m["greedy_same"] >= GOAL["greedy"], "ttft_vs_full": False,
                     "ttft_vs_block": False},
        })
    return out


def with_ttft_from(rows: list[dict[str, Any]], report: dict[str, Any]) -> None:
    """Replace each row's TTFTs by those of a run made for timing (one item at a time, so a
    TTFT holds only its own request's work); the model's architecture decides the cost, so one
    timing run serves a base model and its tuned copy. ``prefix`` computes the whole prompt:
    it takes full attention's TTFT."""
    s = report["summary"]
    full_ms = s["full_attention"]["ttft_p50_ms"]
    block_ms = s["modes"]["block_attention"]["ttft_p50_ms"]
    for r in rows:
        if r.get("measured") == "transformers":
            continue
        timed = s["modes"].get(r["mode"])
        ms = full_ms if r["mode"] == "prefix" else timed["ttft_p50_ms"] if timed else None
        if ms is None:  # not timed: no TTFT rather than one measured under other load
            r.update(ttft_ms=float("nan"), ttft_vs_full=float("nan"),
                     ttft_vs_block=float("nan"), ttft_source="not timed")
            r["goal"]["ttft_vs_full"] = r["goal"]["ttft_vs_block"] = False
            continue
        r.update(ttft_ms=ms, full_ttft_ms=full_ms, ttft_vs_full=ms / full_ms,
                 ttft_vs_block=ms / block_ms, ttft_source="timing run")
        r["goal"]["ttft_vs_full"] = r["ttft_vs_full"] <= GOAL["ttft_vs_full"]
        r["goal"]["ttft_vs_block"] = r["ttft_vs_block"] <= GOAL["ttft_vs_block"]


def frontier(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows no other row beats on both KL and TTFT ratio (lower is better on both)."""
    keep = []
    rows = [r for r in rows if r["ttft_vs_full"] == r["ttft_vs_full"]]  # timed rows (no NaN)
    for r in rows:
        if not any(o is not r and o["kl"] <= r["kl"] and o["ttft_vs_full"] <= r["ttft_vs_full"]
                   and (o["kl"], o["ttft_vs_full"]) != (r["kl"], r["ttft_vs_full"])
                   for o in rows):
            keep.append(r)
    return sorted(keep, key=lambda r: r["ttft_vs_full"])


def table(rows: list[dict[str, Any]]) -> str:
    def ci(v: float, c: list[float], scale: float = 1.0, digits: int = 3) -> str:
        return f"{v * scale:.{digits}f} [{c[0] * scale:.{digits}f}, {c[1] * scale:.{digits}f}]"

    def mark(ok: bool) -> str:
        return "✓" if ok else "✗"

    def num(v: float | None, fmt: str) -> str:
        return "—" if v is None or v != v else format(v, fmt)  # None / NaN: not timed

    lines = ["| measured | run | mode | n | KL(full ‖ mode) [CI] | top-1 agree, % [CI] | "
             "greedy = full | warm TTFT p50, ms | × full | × block_attention | "
             "goal (top-1, KL, greedy, TTFT) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g = r["goal"]
        lines.append(
            f"| {r.get('measured', 'engine')} | {r['run']} | {r['mode']} | {r['n']} | "
            f"{ci(r['kl'], r['kl_ci'])} | {ci(r['top1'], r['top1_ci'], 100, 1)} | "
            f"{r['greedy'] * 100:.0f}% | {num(r['ttft_ms'], '.0f')} | "
            f"{num(r['ttft_vs_full'], '.2f')} | {num(r['ttft_vs_block'], '.2f')} | "
            f"{mark(g['top1'])} {mark(g['kl'])} {mark(g['greedy'])} "
            f"{mark(g['ttft_vs_full'] and g['ttft_vs_block'])} |")
    return "\n".join(lines)


def paired(old: dict[str, Any], new: dict[str, Any],
           modes: list[tuple[str, str]] | None = None) -> list[dict[str, Any]]:
    """Per mode both runs have (or per ``(old mode, new mode)`` of ``modes``): mean and
    bootstrap CI of NEW − OLD over their common items."""
    from minipic.eval.metrics import bootstrap_ci, bootstrap_indices

    before = {it["id"]: it for it in old["items"]}
    common = [it for it in new["items"] if it["id"] in before]
    out = []
    for old_mode, mode in modes or [(m, m) for m in new["summary"]["modes"]]:
        pairs = [(before[it["id"]]["modes"].get(old_mode), it["modes"].get(mode))
                 for it in common]
        pairs = [(a, b) for a, b in pairs if a and b and "kl_mean" in a and "kl_mean" in b]
        if not pairs:
            continue
        idx = bootstrap_indices(len(pairs))
        name = mode if old_mode == mode else f"{mode} − {old_mode}"
        row: dict[str, Any] = {"mode": name, "n": len(pairs)}
        for key in ("kl_mean", "top1_agreement"):
            mean, low, high = bootstrap_ci([b[key] - a[key] for a, b in pairs], indices=idx)
            row[key] = {"mean": mean, "ci95": [low, high]}
        out.append(row)
    return out


def paired_table(old_label: str, new_label: str, rows: list[dict[str, Any]]) -> str:
    lines = [f"| mode | n | Δ KL ({new_label} − {old_label}) [CI] | Δ top-1, points [CI] |",
             "|---|---|---|---|"]
    for r in rows:
        kl, top = r["kl_mean"], r["top1_agreement"]
        lines.append(f"| {r['mode']} | {r['n']} | {kl['mean']:+.3f} [{kl['ci95'][0]:+.3f}, "
                     f"{kl['ci95'][1]:+.3f}] | {top['mean'] * 100:+.1f} "
                     f"[{top['ci95'][0] * 100:+.1f}, {top['ci95'][1] * 100:+.1f}] |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], front: list[dict[str, Any]], path: Path) -> None:
    """KL and top-1 against TTFT for the timed rows; below, every row's KL (untimed ones too)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if r["ttft_vs_full"] == r["ttft_vs_full"]]
    fig = plt.figure(figsize=(13, 10.5))
    grid = fig.add_gridspec(2, 2, height_ratios=[1, 1.15])
    left, right = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
    bars = fig.add_subplot(grid[1, :])
    runs = sorted({r["run"] for r in timed})
    markers = dict(zip(runs, "osD^v<>ph*", strict=False))
    for r in timed:
        for ax, key, scale in ((left, "kl", 1.0), (right, "top1", 100.0)):
            low, high = r[f"{key}_ci"]
            y = r[key] * scale
            ax.errorbar(r["ttft_vs_full"], y, yerr=[[y - low * scale], [high * scale - y]],
                        fmt=markers[r["run"]], capsize=3)
            ax.annotate(f"{r['run']}: {r['mode']}", (r["ttft_vs_full"], y), fontsize=6,
                        xytext=(4, 3), textcoords="offset points")
    if front:
        left.plot([r["ttft_vs_full"] for r in front], [r["kl"] for r in front], "k--", lw=1,
                  label="Pareto frontier")
    left.axhline(GOAL["kl"], color="g", lw=1, ls=":", label=f"goal KL ≤ {GOAL['kl']}")
    right.axhline(GOAL["top1"] * 100, color="g", lw=1, ls=":",
                  label=f"goal top-1 ≥ {GOAL['top1'] * 100:.0f}%")
    for ax in (left, right):
        ax.axvline(GOAL["ttft_vs_full"], color="g", lw=1, ls=":")
        ax.set_xlabel("warm TTFT p50 / full attention's")
        ax.legend(fontsize=8)
    left.set_ylabel("KL(full ‖ mode) per answer token")
    right.set_ylabel("top-1 agreement with full attention, %")
    left.set_title("engine rows: closer to full attention is lower")
    right.set_title("engine rows: closer to full attention is higher")
    colors = {"engine": "tab:blue", "transformers": "tab:orange"}
    xs = range(len(rows))
    for x, r in zip(xs, rows, strict=True):
        low, high = r["kl_ci"]
        bars.bar(x, r["kl"], color=colors.get(r.get("measured", "engine"), "grey"),
                 yerr=[[r["kl"] - low], [high - r["kl"]]], capsize=2)
    bars.set_xticks(list(xs), [f"{r['run']}: {r['mode']}" for r in rows], rotation=75,
                    ha="right", fontsize=6)
    bars.axhline(GOAL["kl"], color="g", lw=1, ls=":")
    bars.set_ylabel("KL [95% CI]")
    bars.set_title("every row (blue: engine, top-20 KL; orange: transformers, full-vocab KL)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+",
                        help="LABEL=path/to/eval.json[:MODE,...] (rows and --paired rows of "
                             "those modes only); "
                             "~LABEL=...: a run used only for --paired (no rows: its TTFTs are "
                             "another code's)")
    parser.add_argument("--out", type=Path, default=Path("results/fidelity"))
    parser.add_argument("--ttft-from", type=Path, default=None,
                        help="an eval.json run with --concurrency 1 whose TTFTs replace the "
                             "quality runs' (theirs include other items' work when they ran "
                             "several items at once)")
    parser.add_argument("--paired", action="append", default=[], metavar="OLD:NEW",
                        help="two run labels on the same items: per-item paired NEW - OLD "
                             "(over the items both ran); repeatable")
    parser.add_argument("--transformers", action="append", default=[],
                        metavar="LABEL=PATH[:VARIANT,...]",
                        help="rows of a transformers benchmark's JSON (layout_levers, "
                             "span_selection), all variants or those named; repeatable")
    parser.add_argument("--mode-pair", action="append", default=[], metavar="RUN:OLD>NEW",
                        help="two modes of one run, per item: NEW - OLD (e.g. "
                             "sink:block_attention/no-sink>block_attention); repeatable")
    args = parser.parse_args(argv)
    rows = []
    reports: dict[str, dict[str, Any]] = {}
    kept: dict[str, list[str]] = {}  # the modes a run spec names (empty: all)
    for spec in args.runs:
        label, sep, rest = spec.partition("=")
        path, _, names = rest.partition(":")
        if not sep or not Path(path).is_file():
            parser.error(f"{spec!r}: expected LABEL=path/to/eval.json[:MODE,...] (an existing "
                         f"file)")
        paired_only = label.startswith("~")
        label = label.lstrip("~")
        reports[label] = json.loads(Path(path).read_text())
        keep = [m for m in names.split(",") if m]
        kept[label] = keep
        if not paired_only:
            rows += [r for r in rows_of(label, reports[label]) if not keep or r["mode"] in keep]
    if args.ttft_from is not None:
        if not args.ttft_from.is_file():
            parser.error(f"--ttft-from {args.ttft_from}: no such file")
        with_ttft_from(rows, json.loads(args.ttft_from.read_text()))
    for spec in args.transformers:
        label, sep, rest = spec.partition("=")
        path, _, names = rest.partition(":")
        if not sep or not Path(path).is_file():
            parser.error(f"--transformers {spec!r}: expected LABEL=PATH[:VARIANT,...]")
        try:
            rows += transformers_rows(label, json.loads(Path(path).read_text()),
                                      [v for v in names.split(",") if v] or None)
        except ValueError as exc:
            parser.error(str(exc))
    front = frontier(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"goal": GOAL, "rows": rows, "ttft_from": str(args.ttft_from or ""),
              "frontier": [(r["run"], r["mode"]) for r in front],
              "meets_goal": [(r["run"], r["mode"]) for r in rows if all(r["goal"].values())]}
    text = table(rows)
    for spec in args.paired:
        old, sep, new = spec.partition(":")
        if not sep or old not in reports or new not in reports:
            parser.error(f"--paired {spec!r}: expected OLD:NEW, two of the run labels")
        modes = [(m, m) for m in reports[new]["summary"]["modes"]
                 if all(m in kept[run] for run in (old, new) if kept[run])]
        pair = {"old": old, "new": new, "rows": paired(reports[old], reports[new], modes)}
        report.setdefault("paired", []).append(pair)
        text += "\n\n" + paired_table(old, new, pair["rows"])
    for spec in args.mode_pair:
        run, _, pair = spec.partition(":")
        old_mode, sep, new_mode = pair.partition(">")
        if run not in reports or not sep:
            parser.error(f"--mode-pair {spec!r}: expected RUN:OLD_MODE>NEW_MODE")
        rows_ = paired(reports[run], reports[run], [(old_mode, new_mode)])
        report.setdefault("mode_pairs", []).extend({"run": run, **r} for r in rows_)
        text += "\n\n" + paired_table(f"{run}:{old_mode}", f"{run}:{new_mode}", rows_)
    (args.out / "frontier.json").write_text(json.dumps(report, indent=1))
    (args.out / "frontier.md").write_text(text + "\n")
    plot(rows, front, args.out / "frontier.png")
    print(text)
    print(f"Pareto frontier: {report['frontier']}; "
          f"meets the goal: {report['meets_goal'] or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
