"""TTFT against its bound: the pure part of ``benchmarks/ttft_bound.py`` (no engine here).

Why a bound: a cached final prompt cannot produce its first token sooner than the engine
computes its uncached tokens (the question block), so the TTFT speed-up of span caching is
bounded by the cost of the whole prompt over the cost of its holes. Measured, not modelled:

    speedup = stock TTFT(full prompt) / minipic TTFT(cached final)
    bound   = stock TTFT(full prompt) / stock TTFT(a prompt of only the uncached tokens)
    ratio   = speedup / bound = stock TTFT(uncached tokens) / minipic TTFT(cached final)

so ``ratio`` does not depend on the long stock prefill at all: it says how close a cached final
comes to the cost of prefilling just its question. Two more references make the gap legible:
``ideal`` (stock vLLM with the same prefix cached, at the same positions: the question attends to
the whole context but nothing is rotated, planned or looked up past a miss) and ``repeat``
(minipic with the same spans in the same order as its previous final, so the key shadow
already holds every block at its slot and nothing is re-rotated).

This module computes those figures from the samples, groups a step profile
(``engine_ext/profiling/step_profile.py``) into the buckets of ``breakdown.json``, and draws the
plot.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from minipic.engine_ext.profiling.step_profile import Event, exclusive_by_path, in_window

# The goals a cached final is held to: close to its bound, and far ahead of stock.
RATIO_GOAL = 0.9  # speed-up within 10% of the measured bound ...
SPEEDUP_GOAL = 100.0  # ... and at least 100x at 8k-token prompts
SPEEDUP_GOAL_AT = 8192


def spans_for(size: int, span_tokens: int, block_size: int, reserve: int) -> int:
    """How many spans of ``span_tokens`` fit a prompt of about ``size`` tokens.

    ``reserve``: tokens kept for the system block, the question block and the generated token
    (they must stay inside ``max_model_len``). Spans are padded to whole blocks, so a span costs
    ``span_tokens`` rounded up to the block size.
    """
    per_span = -(-span_tokens // block_size) * block_size
    return max(1, (size - reserve) // per_span)


def bound(stock_full_s: float, stock_uncached_s: float) -> float:
    """The measured bound: stock prefill of everything over stock prefill of the holes."""
    if stock_uncached_s <= 0:
        raise ValueError(f"stock TTFT of the uncached tokens must be > 0, got {stock_uncached_s}")
    return stock_full_s / stock_uncached_s


def median(values: Sequence[float]) -> float:
    """Median, NaN when empty (a size whose long stock run was skipped still reports)."""
    if not values:
        return float("nan")
    return float(statistics.median(values))


def point_summary(size: int, samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One prompt size: medians of each measurement and the speed-up, bound and their ratio.

    Each sample (one question over one document order) has ``minipic_s`` and
    ``stock_uncached_s`` and, for some, ``repeat_s``, ``stock_full_s``, ``stock_ideal_s``
    (seconds; the long stock prefill runs fewer times than the cheap pair), plus
    ``prompt_tokens`` and ``cached_tokens``. Each median is over the samples that have the key;
    ratios are taken between medians (one noisy request moves a median less than a mean of
    ratios).
    """
    med = {key: median([s[key] for s in samples if key in s])
           for key in ("minipic_s", "repeat_s", "stock_full_s", "stock_ideal_s",
                       "stock_uncached_s")}
    prompt = median([s["prompt_tokens"] for s in samples])
    cached = median([s["cached_tokens"] for s in samples])
    speedup = med["stock_full_s"] / med["minipic_s"]
    the_bound = bound(med["stock_full_s"], med["stock_uncached_s"])
    ratio = speedup / the_bound
    return {
        "size": size, "samples": len(samples),
        "stock_full_runs": sum("stock_full_s" in s for s in samples),
        "prompt_tokens": prompt, "cached_tokens": cached, "uncached_tokens": prompt - cached,
        **{f"{key}_p50": value for key, value in med.items()},
        "speedup": speedup, "bound": the_bound, "speedup_over_bound": ratio,
        # references: the same prompt on stock with its prefix cached (no rotation, no lookup
        # past misses), and minipic with the key shadow already holding the order
        "ideal_speedup": med["stock_full_s"] / med["stock_ideal_s"],
        "ideal_over_bound": med["stock_uncached_s"] / med["stock_ideal_s"],
        "repeat_speedup": med["stock_full_s"] / med["repeat_s"],
        "repeat_over_bound": med["stock_uncached_s"] / med["repeat_s"],
        # what the cached final costs beyond prefilling its holes alone
        "gap_ms": (med["minipic_s"] - med["stock_uncached_s"]) * 1e3,
        "meets_ratio_goal": ratio >= RATIO_GOAL,
        "meets_speedup_goal": None if size < SPEEDUP_GOAL_AT else speedup >= SPEEDUP_GOAL,
    }


def goals(points: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The issue's goals against the measured points (honest booleans, with the numbers)."""
    return {
        "speedup_over_bound_goal": RATIO_GOAL,
        "speedup_goal": {"at_size": SPEEDUP_GOAL_AT, "speedup": SPEEDUP_GOAL},
        "ratio_met": {str(p["size"]): p["meets_ratio_goal"] for p in points},
        "speedup_met": {str(p["size"]): p["meets_speedup_goal"] for p in points
                        if p["meets_speedup_goal"] is not None},
    }


# -- profile breakdown -------------------------------------------------------------------------

# (bucket, rule over a call path) in order: a path goes to the first bucket whose rule matches.
# Only time on the request's critical path is bucketed: the EngineCore's main-thread work and
# the worker's; waits (the core blocked on the worker's result), the input/output threads and
# the front-end are what "transport, front-end, waiting" (the rest of the TTFT) is made of.
def _label(path: str) -> str:
    """The innermost label of a call path (what the time was spent in)."""
    return path.rsplit("/", 1)[-1]


def _under(path: str, label: str) -> bool:
    """Whether a call ran inside a ``label`` call (one label times several callers)."""
    return label in path.split("/")[:-1]


BUCKETS: tuple[tuple[str, Callable[[str], bool]], ...] = (
    ("off-home fill: rotate keys", lambda p: _under(p, "attn.off_home")
     and _label(p) == "attn.rotate"),
    ("off-home fill: gather / scatter key pages", lambda p: _under(p, "attn.off_home")
     and _label(p) in ("attn.gather_keys", "attn.move_keys")),
    ("off-home fill: shadow pages (map / give back)",
     lambda p: _label(p) == "attn.shadow_pages"),
    ("off-home attention kernel", lambda p: _under(p, "attn.off_home")
     and _label(p) == "attn.kernel"),
    ("off-home fill: copies (home blocks, private scratch)",
     lambda p: _label(p) == "attn.off_home"),
    ("masked attention (rule 1: torch path)", lambda p: _under(p, "attn.masked")
     or _label(p) == "attn.masked"),
    ("home attention kernel", lambda p: _label(p) == "attn.kernel"),
    ("KV write (incl. RoPE at write)", lambda p: _under(p, "attn.layer") and (
        _under(p, "attn.write") or _label(p) in ("attn.write", "attn.reshape_and_cache",
                                                 "attn.rotate"))),
    ("attention layer, other", lambda p: _label(p) == "attn.layer"),
    # the rest of the forward: projections, MLPs, norms, RoPE on queries, stock's KV write
    ("model compute outside attention", lambda p: _under(p, "runner.model_forward")
     or _label(p) == "runner.model_forward"),
    ("step planning (plan_step)", lambda p: _under(p, "plan.step_plan")
     or _label(p) == "plan.step_plan"),
    ("span view (step_span_view)", lambda p: _label(p) == "plan.span_view"),
    ("attention metadata, other", lambda p: _label(p) == "runner.attn_metadata"),
    ("prepare inputs", lambda p: _label(p) == "runner.prepare_inputs"),
    ("sampling", lambda p: _label(p) in ("runner.sample", "worker.sample_tokens")),
    ("worker execute_model, other", lambda p: _label(p) == "worker.execute_model"),
    ("scheduling: lookup (incl. past misses)", lambda p: _label(p) in (
        "sched.lookup", "holes.find_cached_runs") or _under(p, "sched.lookup")),
    ("scheduling: attach cached runs", lambda p: _label(p) == "holes.attach_reached_runs"),
    ("scheduling: other", lambda p: _label(p) in ("sched.schedule", "sched.allocate")),
    ("core: add request", lambda p: _label(p) == "core.add_request"),
    ("core: update from output", lambda p: _label(p) == "sched.update_from_output"),
)
REST = "transport, front-end, waiting"
# timed, but overlapping the buckets (waits, other threads, the caller's process): reported
# beside the breakdown, never added to it
INFO_LABELS = ("core.step", "core.execute_model", "core.sample_tokens", "core.send_output",
               "core.preprocess_add_request", "frontend.process_inputs", "frontend.send",
               "frontend.process_outputs")


def bucket_of(path: str) -> str | None:
    """The breakdown bucket of a call path (None: informational, not on the critical path)."""
    if _label(path) in INFO_LABELS:
        return None
    for name, rule in BUCKETS:
        if rule(path):
            return name
    return None


def breakdown(events: Iterable[Event], t_sent: float, t_first: float,
              pids: set[int] | None) -> dict[str, Any]:
    """One request's TTFT in milliseconds by bucket; ``REST`` = TTFT minus the buckets.

    ``events``: the step profile of every process; ``pids``: the processes of the engine that
    served the request (plus the caller's, for the front-end figures). Events are clipped to
    ``[t_sent, t_first]``.
    """
    window = in_window(events, t_sent, t_first, pids)
    exclusive = exclusive_by_path(window)
    buckets = {name: 0.0 for name, _ in BUCKETS}
    info: dict[str, float] = {}
    for path, seconds in exclusive.items():
        name = bucket_of(path)
        if name is None:
            label = _label(path)
            info[label] = info.get(label, 0.0) + seconds * 1e3
        else:
            buckets[name] += seconds * 1e3
    total = (t_first - t_sent) * 1e3
    buckets[REST] = total - sum(buckets.values())
    # steps that ran the model (vLLM also runs an empty step after a request finishes)
    steps = sum(1 for e in window if _label(e.path) == "runner.model_forward")
    return {"ttft_ms": total, "engine_steps": steps, "buckets_ms": buckets, "info_ms": info}


def median_breakdown(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Bucket-wise medians over requests (each bucket its own median, so they need not sum)."""
    if not rows:
        return {}
    names = list(rows[0]["buckets_ms"])
    info_names = sorted({k for r in rows for k in r["info_ms"]})
    return {
        "requests": len(rows),
        "ttft_ms": median([r["ttft_ms"] for r in rows]),
        "engine_steps": median([r["engine_steps"] for r in rows]),
        "buckets_ms": {n: median([r["buckets_ms"][n] for r in rows]) for n in names},
        "info_ms": {n: median([r["info_ms"].get(n, 0.0) for r in rows]) for n in info_names},
    }


FILL_BUCKETS = tuple(name for name, _ in BUCKETS if name.startswith("off-home fill: "))
KERNEL_BUCKETS = ("off-home attention kernel", "home attention kernel")


def gap_analysis(minipic: dict[str, Any], uncached: dict[str, Any]) -> dict[str, float]:
    """Split minipic's TTFT minus the bound's denominator (stock on the holes alone) into the
    off-home fill, the extra attention over the cached context, transport and the rest
    (bucket medians of ``median_breakdown``; the parts sum to the gap)."""
    a, b = minipic["buckets_ms"], uncached["buckets_ms"]
    gap = minipic["ttft_ms"] - uncached["ttft_ms"]
    fill = sum(a.get(n, 0.0) - b.get(n, 0.0) for n in FILL_BUCKETS)
    kernel = sum(a.get(n, 0.0) - b.get(n, 0.0) for n in KERNEL_BUCKETS)
    transport = a.get(REST, 0.0) - b.get(REST, 0.0)
    return {"gap_ms": gap, "fill_ms": fill, "context_attention_ms": kernel,
            "transport_ms": transport, "other_ms": gap - fill - kernel - transport}


def markdown(report: dict[str, Any]) -> str:
    """``breakdown.md``: the point table and, per size, minipic vs the bound's denominator."""
    lines = ["# TTFT against its bound: where a cached final's time goes", "",
             f"Run: {report['meta']['date']}, {report['meta']['machine']}, "
             f"{report['meta']['model']}; tree: {report['meta'].get('tree', '?')}.", "",
             "Step profile on (`engine_ext/profiling/step_profile.py`): its timers add a few ms to "
             "every "
             "request of both engines; `--no-profile` gives untimed TTFTs (ratios agree within "
             "noise). Regenerate: `flock /tmp/minipic-cpu.lock .venv/bin/python "
             "benchmarks/ttft_bound.py`.", "",
             "| prompt tokens | uncached | stock full | minipic cached | stock uncached only "
             "| speedup | bound | speedup / bound | stock, prefix cached (ideal) | minipic, "
             "same order (pool warm) |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in report["points"]:
        lines.append(
            f"| {p['prompt_tokens']:.0f} | {p['uncached_tokens']:.0f} "
            f"| {p['stock_full_s_p50'] * 1e3:.0f} ms | {p['minipic_s_p50'] * 1e3:.0f} ms "
            f"| {p['stock_uncached_s_p50'] * 1e3:.0f} ms | {p['speedup']:.1f}x "
            f"| {p['bound']:.1f}x | **{p['speedup_over_bound']:.2f}** "
            f"| {p['stock_ideal_s_p50'] * 1e3:.0f} ms ({p['ideal_over_bound']:.2f} of bound) "
            f"| {p['repeat_s_p50'] * 1e3:.0f} ms ({p['repeat_over_bound']:.2f} of bound) |")
    cases = ("minipic", "repeat", "stock_ideal", "stock_uncached")
    by_point = {str(p["size"]): p for p in report["points"]}
    for size, per_case in report.get("breakdown", {}).items():
        present = [c for c in cases if per_case.get(c)]
        if not present:
            continue
        lines += ["", f"## ~{size}-token prompts: median ms per bucket", ""]
        if per_case.get("minipic") and per_case.get("stock_uncached"):
            gap = gap_analysis(per_case["minipic"], per_case["stock_uncached"])
            point = by_point.get(size)
            ceiling = (f" Stock vLLM with the same prefix cached reaches "
                       f"{point['ideal_over_bound']:.2f} of the bound: attending the cached "
                       f"context is part of any cached final's cost." if point else "")
            lines += [f"Gap to the bound (minipic's cached final minus stock on the uncached "
                      f"tokens alone): **{gap['gap_ms']:.0f} ms** = off-home fill "
                      f"{gap['fill_ms']:.0f} ms + attention over the cached context "
                      f"{gap['context_attention_ms']:.0f} ms + transport/front-end "
                      f"{gap['transport_ms']:.0f} ms + the rest {gap['other_ms']:.0f} ms."
                      + ceiling, ""]
        lines += ["| bucket | " + " | ".join(present) + " |",
                  "|---|" + "---:|" * len(present)]
        names = list(per_case[present[0]]["buckets_ms"])
        for name in ["TTFT", "engine steps", *names]:
            cells = []
            for c in present:
                b = per_case[c]
                value = (b["ttft_ms"] if name == "TTFT" else b["engine_steps"]
                         if name == "engine steps" else b["buckets_ms"][name])
                cells.append(f"{value:.0f}" if name == "engine steps" else f"{value:.1f}")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)


# coarse groups of the buckets for the stacked plot
PLOT_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("model compute (as for the holes alone)", ("model compute outside attention",
                                                "worker execute_model, other", "sampling",
                                                "prepare inputs")),
    ("attention kernel over the context", ("off-home attention kernel",
                                           "home attention kernel")),
    ("off-home fill (key shadow)", FILL_BUCKETS),
    ("planning, scheduling, lookup", ("step planning (plan_step)",
                                      "span view (step_span_view)",
                                      "attention metadata, other",
                                      "scheduling: lookup (incl. past misses)",
                                      "scheduling: attach cached runs", "scheduling: other",
                                      "core: add request", "core: update from output")),
)


def plot(report: dict[str, Any], path: Path, by_size: dict[str, Any] | None = None) -> None:
    """TTFT of each measurement vs prompt length, speed-up vs bound per size and, with a
    profile, where minipic's cached TTFT goes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = report["points"]
    xs = [p["prompt_tokens"] for p in points]
    panels = 3 if by_size else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.2))
    ax, ax2 = axes[0], axes[1]
    for key, label, style in (("stock_full_s_p50", "stock vLLM, full prompt", "o-"),
                              ("minipic_s_p50", "minipic, cached final (new order)", "o-"),
                              ("repeat_s_p50", "minipic, same order again (pool warm)", "s--"),
                              ("stock_ideal_s_p50", "stock, same prefix cached", "^--"),
                              ("stock_uncached_s_p50", "stock, uncached tokens only", "v:")):
        ax.plot(xs, [p[key] * 1e3 for p in points], style, label=label)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.set_title("TTFT by prompt length")
    width = 0.27
    idx = list(range(len(points)))
    ax2.bar([i - width for i in idx], [p["bound"] for p in points], width,
            label="bound: stock full / stock uncached-only", color="#bbb")
    ax2.bar(idx, [p["ideal_speedup"] for p in points], width,
            label="stock full / stock with the prefix cached", color="#d98")
    ax2.bar([i + width for i in idx], [p["speedup"] for p in points], width,
            label="minipic speed-up", color="#1f5fa8")
    for i, p in zip(idx, points, strict=True):
        ax2.annotate(f"{p['speedup_over_bound']:.2f}", (i + width, p["speedup"]),
                     ha="center", va="bottom", fontsize=8)
    ax2.axhline(SPEEDUP_GOAL, color="#c33", lw=0.8, ls="--", label=f"{SPEEDUP_GOAL:.0f}x goal")
    ax2.set_xticks(idx, [f"{p['prompt_tokens']:.0f}" for p in points])
    ax2.set_xlabel("prompt tokens (label: speed-up / bound)")
    ax2.set_ylabel("x stock TTFT")
    ax2.set_yscale("log")
    ax2.legend(fontsize=7)
    ax2.set_title("speed-up vs its bound")
    if by_size:
        ax3 = axes[2]
        sizes = [str(p["size"]) for p in points if by_size.get(str(p["size"]), {}).get("minipic")]
        bottom = [0.0] * len(sizes)
        for group, names in PLOT_GROUPS:
            vals = [sum(by_size[s]["minipic"]["buckets_ms"].get(n, 0.0) for n in names)
                    for s in sizes]
            ax3.bar(sizes, vals, bottom=bottom, label=group)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        rest = [by_size[s]["minipic"]["ttft_ms"] - b for s, b in zip(sizes, bottom, strict=True)]
        ax3.bar(sizes, rest, bottom=bottom, label="transport, front-end, waiting", color="#ccc")
        uncached = [by_size[s]["stock_uncached"]["ttft_ms"] for s in sizes
                    if by_size[s].get("stock_uncached")]
        if len(uncached) == len(sizes):
            ax3.plot(sizes, uncached, "kv:", label="stock, uncached tokens only")
        ax3.set_xlabel("prompt size")
        ax3.set_ylabel("ms (medians per bucket)")
        ax3.legend(fontsize=7)
        ax3.set_title("minipic cached TTFT, profiled")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
