"""The table printed at the end of ``minipic bench`` (and into ``results/bench/README.md``)."""

from __future__ import annotations

from typing import Any


def summary_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    if "throughput" in report:
        t = report["throughput"]
        for name, s in t["systems"].items():
            rows.append((f"samples/s {name}", f"{s['samples_per_s']:.2f} "
                         f"(hit rate {s['hit_rate']:.0%}, TTFT p50 {s['ttft_p50_s']*1000:.0f} ms, "
                         f"KV peak {s['kv_peak_mib']:.0f} MiB)"))
        rows.append(("ISPS / vanilla", f"{t['isps_vs_vanilla']:.2f}x"))
        rows.append(("ISPS / barrier", f"{t['isps_vs_barrier']:.2f}x"))
        rows.append(("PIC-off overhead", f"{t['pic_off_overhead']:+.1%}"))
        if "steady_state" in t:
            w = t["steady_state"]
            rows.append(("warm corpus samples/s", f"vanilla {w['vanilla']['samples_per_s']:.2f}, "
                         f"ISPS {w['minipic_isps']['samples_per_s']:.2f} "
                         f"({w['isps_vs_vanilla']:.2f}x; hit rate "
                         f"{w['minipic_isps']['hit_rate']:.0%} vs {w['vanilla']['hit_rate']:.0%})"))
        kv = t["kv_cache"]
        rows.append(("KV bytes / token", f"stock {kv['stock']['bytes_per_token']}, minipic "
                     f"{kv['minipic']['bytes_per_token']} (position-free pages)"))
    if "ttft" in report:
        h = report["ttft"]["headline"]
        rows.append((f"TTFT p50 @ {h['prompt_tokens_mean']:.0f} tok",
                     f"vanilla {h['vanilla_p50_s']*1000:.0f} ms, minipic "
                     f"{h['minipic_p50_s']*1000:.0f} ms ({h['speedup_p50']:.1f}x)"))
        rows.append(("TTFT p95", f"vanilla {h['vanilla_p95_s']*1000:.0f} ms, minipic "
                     f"{h['minipic_p95_s']*1000:.0f} ms"))
    if "agent" in report:
        turns = report["agent"]["turns"]
        pic = sum(r["minipic_cached"] for r in turns) / max(1, sum(r["prompt_tokens"]
                                                                   for r in turns))
        van = sum(r["vanilla_cached"] for r in turns) / max(1, sum(r["prompt_tokens"]
                                                                   for r in turns))
        rows.append(("agent cached share", f"minipic {pic:.0%}, vanilla {van:.0%}"))
    if "accuracy" in report:
        for name, a in report["accuracy"].items():
            lo, hi = a["ci95"]
            rows.append((f"accuracy {name}", f"{a['accuracy']:.0%} ({a['correct']}/{a['n']}, "
                         f"95% CI {lo:.0%}-{hi:.0%}), TTFT p50 {a['ttft_p50_s']*1000:.0f} ms"))
    return rows


def summary_table(report: dict[str, Any]):
    from rich.table import Table

    table = Table(title="minipic bench")
    table.add_column("metric")
    table.add_column("value")
    for k, v in summary_rows(report):
        table.add_row(k, v)
    return table
