"""Two ``minipic tune`` runs compared on the held-out items both scored, paired per item.

    python benchmarks/tune_paired.py results/tune/sink/tune.json \\
        results/tune/g128_700/tune.json --out results/tune/g128_700/vs_sink_tune.json

Why: each run's ``tune.json`` scores its own held-out items (the base model under the run's
layout, the tuned model under it, the tuned model on the plain prompt), each against the base
model's full attention. Two runs' CIs side by side overlap where a paired difference does not:
the items are the same (built-in data: eval's own default set), so NEW − OLD per item, with a
bootstrap CI over items (``minipic.eval.metrics``), is what says whether a change of tune paid.

Refused, with the reason: runs with no held-out item in common, or whose items were answered at
another length.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from minipic.eval.metrics import bootstrap_ci, bootstrap_indices

ROWS = ("base_block", "tuned_block", "tuned_full")


def paired(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """Per row and metric: the mean of NEW − OLD over the common items, with its 95% CI."""
    by_id = {item["id"]: item for item in old["items"]}
    common = [(by_id[item["id"]], item) for item in new["items"] if item["id"] in by_id]
    if not common:
        raise ValueError("the two runs scored no held-out item in common")
    for a, b in common:
        if a.get("answer_tokens") != b.get("answer_tokens"):
            raise ValueError(f"item {a['id']}: answered at {a.get('answer_tokens')} tokens in "
                             f"one run and {b.get('answer_tokens')} in the other")
    indices = bootstrap_indices(len(common))
    out: dict[str, Any] = {"n": len(common), "new_minus_old": {}, "old": {}, "new": {}}
    for row in ROWS:
        for metric in ("kl", "top1"):
            old_v = np.array([a[row][metric] for a, _ in common])
            new_v = np.array([b[row][metric] for _, b in common])
            key = f"{row}_{metric}"
            for side, values in (("old", old_v), ("new", new_v), ("new_minus_old",
                                                                  new_v - old_v)):
                mean, low, high = bootstrap_ci(values, indices=indices)
                out[side][key] = {"mean": mean, "ci95": [low, high]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", type=Path, help="the earlier run's tune.json")
    ap.add_argument("new", type=Path, help="the later run's tune.json")
    ap.add_argument("--out", type=Path, required=True, help="where to write the JSON")
    args = ap.parse_args()
    try:
        result = paired(json.loads(args.old.read_text()), json.loads(args.new.read_text()))
    except ValueError as err:
        raise SystemExit(f"tune_paired: {err}") from None
    result["old_run"], result["new_run"] = str(args.old), str(args.new)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for key, v in result["new_minus_old"].items():
        old, new = result["old"][key]["mean"], result["new"][key]["mean"]
        print(f"{key:18s} old {old:.3f}  new {new:.3f}  new-old {v['mean']:+.3f} "
              f"[{v['ci95'][0]:+.3f}, {v['ci95'][1]:+.3f}]")


if __name__ == "__main__":
    main()
