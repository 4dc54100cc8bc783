"""Measure the scheduler's choices on a small real batch: ISPS vs barrier, skip_warm on vs off.

Workload: the first N answerable fanoutqa questions, k BM25 passages each (neighbouring questions
often share passages), answered by the embedded default model in block_attention mode.

- ISPS vs barrier: each run starts from an empty prefix cache (``reset_cache``). Reported: wall
  time of the batch, and per question the time from the batch's start to its first token
  (``warm_s + ttft_s``: what a user waiting on that question sees), median and mean.
- skip_warm on vs off: the same batch again on a warm cache. On: prefills of spans the registry
  knows are warm are skipped. Off: every distinct span is prefilled again (de-duplicated; the
  engine finds them cached, but each is still a request and a scheduling step).

    python examples/scheduling_bench.py [--questions 8] [--k 3] [--reps 2] [--model tiny-llama]
"""

from __future__ import annotations

import argparse
import statistics
import time

from minipic.orchestrator import Answer, SyncOrchestrator
from minipic.orchestrator.corpus import default_corpus, load_qa_items

SYSTEM = "Answer the question using only the documents provided. Reply with a short phrase."


def run_batch(orc: SyncOrchestrator, batch: list, max_tokens: int, **kwargs) -> dict:
    started = time.perf_counter()
    results = orc.answer_many(batch, system=SYSTEM, max_tokens=max_tokens, **kwargs)
    wall = time.perf_counter() - started
    answers = [r for r in results if isinstance(r, Answer)]
    assert len(answers) == len(batch), [r for r in results if not isinstance(r, Answer)]
    first = [a.warm_s + a.ttft_s for a in answers]
    return {
        "wall_s": wall,
        "first_token_median_s": statistics.median(first),
        "first_token_mean_s": statistics.fmean(first),
        "ttft_median_s": statistics.median(a.ttft_s for a in answers),
        "prefills": sum(a.prefills_sent for a in answers),
        "cache_ok": all(a.cache_ok for a in answers),
    }


def median_of(runs: list[dict]) -> dict:
    return {k: all(r[k] for r in runs) if k == "cache_ok" else statistics.median(r[k] for r in runs)
            for k in runs[0]}


def show(label: str, r: dict) -> None:
    print(f"{label:<22} wall {r['wall_s']:6.2f} s | batch start -> first token: median "
          f"{r['first_token_median_s']:5.2f} s, mean {r['first_token_mean_s']:5.2f} s | "
          f"final TTFT median {r['ttft_median_s'] * 1e3:5.0f} ms | span prefills "
          f"{r['prefills']:3.0f} | cache ok {r['cache_ok']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-in-flight", type=int, default=8)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()

    corpus = default_corpus()
    items = load_qa_items()[: args.questions]
    batch = [(it.question, [p.as_document for p in corpus.search(it.question, args.k)])
             for it in items]
    distinct = len({d for _, docs in batch for d in docs})
    print(f"{len(batch)} questions, {args.k} passages each, {distinct} distinct passages")
    with SyncOrchestrator.embedded(args.model,
                                   options={"max_in_flight": args.max_in_flight}) as orc:
        run_batch(orc, batch[:1], 1)  # warm-up: first-step set-up costs
        cold: dict[str, list[dict]] = {"isps": [], "barrier": []}
        warm: dict[str, list[dict]] = {"skip_warm=True": [], "skip_warm=False": []}
        for _ in range(args.reps):
            for policy in cold:  # alternate so drift in machine load hits both
                orc.reset_cache()
                cold[policy].append(run_batch(orc, batch, args.max_tokens, policy=policy))
            for label, skip in (("skip_warm=True", True), ("skip_warm=False", False)):
                warm[label].append(run_batch(orc, batch, args.max_tokens, skip_warm=skip))
    print(f"median of {args.reps} runs each")
    for label, runs in cold.items():
        show(f"cold cache, {label}", median_of(runs))
    for label, runs in warm.items():
        show(f"warm cache, {label}", median_of(runs))


if __name__ == "__main__":
    main()
