"""PIC-off overhead of the position-free CPU backend vs stock vLLM CPU attention.

    python benchmarks/pic_overhead.py                      # auto path vs stock, SmolLM2
    python benchmarks/pic_overhead.py --paths scratch torch --reps 2 --rounds 1 \
        --out results/pic_overhead_alternatives.json    # the measured alternatives
    python benchmarks/pic_overhead.py --paths stock --out /tmp/aa.json  # A/A calibration

Same model (SmolLM2-135M, fp32, eager), same prompts, no special tokens (so minipic's hashing is
stock and every block is read at its home slot). Two workloads:

* ``prefill``: a batch of long prompts, one output token each (attention over fresh keys);
* ``decode``:  a batch of short prompts, many output tokens each (attention over cached keys
  every step: where rotating keys on every read would hurt most).

Each comparison runs in *rounds*: a round starts a stock engine and a minipic engine (the
``MINIPIC_CPU_ATTN`` path under test) one after the other, so at most two engines are alive, and
closes both at the end. Rounds alternate which engine starts first and the combined result is the
geometric mean over rounds: on the shared 2-core development machine an A/A run of two stock
engines (``--paths stock``) once showed the second-started engine ~13% faster in decode. Within a
round, after one untimed warm-up run per engine and workload, runs alternate stock / minipic
(which one goes first alternates too), each rep on fresh prompts (prefix cache reset before
every run); per round we keep the median of the per-rep paired ratios and the ratio of the
fastest runs, for wall time and for the CPU time of the engine's own processes (the latter turned
out noisier, as it includes EngineCore polling). Greedy tokens are compared between the two
engines on every rep. Output: ``results/pic_overhead.json``.

Noise: vLLM pins every CPU worker to core 0 by default, so all engines on a shared host compete
there. ``VLLM_CPU_OMP_THREADS_BIND=1 python benchmarks/pic_overhead.py`` pins both engines to the
other core; that is how the numbers in ``engine_ext/attention/cpu_backend.py`` were taken (A/A:
prefill 1.00, decode 1.01).
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
from typing import Any

from minipic.span_contract.env import CPU_ATTN_ENV

# Kept short (a few seconds per run) so that stock and minipic runs interleave tightly.
WORKLOADS: dict[str, dict[str, int]] = {
    "prefill": {"batch": 2, "prompt_len": 384, "max_tokens": 1},
    "decode": {"batch": 8, "prompt_len": 64, "max_tokens": 64},
}
# Idle vLLM workers spin on their shared-memory queue for ~1 s after their last step; wait this
# long after switching engines so the idle one does not steal a core from the timed one.
SETTLE_S = 1.5


def _prompts(rng: random.Random, batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(17, vocab) for _ in range(prompt_len)] for _ in range(batch)]


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of an engine's processes (EngineCore and worker).

    Less sensitive than wall time to other tenants of a shared machine, though OpenMP spin-waits
    still inflate it when a core is taken away.
    """
    import psutil

    total = 0.0
    for pid in pids:
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


def _run(engine: dict[str, Any], prompts: list[list[int]],
         max_tokens: int) -> tuple[float, float, list[list[int]]]:
    """Wall seconds, engine CPU seconds and greedy tokens of one ``generate`` call."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = engine["llm"]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.reset_prefix_cache()
    time.sleep(SETTLE_S)
    cpu0, start = _cpu_seconds(engine["pids"]), time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                        use_tqdm=False)
    elapsed, cpu = time.perf_counter() - start, _cpu_seconds(engine["pids"]) - cpu0
    return elapsed, cpu, [list(o.outputs[0].token_ids) for o in outs]


def _start(pic: bool, path: str | None, max_model_len: int) -> dict[str, Any]:
    """An engine and the pids of the processes it started (EngineCore, worker)."""
    import psutil

    from minipic.span_contract.engine_config import EngineSettings, build_llm

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    previous = os.environ.get(CPU_ATTN_ENV)
    if path is not None:
        os.environ[CPU_ATTN_ENV] = path  # read by the worker when it builds the backend
    try:
        llm = build_llm(EngineSettings(model=None, pic=pic, max_model_len=max_model_len))
    finally:
        if previous is None:
            os.environ.pop(CPU_ATTN_ENV, None)
        else:
            os.environ[CPU_ATTN_ENV] = previous
    pids = [p.pid for p in psutil.Process().children(recursive=True) if p.pid not in before]
    return {"llm": llm, "pids": pids}


def _compare(stock: dict[str, Any], pic: dict[str, Any], path: str, reps: int, seed: int,
             vocab: int) -> dict[str, Any]:
    rng = random.Random(seed)
    result: dict[str, Any] = {}
    for name, wl in WORKLOADS.items():
        warm = _prompts(rng, wl["batch"], wl["prompt_len"], vocab)
        for engine in (stock, pic):  # first runs pay lazy initialisation and page faults
            _run(engine, warm, wl["max_tokens"])
        wall: dict[str, list[float]] = {"stock": [], "minipic": []}
        cpu: dict[str, list[float]] = {"stock": [], "minipic": []}
        same_tokens = True
        for rep in range(reps):
            prompts = _prompts(rng, wl["batch"], wl["prompt_len"], vocab)
            order = [("stock", stock), ("minipic", pic)]
            if rep % 2:
                order.reverse()  # alternate which engine runs first
            tokens = {}
            for label, engine in order:
                elapsed, cpu_s, tokens[label] = _run(engine, prompts, wl["max_tokens"])
                wall[label].append(elapsed)
                cpu[label].append(cpu_s)
            same_tokens &= tokens["stock"] == tokens["minipic"]
            print(f"  [{path}] {name} rep {rep}: wall stock {wall['stock'][-1]:.3f}s minipic "
                  f"{wall['minipic'][-1]:.3f}s | cpu stock {cpu['stock'][-1]:.3f}s minipic "
                  f"{cpu['minipic'][-1]:.3f}s | load {os.getloadavg()[0]:.1f}", flush=True)
        result[name] = {**wl, "greedy_tokens_identical": same_tokens,
                        "wall": _summary(wall), "engine_cpu": _summary(cpu)}
    return result


def _summary(times: dict[str, list[float]]) -> dict[str, Any]:
    med_stock, med_pic = statistics.median(times["stock"]), statistics.median(times["minipic"])
    paired = [p / s for p, s in zip(times["minipic"], times["stock"], strict=True)]
    return {
        "stock_s": times["stock"],
        "minipic_s": times["minipic"],
        "stock_median_s": med_stock,
        "minipic_median_s": med_pic,
        "ratio_of_medians": med_pic / med_stock,
        "median_paired_ratio": statistics.median(paired),
        # Least disturbed run of each: the best estimate of uncontended cost on a shared host.
        "ratio_of_mins": min(times["minipic"]) / min(times["stock"]),
    }


def _round(path: str, round_idx: int, reps: int, seed: int, max_model_len: int,
           vocab: int | None) -> tuple[dict[str, Any], int]:
    """Start both engines (stock first in even rounds, minipic first in odd ones), compare,
    close both."""
    from minipic.span_contract.engine_config import close_llm

    specs = [("stock", False, None), ("minipic", path != "stock", path)]
    if round_idx % 2:
        specs.reverse()
    engines: dict[str, dict[str, Any]] = {}
    try:
        for label, pic, env_path in specs:
            print(f"round {round_idx}: starting {label} engine (MINIPIC_CPU_ATTN={env_path})",
                  flush=True)
            engines[label] = _start(pic=pic, path=env_path, max_model_len=max_model_len)
        if vocab is None:
            from transformers import AutoConfig

            model = engines["stock"]["llm"].minipic_settings.model
            vocab = AutoConfig.from_pretrained(model).vocab_size
        result = _compare(engines["stock"], engines["minipic"], path, reps,
                          seed + round_idx, vocab)
        result["started_first"] = specs[0][0]
        return result, vocab
    finally:
        for engine in engines.values():
            close_llm(engine["llm"])


def _combine(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Geometric mean over rounds of each round's ratios: a constant advantage of whichever
    engine was started first (measured with ``--paths stock``) cancels out."""
    return {name: _combined([r[name] for r in rounds]) for name in WORKLOADS}


# What the comparisons on this harness share (``cpu_runtime.py`` imports them too): options,
# the report's first fields, the combination of rounds and the printed ratios.


def _harness_args(parser: argparse.ArgumentParser, *, rounds: int, rounds_help: str,
                  out: str) -> tuple[argparse.Namespace, int]:
    """Add the harness's options (``--reps``, ``--rounds``, ``--seed``, ``--max-model-len``,
    ``--out``) after the caller's own, parse, and return the arguments and the seed (``--seed``
    or a fresh one). Each engine gets 1 GiB of KV cache unless ``VLLM_CPU_KVCACHE_SPACE`` is
    set: a round keeps several engines alive at once."""
    parser.add_argument("--reps", type=int, default=5, help="timed reps per round")
    parser.add_argument("--rounds", type=int, default=rounds, help=rounds_help)
    parser.add_argument("--seed", type=int, default=None, help="default: fresh")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--out", default=out)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    return args, seed


def _report_header(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """A report's first fields: what ran (model, workloads, seed, reps, rounds) and where."""
    return {
        "model": "SmolLM2-135M-Instruct (minipic default), fp32, enforce_eager, block 32",
        "workloads": WORKLOADS,
        "seed": seed,
        "reps_per_round": args.reps,
        "rounds": args.rounds,
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        # vLLM pins each CPU worker to cores; on a shared host, pinning both engines to the
        # least busy core (e.g. VLLM_CPU_OMP_THREADS_BIND=1) reduces noise.
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
    }


def _combined(per_round: list[dict[str, Any]]) -> dict[str, Any]:
    """One comparison over rounds: the geometric mean of each ratio (wall and engine CPU time;
    median paired ratio and ratio of mins), and whether every round's greedy tokens agreed."""
    combined: dict[str, Any] = {}
    for metric in ("wall", "engine_cpu"):
        for stat in ("median_paired_ratio", "ratio_of_mins"):
            ratios = [r[metric][stat] for r in per_round]
            combined[f"{metric}_{stat}"] = statistics.geometric_mean(ratios)
    combined["greedy_tokens_identical"] = all(r["greedy_tokens_identical"] for r in per_round)
    return combined


def _write_report(report: dict[str, Any], args: argparse.Namespace, title: str,
                  rounds: str) -> Path:
    """Write ``report`` to ``--out`` and print the summary's first line: ``title``, seed,
    ``<n> <rounds> x <reps> reps`` and the load average at start and end."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{title}, seed {report['seed']}, {args.rounds} {rounds} x {args.reps} reps, "
          f"load average {report['load_average_start'][0]:.1f} -> "
          f"{report['load_average_end'][0]:.1f}:")
    return out


def _ratio_line(c: dict[str, Any]) -> str:
    """A ``_combined`` entry's four ratios, as the summaries print them."""
    return (f"median paired: wall {c['wall_median_paired_ratio']:.3f} cpu "
            f"{c['engine_cpu_median_paired_ratio']:.3f} | ratio of mins: wall "
            f"{c['wall_ratio_of_mins']:.3f} cpu {c['engine_cpu_ratio_of_mins']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--paths", nargs="+", default=["auto"],
                        choices=["auto", "scratch", "torch", "stock"],
                        help="MINIPIC_CPU_ATTN paths to compare with stock (default: auto); "
                             "'stock' starts a second stock engine: an A/A calibration of the "
                             "harness on this machine")
    args, seed = _harness_args(
        parser, rounds=2, rounds_help="engine pairs per path, alternating which one starts first",
        out="results/pic_overhead.json")

    report: dict[str, Any] = {
        **_report_header(args, seed),
        "load_average_start": os.getloadavg(),
        "paths": {},
    }
    vocab = None
    for path in args.paths:
        rounds = []
        for round_idx in range(args.rounds):
            result, vocab = _round(path, round_idx, args.reps, seed, args.max_model_len, vocab)
            rounds.append(result)
        report["paths"][path] = {"rounds": rounds, "combined_ratio": _combine(rounds)}
    report["load_average_end"] = os.getloadavg()

    out = _write_report(report, args, "PIC-off cost vs stock CPU_ATTN (minipic / stock; "
                        "target <= 1.05)", "rounds")
    for path, res in report["paths"].items():
        for name in WORKLOADS:
            per_round = ", ".join(
                f"{r['started_first']} first: wall {r[name]['wall']['median_paired_ratio']:.3f}"
                for r in res["rounds"]
            )
            c = res["combined_ratio"][name]
            print(f"  {path:8s} {name:8s} {_ratio_line(c)} | {per_round} | "
                  f"greedy tokens identical: {c['greedy_tokens_identical']}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
