"""One ``minipic eval`` report from several runs of the same engine over parts of one item set.

    python benchmarks/eval_merge.py results/fidelity/heads/eval.json /tmp/b/eval.json \\
        /tmp/c/eval.json --out results/fidelity/heads300

Why: a long evaluation is cut by time (a session, a shared box) and finished later, on the
remaining items or with a mode the first run lacked. Per item, the modes of every run are put
together; the summary, CIs and mode-vs-mode comparisons are computed again over the merged
items (``minipic.eval.runner.summarize``), so they pair per item as in one run.

Refused, with the reason: runs of another model, reference or span configuration, another
answer length or top-k, an item whose full-attention answer differs between runs (the reference
every mode is scored against must be one), or a mode two runs scored differently on one item
(runs of different code under one mode name; batching's float noise, a KL within 1e-3 + 1%,
is let through). A mode an item lacks in every run drops that item from the report.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from minipic.eval.report import write
from minipic.eval.runner import finite, summarize, verdict

_SAME = ("max_tokens", "top_k")


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """One mode's scores of one item in two runs agree up to batching's float noise (the same
    code batches items differently at another concurrency)."""
    return abs(a["kl_mean"] - b["kl_mean"]) <= 1e-3 + 0.01 * abs(a["kl_mean"])


def merge(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The merged report (raises ``ValueError`` naming what differs)."""
    first = reports[0]
    for r in reports[1:]:
        for key in ("model", "reference_model", "span_config"):
            a, b = first["engine"].get(key), r["engine"].get(key)
            known = key != "span_config" or None not in (a, b)  # older reports lack it
            if known and a != b:
                raise ValueError(f"engine {key} differs: {a!r} vs {b!r}")
        for key in _SAME:
            if r["settings"][key] != first["settings"][key]:
                raise ValueError(f"setting {key} differs: {first['settings'][key]} vs "
                                 f"{r['settings'][key]}")
    modes = list(dict.fromkeys(m for r in reports for m in r["settings"]["modes"]))
    items: dict[str, dict[str, Any]] = {}
    for r in reports:
        for it in r["items"]:
            have = items.get(it["id"])
            if have is None:
                items[it["id"]] = {**it, "modes": dict(it["modes"])}
                continue
            if have["full"]["text"] != it["full"]["text"]:
                raise ValueError(f"item {it['id']}: full attention answered "
                                 f"{have['full']['text']!r} in one run, {it['full']['text']!r} "
                                 f"in another")
            for mode, row in it["modes"].items():
                old = have["modes"].get(mode)
                if old is not None and not _same(old, row):
                    raise ValueError(f"item {it['id']}: mode {mode} scored KL {old['kl_mean']} in "
                                     f"one run and {row['kl_mean']} in another (another code?)")
                have["modes"][mode] = row
    merged = [it for it in items.values() if all(m in it["modes"] for m in modes)]
    summary = summarize(merged, modes)
    return finite({
        "engine": first["engine"], "machine": first["machine"],
        "settings": {**first["settings"], "modes": modes, "items": len(merged),
                     "concurrency": sorted({r["settings"]["concurrency"] for r in reports})},
        "wall_s": sum(r["wall_s"] for r in reports),
        "merged_from": [{"items": r["settings"]["items"], "modes": r["settings"]["modes"],
                         "wall_s": r["wall_s"]} for r in reports],
        "summary": summary, "verdict": verdict(summary),
        "errors": [e for r in reports for e in r["errors"]], "items": merged,
    })


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", type=Path, help="eval.json files")
    parser.add_argument("--out", type=Path, required=True, help="folder for the merged report")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.reports if not p.is_file()]
    if missing:
        parser.error(f"no such file: {', '.join(missing)}")
    try:
        report = merge([json.loads(p.read_text()) for p in args.reports])
    except ValueError as exc:
        print(f"eval_merge: {exc}")
        return 2
    write(report, args.out)
    print(f"eval_merge: {report['summary']['n']} items, modes {report['settings']['modes']} "
          f"-> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
