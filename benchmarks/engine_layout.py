"""Where vLLM's CPU worker runs: in a process of its own (vLLM's choice on CPU) or inside the
EngineCore (minipic's, ``EngineSettings.executor_args``), measured side by side in one run.

    python benchmarks/engine_layout.py --out results/engine_layout

Per layout, in alternating order over ``--rounds`` rounds (A B, B A, ...), with the default model
(SmolLM2-135M, fp32, eager, plugin on):

* **start**: seconds from ``build_llm`` to a ready engine, and **close** (``close_llm``);
* **TTFT**: wall time of a ``max_tokens=1`` generate of a fresh random prompt, at each
  ``--sizes`` length, prefix caching defeated by fresh token ids; median over ``--reps``;
* **decode**: output tokens/s of a ``--decode-tokens`` generation (ignore_eos) at batch 1 and
  batch ``--batch``.

Ratios are the in-EngineCore layout over vLLM's (below 1: faster). Writes ``engine_layout.json``
and ``engine_layout.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

LAYOUTS = {"worker_process": "mp", "worker_in_engine_core": None}  # None: minipic's default


def measure(layout: str, args: argparse.Namespace, rng: random.Random) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from minipic.span_contract.engine_config import EngineSettings, build_llm, close_llm

    backend = LAYOUTS[layout]
    extra = {"distributed_executor_backend": backend} if backend else {}
    started = time.perf_counter()
    llm = build_llm(EngineSettings(max_model_len=args.max_model_len, extra=extra))
    start_s = time.perf_counter() - started
    vocab = llm.get_tokenizer().vocab_size

    def prompt(n: int) -> TokensPrompt:
        return TokensPrompt(prompt_token_ids=[rng.randrange(100, vocab) for _ in range(n)])

    one = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([prompt(64)], one, use_tqdm=False)  # warm-up
    ttft = {}
    for size in args.sizes:
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            llm.generate([prompt(size)], one, use_tqdm=False)
            times.append(time.perf_counter() - t0)
        ttft[str(size)] = statistics.median(times)
    decode = {}
    long = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True)
    for batch in (1, args.batch):
        t0 = time.perf_counter()
        outs = llm.generate([prompt(64) for _ in range(batch)], long, use_tqdm=False)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        decode[str(batch)] = tokens / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    close_llm(llm)
    return {"start_s": start_s, "close_s": time.perf_counter() - t0, "ttft_s": ttft,
            "decode_tok_s": decode}


def summarize(runs: dict[str, list[dict]]) -> dict:
    def med(layout: str, *path: str) -> float:
        values = []
        for run in runs[layout]:
            value = run
            for key in path:
                value = value[key]
            values.append(value)
        return statistics.median(values)

    first = runs["worker_in_engine_core"][0]
    paths = [("start_s",), ("close_s",)]
    paths += [("ttft_s", size) for size in first["ttft_s"]]
    paths += [("decode_tok_s", batch) for batch in first["decode_tok_s"]]
    out = {}
    for path in paths:
        base, new = med("worker_process", *path), med("worker_in_engine_core", *path)
        out["/".join(path)] = {"worker_process": base, "worker_in_engine_core": new,
                               "ratio": new / base}
    return out


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    ratios = [summary[n]["ratio"] for n in names]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.barh(names, ratios, color=["tab:green" if r <= 1 else "tab:red" for r in ratios])
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("worker inside the EngineCore / worker process of its own")
    ax.set_title("vLLM CPU engine: where the worker runs (median over rounds)")
    for y, r in enumerate(ratios):
        ax.text(r, y, f" {r:.2f}", va="center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("results/engine_layout"))
    ap.add_argument("--rounds", type=int, default=2, help="A/B rounds, order alternating")
    ap.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2000])
    ap.add_argument("--reps", type=int, default=5, help="TTFT repetitions per size")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=None, help="default: a fresh one")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    runs: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    order = list(LAYOUTS)
    for round_no in range(args.rounds):
        for layout in order if round_no % 2 == 0 else order[::-1]:
            print(f"round {round_no + 1}/{args.rounds}: {layout}", flush=True)
            runs[layout].append(measure(layout, args, rng))
    summary = summarize(runs)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seed": seed,
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "args": {k: str(v) for k, v in vars(args).items()}}
    try:
        from _provenance import git_state

        meta["git"] = git_state("minipic", "engine_ext", "span_contract")
    except ImportError:
        pass
    (args.out / "engine_layout.json").write_text(
        json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=1) + "\n")
    plot(summary, args.out / "engine_layout.png")
    for name, row in summary.items():
        print(f"{name:24s} process {row['worker_process']:9.3f}  in core "
              f"{row['worker_in_engine_core']:9.3f}  ratio {row['ratio']:.2f}")


if __name__ == "__main__":
    main()
