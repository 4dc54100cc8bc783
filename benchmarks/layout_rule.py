"""What rule 1 (docs/design.md §2: markers and pads invisible, positions counting real tokens)
costs in the CPU engine, measured side by side with the code before it in one run.

    python benchmarks/layout_rule.py --base-commit e0b828f --out results/layout_rule

Rule 1 sends every request that holds layout tokens through the masked torch path (vLLM's C++
kernel has no key mask); plain requests keep the C++ kernel. So the figures that can move are
the span requests' warm TTFT and decode speed; the plain requests' are the control (PIC off:
expected 1.00). "Before" is ``--base-commit`` checked out in a temporary worktree and imported
instead of this checkout (``PYTHONPATH``; the engine's plugin entry point resolves
``minipic`` through it), "after" is this checkout. Each (side, round) runs in its own process
and engine, sides alternating (A B, B A, ...), SmolLM2-135M fp32 eager.

Per side, median over ``--reps`` fresh items (random-word documents, fresh question each):

* ``block_ttft_s``: a warm ``block_attention`` final (span prefills first), ``max_tokens=1``;
* ``selective_ttft_s``: the same for ``selective@0.25`` (its heads computed in context);
* ``block_decode_tok_s``: output tokens/s of that final generating ``--decode-tokens``;
* ``plain_ttft_s`` / ``plain_decode_tok_s``: a fresh plain prompt of the final's length,
  not opted in;
* ``block_decode_over_plain``: the two decode speeds' ratio in one process. This box's speed
  varies between processes by up to ±10% (a side whose plain decode reads 0.9 of the other's
  ran slow, not differently), so the decode target is read on this ratio too.

KV bytes per token do not change (keys are still stored rotated at their home slot; the mask
and the logical positions are applied when attention reads them). Writes ``layout_rule.json``
and ``layout_rule.png`` (after / before per figure) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORDS = ("amber basalt cedar delta ember fjord granite harbor iris juniper kelp lumen moss "
         "nickel onyx pine quartz reed slate thistle umber vale willow").split()
FIGURES = ("block_ttft_s", "selective_ttft_s", "block_decode_tok_s", "plain_ttft_s",
           "plain_decode_tok_s", "block_decode_over_plain")


def measure(args: argparse.Namespace) -> dict:
    """One side, one round, in this process (``--worker``)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    import minipic
    from minipic.prompt_builder import PromptBuilder
    from minipic.span_contract.engine_config import EngineSettings, build_llm, close_llm
    from minipic.span_contract.span_config import SPANS_OPT_IN_KEY

    rng = random.Random(args.seed)
    llm = build_llm(EngineSettings(max_model_len=args.max_model_len))
    builder = PromptBuilder.from_pretrained(llm.minipic_settings.model, block_size=32)
    if args.no_sink:
        builder = builder.without_sink()
    vocab = llm.get_tokenizer().vocab_size
    opted = {SPANS_OPT_IN_KEY: True}

    def params(n: int, opt_in: bool) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                              extra_args=opted if opt_in else None)

    def run(ids: list[int], n: int, opt_in: bool) -> float:
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=list(ids))], params(n, opt_in),
                     use_tqdm=False)
        return time.perf_counter() - t0

    def item(mode: str) -> tuple[list[int], list[list[int]]]:
        docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(120, 200)))
                for _ in range(args.docs)]
        built = builder.build(system="Answer from the documents.", spans=docs,
                              question=f"Which word comes first, {rng.choice(WORDS)}?",
                              mode=mode)
        return list(built.prompt_token_ids), [list(p) for p in built.span_prefills]

    out: dict[str, list[float]] = {f: [] for f in FIGURES[:-1]}
    run(item("block_attention")[0], 1, True)  # warm-up
    for _ in range(args.reps):
        for mode, key in (("block_attention", "block_ttft_s"),
                          ("selective@0.25", "selective_ttft_s")):
            final, prefills = item(mode)
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in prefills], params(1, True),
                         use_tqdm=False)
            out[key].append(run(final, 1, True))
            if mode == "block_attention":
                total = run(final, args.decode_tokens + 1, True)
                out["block_decode_tok_s"].append(args.decode_tokens / (total - out[key][-1]))
                plain = [rng.randrange(100, vocab) for _ in range(len(final))]
                out["plain_ttft_s"].append(run(plain, 1, False))
                again = [rng.randrange(100, vocab) for _ in range(len(final))]
                total = run(again, args.decode_tokens + 1, False)
                out["plain_decode_tok_s"].append(args.decode_tokens
                                                 / (total - out["plain_ttft_s"][-1]))
    close_llm(llm)
    med = {k: statistics.median(v) for k, v in out.items()}
    # the same process decoding a plain prompt of the same length: what this side's engine
    # and this box's speed in that process give without spans (cancels a slow process)
    med["block_decode_over_plain"] = med["block_decode_tok_s"] / med["plain_decode_tok_s"]
    return {"minipic": str(Path(minipic.__file__).parent), "prompt_tokens": len(final), **med}


def side_run(root: Path, args: argparse.Namespace, seed: int, no_sink: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "side.json"
        env = {**os.environ, "PYTHONPATH": str(root)}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--json", str(path),
               "--seed", str(seed), "--reps", str(args.reps), "--docs", str(args.docs),
               "--decode-tokens", str(args.decode_tokens),
               "--max-model-len", str(args.max_model_len)] + (["--no-sink"] if no_sink else [])
        subprocess.run(cmd, env=env, cwd=root, check=True)
        result = json.loads(path.read_text())
    expected = str(root / "minipic")
    if Path(result["minipic"]).resolve() != Path(expected).resolve():
        raise RuntimeError(f"the side imported {result['minipic']}, not {expected}")
    return result


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    sides = [s for s in summary["median"] if s != "before"]
    height = 0.8 / len(sides)
    for k, side in enumerate(sides):
        ratios = summary["over_before"][side]
        names = list(ratios)
        ys = [i + k * height for i in range(len(names))]
        ax.barh(ys, [ratios[n] for n in names], height=height, label=side)
        for y, n in zip(ys, names, strict=True):
            ax.text(ratios[n], y, f" {ratios[n]:.2f}", va="center", fontsize=7)
    ax.set_yticks([i + height * (len(sides) - 1) / 2 for i in range(len(FIGURES))], FIGURES)
    ax.axvline(1.0, color="black", lw=0.8)
    ax.legend(fontsize=7)
    ax.set_xlabel("this checkout / the base commit (median over rounds)")
    ax.set_title("Rule 1 in the CPU engine, SmolLM2-135M fp32")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-commit", default="e0b828f",
                    help="the code before rule 1 (default: the commit this work started from)")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "layout_rule")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per side")
    ap.add_argument("--reps", type=int, default=5, help="items per round (median)")
    ap.add_argument("--docs", type=int, default=4, help="documents per prompt")
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--no-sink-side", action="store_true",
                    help="also run this checkout with spans laid out without their sink")
    ap.add_argument("--no-sink", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.json.write_text(json.dumps(measure(args)))
        return
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base), args.base_commit],
                       cwd=REPO, check=True)
        try:
            sides = {"before": (base, False), "after": (REPO, False)}
            if args.no_sink_side:
                sides["after_no_sink"] = (REPO, True)
            runs: dict[str, list[dict]] = {side: [] for side in sides}
            for r in range(args.rounds):
                order = list(sides) if r % 2 == 0 else list(sides)[::-1]
                for side in order:
                    root, no_sink = sides[side]
                    runs[side].append(side_run(root, args, seed + r, no_sink))
                    print(side, r, {k: round(v, 4) for k, v in runs[side][-1].items()
                                    if k in FIGURES}, flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=REPO,
                           check=False)
    med = {side: {f: statistics.median(r[f] for r in runs[side]) for f in FIGURES}
           for side in runs}
    summary = {
        "machine": {"cpu": platform.processor() or platform.machine(),
                    "cores": os.cpu_count()},
        "base_commit": args.base_commit, "seed": seed, "rounds": args.rounds,
        "reps": args.reps, "docs": args.docs, "decode_tokens": args.decode_tokens,
        "prompt_tokens": {side: runs[side][0]["prompt_tokens"] for side in runs},
        "median": med,
        "after_over_before": {f: med["after"][f] / med["before"][f] for f in FIGURES},
        "over_before": {side: {f: med[side][f] / med["before"][f] for f in FIGURES}
                        for side in runs if side != "before"},
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "layout_rule.json").write_text(json.dumps(summary, indent=2))
    plot(summary, args.out / "layout_rule.png")
    print(json.dumps(summary["over_before"], indent=2))


if __name__ == "__main__":
    main()
