"""vLLM's CPU runtime recommendations (tcmalloc + Intel OpenMP preloaded) vs vLLM's defaults.

    python benchmarks/cpu_runtime.py                    # 1 round x 5 reps, ~5 min on 2 cores
    python benchmarks/cpu_runtime.py --rounds 2         # the start order reversed too

Why: ``span_contract.cpu_runtime`` preloads ``libtcmalloc_minimal.so.4`` and ``libiomp5.so``
into every engine minipic starts, as vLLM's CPU docs ask; without them vLLM preloads PyTorch's
``libgomp`` and allocates with glibc's malloc. This measures whether that helps here, for stock
vLLM (plugin off) and for minipic (plugin on) alike, so the default can follow the numbers.

One round starts four engines, all alive at once: {stock, minipic} x {preload off
(``MINIPIC_CPU_PRELOAD=0``: vLLM's defaults), preload on}; SmolLM2-135M (the default model), fp32,
eager, block 32, thread binding left to vLLM (``VLLM_CPU_OMP_THREADS_BIND=auto``). The start
order is stock/off, stock/on, minipic/on, minipic/off (reversed in odd rounds), so an advantage of
whichever engine started first, which ``benchmarks/pic_overhead.py`` once saw, works against
"on" for one kind and for it in the other. Workloads and timing are ``pic_overhead.py``'s (its
helpers are reused): ``prefill`` (2 x 384-token prompts, 1 output token) and ``decode`` (8 x 64,
64 tokens each), each rep on fresh prompts with the prefix cache reset, the four engines run one
after another in a rotating order, a settle pause between runs. Per kind and workload we keep
the median over reps of the paired ratio on/off (< 1: the preload is faster) for wall time and
for the engines' own CPU time, and the ratio of the fastest runs. Each engine's processes are
checked (``/proc/<pid>/maps``) for what they actually loaded; greedy tokens are compared.
Output: ``results/cpu_runtime.json``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pic_overhead import (  # noqa: E402  (same harness, same numbers)
    WORKLOADS,
    _combined,
    _harness_args,
    _prompts,
    _ratio_line,
    _report_header,
    _run,
    _write_report,
)

ENGINES = (("stock", False, False), ("stock", False, True),
           ("minipic", True, True), ("minipic", True, False))  # (kind, pic, preload)
LIBS = ("libtcmalloc", "libiomp5", "libgomp")


def _label(kind: str, preload: bool) -> str:
    return f"{kind}/{'on' if preload else 'off'}"


def _loaded(pids: list[int]) -> dict[str, list[str]]:
    """Which of the runtime libraries each engine process has mapped (EngineCore, worker)."""
    found: dict[str, list[str]] = {}
    for pid in pids:
        with open(f"/proc/{pid}/maps") as maps:
            names = {Path(line.split()[-1]).name for line in maps if "/" in line}
        found[str(pid)] = sorted(n for n in names if n.startswith(LIBS))
    return found


def _start(pic: bool, preload: bool, max_model_len: int) -> dict[str, Any]:
    """An engine with the preload on or off, the pids it started and what they loaded.

    ``LD_PRELOAD`` is restored after each start: with the preload off vLLM's CPU platform
    appends PyTorch's libgomp to this process's ``LD_PRELOAD``, which would keep Intel OpenMP
    out of the next "on" engine (only one OpenMP runtime may be preloaded)."""
    import psutil

    from minipic.span_contract.cpu_runtime import PRELOAD_ENV
    from minipic.span_contract.engine_config import EngineSettings, build_llm, patched_environ

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    # LD_PRELOAD listed so that whatever vLLM adds to it during start-up is undone after
    with patched_environ({PRELOAD_ENV: "1" if preload else "0",
                          "LD_PRELOAD": os.environ.get("LD_PRELOAD")}):
        llm = build_llm(EngineSettings(model=None, pic=pic, max_model_len=max_model_len))
    pids = [p.pid for p in psutil.Process().children(recursive=True) if p.pid not in before]
    return {"llm": llm, "pids": pids, "loaded": _loaded(pids)}


def _summary(on: list[float], off: list[float]) -> dict[str, Any]:
    paired = [a / b for a, b in zip(on, off, strict=True)]
    return {"on_s": on, "off_s": off, "on_median_s": statistics.median(on),
            "off_median_s": statistics.median(off),
            "median_paired_ratio": statistics.median(paired),
            "ratio_of_mins": min(on) / min(off)}


def _round(round_idx: int, reps: int, seed: int, max_model_len: int) -> dict[str, Any]:
    from transformers import AutoConfig

    from minipic.span_contract.engine_config import close_llm

    specs = list(ENGINES) if round_idx % 2 == 0 else list(reversed(ENGINES))
    engines: dict[str, dict[str, Any]] = {}
    try:
        for kind, pic, preload in specs:
            label = _label(kind, preload)
            print(f"round {round_idx}: starting {label}", flush=True)
            engines[label] = _start(pic, preload, max_model_len)
            print(f"  loaded: {engines[label]['loaded']}", flush=True)
        model = next(iter(engines.values()))["llm"].minipic_settings.model
        vocab = AutoConfig.from_pretrained(model).vocab_size
        rng = random.Random(seed + round_idx)
        order = [_label(k, p) for k, _, p in specs]
        result: dict[str, Any] = {"start_order": order,
                                  "loaded": {k: e["loaded"] for k, e in engines.items()}}
        for name, wl in WORKLOADS.items():
            warm = _prompts(rng, wl["batch"], wl["prompt_len"], vocab)
            for engine in engines.values():  # first runs pay lazy initialisation, page faults
                _run(engine, warm, wl["max_tokens"])
            wall: dict[str, list[float]] = {k: [] for k in engines}
            cpu: dict[str, list[float]] = {k: [] for k in engines}
            same = {"stock": True, "minipic": True}
            for rep in range(reps):
                prompts = _prompts(rng, wl["batch"], wl["prompt_len"], vocab)
                turn = order[rep % len(order):] + order[:rep % len(order)]  # rotate who goes first
                tokens = {}
                for label in turn:
                    elapsed, cpu_s, tokens[label] = _run(engines[label], prompts,
                                                         wl["max_tokens"])
                    wall[label].append(elapsed)
                    cpu[label].append(cpu_s)
                for kind in same:
                    same[kind] &= tokens[f"{kind}/on"] == tokens[f"{kind}/off"]
                print(f"  {name} rep {rep}: " + " | ".join(
                    f"{k} {wall[k][-1]:.3f}s" for k in order)
                    + f" | load {os.getloadavg()[0]:.1f}", flush=True)
            result[name] = {
                kind: {"greedy_tokens_identical": same[kind],
                       "wall": _summary(wall[f"{kind}/on"], wall[f"{kind}/off"]),
                       "engine_cpu": _summary(cpu[f"{kind}/on"], cpu[f"{kind}/off"])}
                for kind in same}
        return result
    finally:
        for engine in engines.values():
            close_llm(engine["llm"])


def _combine(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Geometric mean over rounds of each round's on/off ratios."""
    return {name: {kind: _combined([r[name][kind] for r in rounds])
                   for kind in ("stock", "minipic")}
            for name in WORKLOADS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args, seed = _harness_args(
        parser, rounds=1, rounds_help="rounds of four engines (odd rounds reverse the start order)",
        out="results/cpu_runtime.json")
    from minipic.span_contract.cpu_runtime import preload_env

    report: dict[str, Any] = {
        **_report_header(args, seed),
        "preload_on": preload_env({}).get("LD_PRELOAD", ""),
        "ratio": "preload on / off: < 1 means the preload is faster",
        "load_average_start": os.getloadavg(),
    }
    started = time.perf_counter()
    rounds = [_round(i, args.reps, seed, args.max_model_len) for i in range(args.rounds)]
    report["rounds_detail"] = rounds
    report["combined_ratio"] = _combine(rounds)
    report["load_average_end"] = os.getloadavg()
    report["elapsed_s"] = time.perf_counter() - started

    out = _write_report(report, args, "preload on / off (< 1: faster with tcmalloc + Intel "
                        "OpenMP)", "round(s)")
    for name, kinds in report["combined_ratio"].items():
        for kind, c in kinds.items():
            print(f"  {name:8s} {kind:8s} {_ratio_line(c)} | "
                  f"greedy tokens identical: {c['greedy_tokens_identical']}")
    print(f"wrote {out} ({report['elapsed_s']:.0f} s)")


if __name__ == "__main__":
    main()
