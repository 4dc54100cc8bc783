"""LoRA against full fine-tuning (and the plain-prompt term) for ``minipic tune``, side by side.

    # here: write the built-in split the runs share (tuning items, then held-out items that
    # minipic eval scores by default and tuning never sees)
    python benchmarks/tune_methods.py export --out /tmp/tune-data --n 600 --report-n 100
    # anywhere with the model: every configuration on the same items, same steps, same seed
    python benchmarks/tune_methods.py run --data /tmp/tune-data --model DIR --out OUT \\
        --steps 150 --parallel 7
    # the comparison, from the per-configuration reports
    python benchmarks/tune_methods.py compare OUT --out results/tune/methods

Why a script of its own and not ``minipic tune`` in a loop: the comparison is paired. Every
configuration tunes on the same items in the same order and is scored on the same held-out items
against the same base model (``minipic/tune/report.py``), so the per-item differences carry the
CI, not two independent means. On a GPU the configurations run as parallel processes (a
135M-parameter model leaves the card mostly idle); on a CPU, one at a time.

``compare`` writes ``methods.json``, ``methods.md`` and ``methods.png``:

* **training loss at equal steps**, from every configuration's ``NAME.losses.json`` (written
  after each step, so a run cut short by a time limit still counts): the same items reach every
  configuration at the same step, so the per-step differences to the first configuration are
  paired. The plain-prompt term (``keep_full``) adds to the logged loss: those rows are shown,
  not compared;
* **held-out scores** of the configurations that finished: KL(base full ‖ tuned
  block_attention) and top-1 agreement, what tuning cost the plain prompt (KL(base full ‖ tuned
  full)), wall time, and the paired difference to the first finished configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# name: (method, lr, keep_full, dtype, gradient checkpointing)
CONFIGS: dict[str, dict[str, Any]] = {
    "lora": {"method": "lora", "lr": 2e-4},
    "lora-lr5e-4": {"method": "lora", "lr": 5e-4},
    "lora-keep1": {"method": "lora", "lr": 2e-4, "keep_full": 1.0},
    "full-lr1e-5": {"method": "full", "lr": 1e-5},
    "full-lr2e-5": {"method": "full", "lr": 2e-5},
    "full-lr5e-5": {"method": "full", "lr": 5e-5},
    # the recipe a GPU user runs on an 8B model: bf16 base, activations recomputed
    "lora-bf16-ckpt": {"method": "lora", "lr": 2e-4, "dtype": "bfloat16", "checkpointing": True},
}
METRICS = ("base_block", "tuned_block", "tuned_full")


def export(args: argparse.Namespace) -> int:
    from minipic.tune import data as tune_data

    loaded = tune_data.load("builtin", args.n, args.seed, (3, 10), 80, args.report_n)
    args.out.mkdir(parents=True, exist_ok=True)
    tune_data.write_heldout(loaded.train, args.out / "train.jsonl")
    tune_data.write_heldout(loaded.heldout, args.out / "heldout.jsonl")
    (args.out / "split.json").write_text(json.dumps(
        {k: v for k, v in loaded.manifest().items() if k != "train_question_digests"}, indent=1))
    print(f"{len(loaded.train)} tuning items, {len(loaded.heldout)} held out → {args.out}")
    return 0


def _items(path: Path) -> list[Any]:
    from minipic.eval.datasets import load_jsonl

    loaded = load_jsonl(path)
    if loaded.errors:
        raise SystemExit(f"{path}: {len(loaded.errors)} bad lines")
    return loaded.items


def one(args: argparse.Namespace) -> int:
    """One configuration in this process: tune, score the held-out items, write NAME.json."""
    import torch
    from tqdm import tqdm

    from minipic.tune import report, trainer
    from minipic.tune.cli import _builder

    config = CONFIGS[args.config]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    train, heldout = _items(args.data / "train.jsonl"), _items(args.data / "heldout.jsonl")
    settings = trainer.TuneSettings(
        model=args.model, steps=args.steps, batch=args.batch, lr=config["lr"],
        max_tokens=args.max_tokens, seed=args.seed, dtype=config.get("dtype", "float32"),
        method=config["method"], keep_full=config.get("keep_full", 0.0))
    builder = _builder(args.model, settings)
    student = trainer.load_student(args.model, settings, device,
                                   config.get("checkpointing", False))
    run_dir = args.out / args.config
    curve = args.out / f"{args.config}.losses.json"

    def on_step(state: dict[str, Any]) -> None:
        curve.write_text(json.dumps({"config": args.config, **config,
                                     "losses": state["losses"], "seconds": state["seconds"]}))

    state = trainer.train(student, builder, train, settings, run_dir, resume=False,
                          save_every=args.steps, progress=tqdm, on_step=on_step)
    records = [report.score_item(student, builder, item, args.max_tokens)
               for item in tqdm(heldout, desc="held-out", unit="item")]
    summary = report.summarize(records, args.seed)
    out = {"config": args.config, **config, "settings": settings.__dict__,
           "describe": settings.describe(), "device": device,
           "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
           "train_s": state["seconds"], "wall_s": time.perf_counter() - started,
           "peak_gpu_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
           "trainable_params": sum(p.numel() for p in student.trainable()),
           "losses": state["losses"], "summary": summary, "items": records}
    (args.out / f"{args.config}.json").write_text(json.dumps(out, indent=1))
    (run_dir / "checkpoints" / "last.pt").unlink(missing_ok=True)  # weights are not kept
    print(f"{args.config}: tuned block KL {summary['tuned_block']['kl']['mean']:.3f}, "
          f"{out['wall_s']:.0f} s")
    return 0


def run(args: argparse.Namespace) -> int:
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}: {', '.join(CONFIGS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    common = ["--data", str(args.data), "--model", args.model, "--out", str(args.out),
              "--steps", str(args.steps), "--batch", str(args.batch), "--seed", str(args.seed),
              "--max-tokens", str(args.max_tokens), "--threads", str(args.threads)]
    pending, running, failed = list(names), [], []
    while pending or running:
        while pending and len(running) < args.parallel:
            name = pending.pop(0)
            log = (args.out / f"{name}.log").open("w")
            proc = subprocess.Popen([sys.executable, __file__, "one", "--config", name, *common],
                                    stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
            running.append((name, proc))
        time.sleep(2)
        for name, proc in list(running):
            if proc.poll() is not None:
                running.remove((name, proc))
                print(f"{name}: exit {proc.returncode}", flush=True)
                if proc.returncode:
                    failed.append(name)
    return 1 if failed else 0


def _paired(a: list[float], b: list[float], seed: int) -> dict[str, float]:
    from minipic.eval import metrics

    diffs = [x - y for x, y in zip(a, b, strict=True)]
    mean, low, high = metrics.bootstrap_ci(diffs, indices=metrics.bootstrap_indices(
        len(diffs), seed=seed))
    return {"mean": mean, "low": low, "high": high}


def _by_config(items: list[dict[str, Any]], first: str | None = None) -> list[dict[str, Any]]:
    """Sorted as CONFIGS lists them, ``first`` (the baseline of the paired differences) first."""
    order = {name: i for i, name in enumerate(CONFIGS)}
    return sorted(items, key=lambda r: (r["config"] != first,
                                        order.get(r["config"], len(order))))


def loss_rows(curves: list[dict[str, Any]], seed: int,
              steps: int | None = None) -> dict[str, Any]:
    """Mean training loss per configuration over the second half of the first ``steps`` steps
    (default: as many as every configuration reached; shorter curves are left out), and the
    paired (by step) difference to the first configuration."""
    reached = steps or min(len(c["losses"]) for c in curves)
    short = [c["config"] for c in curves if len(c["losses"]) < reached]
    curves = [c for c in curves if len(c["losses"]) >= reached]
    start = reached // 2
    base = curves[0]
    rows = []
    for c in curves:
        window = c["losses"][start:reached]
        row = {"config": c["config"], "lr": c["lr"], "keep_full": c.get("keep_full", 0.0),
               "steps_done": len(c["losses"]), "mean_loss": sum(window) / len(window)}
        if not c.get("keep_full") and not base.get("keep_full"):
            row["minus_" + base["config"]] = _paired(window, base["losses"][start:reached], seed)
        rows.append(row)
    return {"window": [start + 1, reached], "baseline": base["config"], "rows": rows,
            "left_out": short}


def compare(args: argparse.Namespace) -> int:
    curves = _by_config([json.loads(p.read_text())
                         for p in sorted(args.runs.glob("*.losses.json"))], args.baseline)
    reports = _by_config([json.loads(p.read_text()) for p in sorted(args.runs.glob("*.json"))
                          if not p.name.endswith(".losses.json")], args.baseline)
    if not reports and not curves:
        raise SystemExit(f"{args.runs}: no configuration reports or loss curves")
    training = loss_rows(curves, args.seed, args.loss_steps) if curves else None
    if not reports:
        return _write(args, training, [], None, curves, reports)
    first = reports[0]
    ids = [r["id"] for r in first["items"]]
    rows = []
    for rep in reports:
        if [r["id"] for r in rep["items"]] != ids:
            raise SystemExit(f"{rep['config']}: scored other held-out items than {first['config']}")
        s = rep["summary"]
        row = {"config": rep["config"], "describe": rep["describe"], "lr": rep["lr"],
               "n": s["n"], "device": rep["device"], "gpu": rep.get("gpu"),
               "steps": rep["settings"]["steps"], "batch": rep["settings"]["batch"],
               "trainable_params": rep["trainable_params"], "train_s": rep["train_s"],
               "peak_gpu_bytes": rep.get("peak_gpu_bytes"),
               "final_loss_10": sum(rep["losses"][-10:]) / len(rep["losses"][-10:]),
               **{m: s[m] for m in METRICS}}
        for metric in ("kl", "top1"):
            row[f"block_{metric}_minus_{first['config']}"] = _paired(
                [r["tuned_block"][metric] for r in rep["items"]],
                [r["tuned_block"][metric] for r in first["items"]], args.seed)
        row["full_kl_minus_" + first["config"]] = _paired(
            [r["tuned_full"]["kl"] for r in rep["items"]],
            [r["tuned_full"]["kl"] for r in first["items"]], args.seed)
        rows.append(row)
    return _write(args, training, rows, first["config"], curves, reports)


def _write(args: argparse.Namespace, training: dict[str, Any] | None, rows: list[dict[str, Any]],
           baseline: str | None, curves: list[dict[str, Any]],
           reports: list[dict[str, Any]]) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "methods.json").write_text(json.dumps(
        {"training_loss": training, "heldout": {"rows": rows, "baseline": baseline}}, indent=1))
    parts = []
    if training:
        parts.append(_loss_table(training))
    if rows:
        parts.append(_table(rows, baseline))
    text = "\n\n".join(parts)
    (args.out / "methods.md").write_text(text + "\n")
    _plot(rows, curves or reports, args.out / "methods.png")
    print(text)
    return 0


def _loss_table(training: dict[str, Any]) -> str:
    base = training["baseline"]
    lo, hi = training["window"]
    lines = [f"## Training loss at equal steps (steps {lo}–{hi}, the same items at the same step "
             f"in every configuration)", "",
             f"| config | lr | steps done | mean KL, steps {lo}–{hi} | paired Δ vs `{base}` "
             f"[95% CI over steps] |", "|---|---:|---:|---:|---|"]
    for r in training["rows"]:
        diff = r.get("minus_" + base)
        shown = _ci(diff) if diff else "not comparable (the loss holds the plain-prompt term)"
        lines.append(f"| `{r['config']}` | {r['lr']:g} | {r['steps_done']} | "
                     f"{r['mean_loss']:.3f} | {shown} |")
    if training["left_out"]:
        lines += ["", f"Left out (fewer than {hi} steps): "
                      + ", ".join(f"`{c}`" for c in training["left_out"])]
    return "\n".join(lines)


def _ci(e: dict[str, float], digits: int = 3, scale: float = 1.0) -> str:
    return (f"{e['mean'] * scale:.{digits}f} [{e['low'] * scale:.{digits}f}, "
            f"{e['high'] * scale:.{digits}f}]")


def _table(rows: list[dict[str, Any]], baseline: str) -> str:
    r0 = rows[0]
    lines = [f"## Held-out scores ({r0['device']}"
             f"{', ' + r0['gpu'] if r0.get('gpu') else ''})", "",
             f"Every row: {r0['steps']} steps × {r0['batch']} items, the same items in the same "
             f"order, seed and held-out set (n = {r0['n']}, scored against the base model's full "
             f"attention). Base model under block_attention: KL "
             f"{_ci(r0['base_block']['kl'])}, top-1 {_ci(r0['base_block']['top1'], 1, 100)}%. "
             f"Paired differences are against `{baseline}`; 95% bootstrap CIs.", "",
             "| config | trainable params | lr | tuned block KL | Δ KL vs " + baseline
             + " | tuned block top-1 % | plain-prompt KL (the cost) | Δ cost | train s |",
             "|---|---:|---:|---|---|---|---|---|---:|"]
    for r in rows:
        lines.append(
            f"| `{r['config']}` | {r['trainable_params'] / 1e6:.1f} M | {r['lr']:g} | "
            f"{_ci(r['tuned_block']['kl'])} | {_ci(r['block_kl_minus_' + baseline])} | "
            f"{_ci(r['tuned_block']['top1'], 1, 100)} | {_ci(r['tuned_full']['kl'])} | "
            f"{_ci(r['full_kl_minus_' + baseline])} | {r['train_s']:.0f} |")
    lines += ["", "Configurations: " + "; ".join(f"`{r['config']}`: {r['describe']}"
                                                for r in rows)]
    return "\n".join(lines)


def _plot(rows: list[dict[str, Any]], curves: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if rows:
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    else:
        fig, left = plt.subplots(figsize=(6.5, 4.2))
    w = 1
    for rep in curves:
        losses = rep["losses"]
        w = max(1, len(losses) // 15)
        smooth = [sum(losses[max(0, i - w + 1): i + 1]) / len(losses[max(0, i - w + 1): i + 1])
                  for i in range(len(losses))]
        left.plot(range(1, len(losses) + 1), smooth, label=rep["config"], lw=1.5)
    left.set(xlabel="optimizer step", ylabel=f"training KL (mean of {w})", title="loss")
    left.legend(fontsize=7)
    for r in rows:
        x, y = r["tuned_full"]["kl"]["mean"], r["tuned_block"]["kl"]["mean"]
        right.errorbar(x, y, yerr=[[y - r["tuned_block"]["kl"]["low"]],
                                   [r["tuned_block"]["kl"]["high"] - y]],
                       xerr=[[x - r["tuned_full"]["kl"]["low"]],
                             [r["tuned_full"]["kl"]["high"] - x]], fmt="o", capsize=3)
        right.annotate(r["config"], (x, y), fontsize=7, xytext=(4, 4),
                       textcoords="offset points")
    if rows:
        right.axhline(rows[0]["base_block"]["kl"]["mean"], color="#999", ls="--", lw=1,
                      label="base, block_attention")
        right.legend(fontsize=7)
        right.set(xlabel="KL(base full ‖ tuned full): what tuning cost plain prompts",
                  ylabel="KL(base full ‖ tuned block_attention)",
                  title=f"held out, n = {rows[0]['n']} (lower-left is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("export", help="write the built-in split (train.jsonl, heldout.jsonl)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--n", type=int, default=600, help="tuning items")
    p.add_argument("--report-n", type=int, default=100, help="held-out items")
    p.add_argument("--seed", type=int, default=1)
    p.set_defaults(func=export)
    for verb, func, helptext in (("run", run, "every configuration, in parallel processes"),
                                 ("one", one, "one configuration (what run starts)")):
        p = sub.add_parser(verb, help=helptext)
        p.add_argument("--data", type=Path, required=True, help="the folder export wrote")
        p.add_argument("--model", required=True, help="model folder")
        p.add_argument("--out", type=Path, required=True)
        p.add_argument("--steps", type=int, default=150)
        p.add_argument("--batch", type=int, default=4)
        p.add_argument("--max-tokens", type=int, default=16)
        p.add_argument("--seed", type=int, default=1)
        p.add_argument("--threads", type=int, default=2, help="torch threads per process")
        if verb == "run":
            p.add_argument("--configs", default=",".join(CONFIGS),
                           help=f"comma-separated, first is the baseline ({', '.join(CONFIGS)})")
            p.add_argument("--parallel", type=int, default=1, help="processes at once")
        else:
            p.add_argument("--config", required=True, choices=list(CONFIGS))
        p.set_defaults(func=func)
    p = sub.add_parser("compare", help="methods.{json,md,png} from a run's reports")
    p.add_argument("runs", type=Path, help="the run's --out")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--baseline", default=None,
                   help="the configuration paired differences are taken against (default: "
                        "the first of CONFIGS present)")
    p.add_argument("--loss-steps", type=int, default=None,
                   help="compare training loss over the second half of this many steps "
                        "(default: the fewest any configuration reached)")
    p.set_defaults(func=compare)
    args = parser.parse_args()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
