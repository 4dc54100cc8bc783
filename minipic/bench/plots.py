"""PNG figures for ``minipic bench`` (people would rather look than read)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_plots(report: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []

    def save(fig: Any, name: str) -> None:
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    if "throughput" in report:
        systems = report["throughput"]["systems"]
        fig, (ax, ax_kv) = plt.subplots(1, 2, figsize=(12, 4.2))
        names = list(systems)
        colors = ["#888", "#aaa", "#6a9fd8", "#1f5fa8"][: len(names)]
        ax.bar(names, [systems[n]["samples_per_s"] for n in names], color=colors,
               label="cold cache")
        warm = report["throughput"].get("steady_state")
        if warm:
            ax.bar(["vanilla (warm)", "minipic_isps (warm)"],
                   [warm["vanilla"]["samples_per_s"], warm["minipic_isps"]["samples_per_s"]],
                   color=["#888", "#1f5fa8"], hatch="//", label="warm corpus")
            ax.legend(fontsize=8)
        ax.set_ylabel("samples / s")
        ax.set_title("RAG throughput (2Wiki-shaped, same engine build)")
        ax.tick_params(axis="x", labelrotation=15)
        ax_kv.bar(names, [systems[n]["kv_peak_mib"] for n in names], color=colors)
        ax_kv.set_ylabel("MiB")
        ax_kv.set_title("KV cache in use, peak during the batch")
        ax_kv.tick_params(axis="x", labelrotation=15)
        save(fig, "throughput.png")

    if "ttft" in report:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        for ax, key, xkey, label in ((axes[0], "vs_spans", "spans", "number of spans"),
                                     (axes[1], "vs_span_len", "span_tokens", "tokens per span")):
            rows = report["ttft"][key]
            xs = [r[xkey] for r in rows]
            ax.plot(xs, [r["vanilla_p50_s"] * 1000 for r in rows], "o-", label="vanilla vLLM")
            ax.plot(xs, [r["minipic_p50_s"] * 1000 for r in rows], "o-", label="minipic (warm)")
            ax.set_xlabel(label)
            ax.set_ylabel("TTFT p50 (ms)")
            ax.set_yscale("log")
            ax.legend()
        fig.suptitle("Time to first token when the documents were seen before")
        save(fig, "ttft_sweeps.png")

    if "accuracy" in report:
        acc = report["accuracy"]
        fig, ax = plt.subplots(figsize=(5.5, 3.5))
        for name, row in acc.items():
            lo, hi = row["ci95"]
            ax.errorbar(row["ttft_p50_s"] * 1000, row["accuracy"], fmt="o", capsize=4,
                        yerr=[[row["accuracy"] - lo], [hi - row["accuracy"]]],
                        label=f"{name} ({row['correct']}/{row['n']})")
        ax.legend(fontsize=8)
        ax.set_xlabel("TTFT p50 (ms)")
        ax.set_ylabel("accuracy (gold substring, 95% CI)")
        ax.set_title("Answer quality vs latency per mode")
        save(fig, "accuracy_vs_ttft.png")
        steps = {name: row["prefill_steps"] for name, row in acc.items()
                 if row.get("prefill_steps")}
        if steps:
            fig, ax = plt.subplots(figsize=(5.5, 3.5))
            counts = sorted({int(k) for hist in steps.values() for k in hist})
            width = 0.8 / len(steps)
            for i, (name, hist) in enumerate(steps.items()):
                total = sum(hist.values())
                ax.bar([c + (i - (len(steps) - 1) / 2) * width for c in counts],
                       [hist.get(str(c), 0) / total for c in counts], width, label=name)
            ax.set_xticks(counts)
            ax.set_xlabel("engine steps to prefill one prompt (scheduler count)")
            ax.set_ylabel("share of prompts")
            ax.set_title("Prefill steps per prompt (finals and span prefills)")
            ax.legend(fontsize=8)
            save(fig, "prefill_steps.png")

    if "agent" in report:
        rows = report["agent"]["turns"]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        turns = [r["turn"] for r in rows]
        ax.plot(turns, [r["prompt_tokens"] for r in rows], "k--", label="prompt tokens")
        ax.plot(turns, [r["minipic_cached"] for r in rows], "o-", label="minipic cached")
        ax.plot(turns, [r["vanilla_cached"] for r in rows], "o-", label="vanilla cached")
        ax.set_xlabel("agent turn")
        ax.set_ylabel("tokens")
        ax.legend()
        ax.set_title("Agent tool memory: tools/memories reordered every turn")
        save(fig, "agent_memory.png")
    return written
