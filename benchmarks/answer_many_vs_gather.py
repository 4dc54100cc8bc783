"""``answer_many`` vs naive concurrency (every question its own ``answer()``, ``asyncio.gather``),
cold and warm, in one run on one engine.

    python benchmarks/answer_many_vs_gather.py                      # SmolLM2, 16 questions
    python benchmarks/answer_many_vs_gather.py --model tiny-llama --questions 8 --reps 1

Why this shape: the issue's load run measured ``answer_many`` first and the gather run after it,
over overlapping documents — so the second run found the first one's spans warm. Here each path
gets its own ``cache_salt`` (a salted span is a separate cache entry), so both start cold, and
each is then run again over the same documents with other questions (warm: the spans are cached,
only the question blocks and decoding are new). The order of the two paths alternates per rep.
Each ``max_in_flight`` value is measured the same way, to separate the scheduler's concurrency
limit from warmth. Workload: ``minipic.bench.workloads.rag_workload`` (real questions, passages
shared across questions). Output: ``results/answer_many_vs_gather.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
import uuid
from pathlib import Path
from typing import Any


def _questions(items: list[Any], shift: int) -> list[dict[str, Any]]:
    """Item i's documents and system prompt with item (i + shift)'s question."""
    n = len(items)
    return [{"question": items[(i + shift) % n].question, "documents": item.documents,
             "system": item.system} for i, item in enumerate(items)]


async def _batched(orc: Any, questions: list[dict[str, Any]], salt: str,
                   max_tokens: int) -> list[Any]:
    return await orc.answer_many(questions, cache_salt=salt, max_tokens=max_tokens)


async def _gathered(orc: Any, questions: list[dict[str, Any]], salt: str,
                    max_tokens: int) -> list[Any]:
    return list(await asyncio.gather(
        *(orc.answer(q["question"], q["documents"], q["system"], cache_salt=salt,
                     max_tokens=max_tokens) for q in questions),
        return_exceptions=True))


async def _timed(path: str, orc: Any, questions: list[dict[str, Any]], salt: str,
                 max_tokens: int) -> dict[str, Any]:
    run = _batched if path == "answer_many" else _gathered
    started = time.perf_counter()
    results = await run(orc, questions, salt, max_tokens)
    elapsed = time.perf_counter() - started
    ok = [r for r in results if not isinstance(r, BaseException)]
    prompt = sum(a.prompt_tokens for a in ok)
    return {
        "samples": len(questions), "failed": len(results) - len(ok), "elapsed_s": elapsed,
        "samples_per_s": len(questions) / elapsed,
        "ttft_p50_s": statistics.median(a.ttft_s for a in ok) if ok else None,
        "first_token_p50_s": statistics.median(a.warm_s + a.ttft_s for a in ok) if ok else None,
        "prefills_sent": sum(a.prefills_sent for a in ok),
        "hit_rate": sum(a.cached_tokens for a in ok) / max(1, prompt),
    }


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    from minipic.bench.workloads import rag_workload
    from minipic.orchestrator import Orchestrator

    orc = Orchestrator.embedded(args.model, max_model_len=2048)
    try:
        items = rag_workload(args.questions, orc.builder.count_tokens, seed=args.seed,
                             passages_per_question=args.passages, relevant=2)
        cold_q, warm_q = _questions(items, 0), _questions(items, 1)
        # untimed warm-up of the engine itself (first-request costs), under its own salt
        await _batched(orc, cold_q[:2], uuid.uuid4().hex, args.max_tokens)
        runs: list[dict[str, Any]] = []
        for in_flight in args.in_flight:
            total, _, prefills = in_flight.partition(":")
            orc.configure(max_in_flight=int(total),
                          max_prefills_in_flight=int(prefills) if prefills else None)
            prefill_limit = orc.scheduler._state().prefill_slots.limit  # the effective one
            for rep in range(args.reps):
                paths = ["answer_many", "gather"]
                if rep % 2:
                    paths.reverse()
                salts = {path: uuid.uuid4().hex for path in paths}
                for warmth, questions in (("cold", cold_q), ("warm", warm_q)):
                    for path in paths:
                        row = await _timed(path, orc, questions, salts[path], args.max_tokens)
                        row.update(path=path, warmth=warmth, max_in_flight=in_flight, rep=rep,
                                   prefills_in_flight=prefill_limit)
                        runs.append(row)
                        print(f"in_flight={in_flight:>5s} rep={rep} {warmth} {path:11s} "
                              f"{row['samples_per_s']:6.2f} samples/s "
                              f"(hit {row['hit_rate']:.0%}, {row['prefills_sent']} prefills)",
                              flush=True)
        return {"runs": runs, "summary": _summary(runs)}
    finally:
        await orc.aclose()


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median samples/s per (max_in_flight, warmth, path), and the ratios the issue asks for."""
    cells: dict[str, list[float]] = {}
    for r in runs:
        cells.setdefault(f"{r['max_in_flight']}/{r['warmth']}/{r['path']}",
                         []).append(r["samples_per_s"])
    med = {key: statistics.median(v) for key, v in cells.items()}
    first: dict[str, list[float]] = {}
    for r in runs:
        first.setdefault(f"{r['max_in_flight']}/{r['warmth']}/{r['path']}",
                         []).append(r["first_token_p50_s"])
    out: dict[str, Any] = {
        "samples_per_s": med,
        # median over reps of each run's median question's first token (from the call)
        "first_token_p50_s": {key: statistics.median(v) for key, v in first.items()},
    }
    by_rep = {(r["max_in_flight"], r["warmth"], r["rep"], r["path"]): r["samples_per_s"]
              for r in runs}
    for key in [k for k in med if k.endswith("/answer_many")]:
        flight, warmth, _ = key.split("/")
        paired = [v / by_rep[(flight, warmth, rep, "gather")]
                  for (f, w, rep, path), v in by_rep.items()
                  if (f, w, path) == (flight, warmth, "answer_many")]
        # per rep, the two paths ran back to back: their ratio is less noisy than the medians'
        out[f"{flight}/{warmth}: answer_many / gather (median of paired)"] = (
            statistics.median(paired))
    flights = list(dict.fromkeys(r["max_in_flight"] for r in runs))
    lo = flights[0]
    for k in flights[1:]:
        for warmth in ("cold", "warm"):
            out[f"{warmth}: answer_many at {k} / at {lo}"] = (
                med[f"{k}/{warmth}/answer_many"] / med[f"{lo}/{warmth}/answer_many"])
    for k in flights:  # what the issue compared: gather over warm spans vs answer_many cold
        out[f"{k}: gather warm / answer_many cold"] = (
            med[f"{k}/warm/gather"] / med[f"{k}/cold/answer_many"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder or 'tiny-llama' (default SmolLM2)")
    p.add_argument("--questions", type=int, default=16)
    p.add_argument("--passages", type=int, default=4, help="documents per question")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--in-flight", nargs="+", default=["8", "64", "32:4"],
                   help="max_in_flight values to compare; TOTAL:PREFILLS also sets "
                        "max_prefills_in_flight (default: half of TOTAL)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("results/answer_many_vs_gather.json"))
    args = p.parse_args()
    report = asyncio.run(measure(args))
    report["config"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    report["machine"] = {"platform": platform.platform(), "python": platform.python_version()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["summary"], indent=2))


if __name__ == "__main__":
    main()
