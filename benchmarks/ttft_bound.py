"""TTFT against its bound at ~2k / 4k / 8k-token prompts: speed-up, bound, ratio, breakdown.

A cached final cannot start sooner than the engine computes its uncached tokens, so minipic's
TTFT speed-up is bounded by (stock TTFT of the full prompt) / (stock TTFT of a prompt of only
the uncached tokens). This script measures both sides in one run, on two engines in one process
(stock vLLM with prefix caching, and minipic; SmolLM2-135M, fp32, eager, ``max_model_len``
raised to 8192, the model's own limit), for prompts of ``--span-tokens``-token passages from the
offline Wikipedia corpus, all warmed once, in a new random order per final:

* ``minipic``: the cached final (``Orchestrator.answer``, block_attention, 1 token), spans warm;
* ``repeat``: the same spans in the same order with another question (the key shadow already
  holds every block at its slot);
* ``stock_full``: stock vLLM, the same token ids, cold cache;
* ``stock_ideal``: stock vLLM, the ``repeat`` prompt right after ``stock_full`` (its prefix is
  cached at the same positions: only the question block is computed, in context);
* ``stock_uncached``: stock vLLM, a prompt of only the tokens minipic did not find cached.

With the step profile on (default; ``engine_ext/profiling/step_profile.py``,
``MINIPIC_PROFILE_DIR``) each request's TTFT is split into buckets (rotation into the key shadow,
step planning, scheduling and the lookup past misses, attention kernels, model compute,
transport/front-end).

Writes ``ttft_bound.json``, ``ttft_bound.png``, ``breakdown.json`` and ``breakdown.md`` under
``--out``. One command (2-core machine: about 6 min at the defaults)::

    flock /tmp/minipic-cpu.lock .venv/bin/python benchmarks/ttft_bound.py --out results/ttft_bound
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from _provenance import git_state

# system block + question block + generated token, kept out of the span budget of a size
RESERVE_TOKENS = 96
SYSTEM = ("You are a careful research assistant. Use only the documents below to answer. "
          "Answer with a short phrase.")


class Progress:
    """One line per measurement on stderr: elapsed time, step counter, what ran, its result."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.started = time.perf_counter()

    def __call__(self, message: str, *, step: bool = True) -> None:
        if step:
            self.done += 1
        counter = f"{self.done:>3}/{self.total}" if step else "       "
        print(f"[{time.perf_counter() - self.started:7.1f}s {counter}] {message}",
              file=sys.stderr, flush=True)


def _tree_state() -> str:
    """Which code was measured: the commit, and whether engine files had local changes."""
    state = git_state("engine_ext", "kernels")
    if state is None:
        return "unknown (not a git checkout)"
    head, dirty = state
    return f"{head}" + (" + local changes in engine_ext/kernels" if dirty else "")


class Run:
    """Both engines, the document pool and the measurements of one run."""

    def __init__(self, args: argparse.Namespace, progress: Progress) -> None:
        self.args = args
        self.progress = progress
        self.rng = random.Random(args.seed)
        self.samples: dict[int, list[dict[str, Any]]] = {}
        self.windows: list[dict[str, Any]] = []  # (case, size, t_sent, t_first, engine)
        self.questions: list[str] = []
        self.stock: Any = None
        self.pic: Any = None

    async def start(self) -> None:
        from minipic.orchestrator import Orchestrator
        from minipic.orchestrator.corpus import load_qa_items

        self.progress(f"starting stock vLLM (plugin off), max_model_len={self.args.max_model_len}")
        self.stock = Orchestrator.embedded(pic=False, max_model_len=self.args.max_model_len)
        self.progress("starting minipic vLLM (plugin on)")
        self.pic = Orchestrator.embedded(pic=True, max_model_len=self.args.max_model_len)
        qa = [q.question for q in load_qa_items()]
        self.rng.shuffle(qa)
        self.questions = qa

    async def close(self) -> None:
        for orc in (self.pic, self.stock):
            if orc is not None:
                await orc.aclose()

    def _question(self) -> str:
        return self.questions[len(self.windows) % len(self.questions)]

    def documents(self, n: int) -> list[str]:
        """``n`` corpus passages cut to ``span_tokens`` tokens with their SSEP (fixed pool)."""
        from minipic.orchestrator.corpus import load_passages

        builder = self.pic.builder
        span = self.args.span_tokens
        passages = [p for p in load_passages() if builder.count_tokens(p.as_document) >= span]
        chosen = random.Random(f"{self.args.seed}:docs").sample(passages, n)
        return [builder.decode(builder.encode(p.as_document)[:span - 2]) for p in chosen]

    async def _stock(self, case: str, size: int, ids: list[int]) -> Any:
        from minipic.orchestrator.backends import Sampling

        sent = time.perf_counter()
        done = await self.stock.backend.generate(ids, sampling=Sampling(max_tokens=1))
        self.windows.append({"case": case, "size": size, "engine": "stock", "t_sent": sent,
                             "t_first": sent + done.ttft_s, "ttft_s": done.ttft_s})
        return done

    async def _pic(self, case: str, size: int, question: str, docs: list[str]) -> Any:
        """The cached final as the SDK sends it; its window is the final's own send..first."""
        answer = await self.pic.answer(question, docs, SYSTEM, mode="block_attention",
                                       max_tokens=1)
        ended = time.perf_counter()
        latency = answer.total_s - answer.warm_s  # the final's own send .. last token
        sent = ended - latency
        if answer.prefills_sent or not answer.cache_ok:
            raise RuntimeError(f"{case} at {size}: {answer.prefills_sent} prefills sent, cached "
                               f"{answer.cached_tokens} of {answer.expected_cached_tokens} "
                               f"expected: the spans were not all warm")
        self.windows.append({"case": case, "size": size, "engine": "pic", "t_sent": sent,
                             "t_first": sent + answer.ttft_s, "ttft_s": answer.ttft_s})
        return answer

    async def point(self, size: int, docs: list[str]) -> None:
        """All measurements of one prompt size (``reps`` stock prefills of the full prompt)."""
        args = self.args
        # Untimed: the first final at a new length grows the key shadow's pages once.
        first = await self._pic("first_at_size", size, self._question(), docs)
        self.progress(f"~{size}: first final at this size (untimed) "
                      f"{first.ttft_s * 1e3:.0f} ms, {first.prompt_tokens} tokens", step=False)
        rows = self.samples.setdefault(size, [])
        for rep in range(args.reps):
            for k in range(args.cheap_reps):
                order = docs[:]
                self.rng.shuffle(order)
                question = self._question()
                build_t0 = time.perf_counter()
                prompt = self.pic.build(question, order, SYSTEM, max_tokens=1)
                build_s = time.perf_counter() - build_t0
                call_t0 = time.perf_counter()
                a = await self._pic("minipic", size, question, order)
                call_s = time.perf_counter() - call_t0
                if a.prompt_tokens != prompt.num_prompt_tokens:
                    raise RuntimeError("the built prompt differs from the one answer() sent")
                uncached = a.prompt_tokens - a.cached_tokens
                row: dict[str, Any] = {
                    "rep": rep, "order": k, "prompt_tokens": a.prompt_tokens,
                    "cached_tokens": a.cached_tokens, "minipic_s": a.ttft_s,
                    "orchestrator_build_s": build_s, "answer_call_s": call_s,
                }
                if k == 0:
                    # same order, another question: pool warm; then stock on the same ids
                    q2 = self._question()
                    again = self.pic.build(q2, order, SYSTEM, max_tokens=1)
                    b = await self._pic("repeat", size, q2, order)
                    await self.stock.reset_cache()
                    c = await self._stock("stock_full", size, prompt.prompt_token_ids)
                    d = await self._stock("stock_ideal", size, again.prompt_token_ids)
                    row.update(repeat_s=b.ttft_s, stock_full_s=c.ttft_s,
                               stock_ideal_s=d.ttft_s, stock_ideal_cached=d.cached_tokens,
                               repeat_cached=b.cached_tokens)
                e = await self._stock("stock_uncached", size, prompt.prompt_token_ids[-uncached:])
                row.update(stock_uncached_s=e.ttft_s, uncached_tokens=uncached)
                rows.append(row)
                msg = (f"~{size} rep {rep + 1}/{args.reps} order {k + 1}/{args.cheap_reps}: "
                       f"minipic {a.ttft_s * 1e3:.0f} ms, stock uncached-only "
                       f"({uncached} tokens) {e.ttft_s * 1e3:.0f} ms")
                if k == 0:
                    msg += (f", repeat {row['repeat_s'] * 1e3:.0f} ms, stock full "
                            f"{row['stock_full_s']:.2f} s, stock ideal "
                            f"{row['stock_ideal_s'] * 1e3:.0f} ms")
                self.progress(msg)


def _points(samples: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per size: the summary (``point_summary``) plus the orchestrator's own costs."""
    from minipic.bench.ttft_bound import median, point_summary

    out = []
    for size, rows in sorted(samples.items()):
        summary = point_summary(size, rows)
        # outside the TTFT: building the prompt (tokenizing every document) and the SDK's
        # scheduling around the final
        summary["orchestrator_build_ms_p50"] = median(
            [r["orchestrator_build_s"] for r in rows]) * 1e3
        summary["answer_minus_ttft_ms_p50"] = median(
            [(r["answer_call_s"] - r["minipic_s"]) for r in rows]) * 1e3
        out.append(summary)
    return out


def _breakdowns(windows: list[dict[str, Any]], folder: Path) -> dict[str, Any]:
    """Per size and case: bucket-wise medians of the requests' TTFT breakdowns."""
    from minipic.bench.ttft_bound import breakdown, median_breakdown
    from minipic.engine_ext.profiling import step_profile

    step_profile.flush()
    headers, events = step_profile.read_events(folder)
    me = os.getpid()
    engine_pids = {
        "pic": {pid for pid, h in headers.items() if h.get("plugin") and pid != me} | {me},
        "stock": {pid for pid, h in headers.items() if not h.get("plugin") and pid != me}
        | {me},
    }
    per: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for w in windows:
        row = breakdown(events, w["t_sent"], w["t_first"], engine_pids[w["engine"]])
        per.setdefault(str(w["size"]), {}).setdefault(w["case"], []).append(row)
    skipped = sorted({t for h in headers.values() for t in h.get("skipped", [])})
    return {
        "processes": {str(pid): h for pid, h in headers.items()},
        "targets_missing": skipped,
        "by_size": {size: {case: median_breakdown(rows) for case, rows in cases.items()}
                    for size, cases in per.items()},
        "requests": {size: cases for size, cases in per.items()},
    }


async def _main(args: argparse.Namespace, profile_dir: Path | None) -> dict[str, Any]:
    from minipic.bench.ttft_bound import goals, spans_for

    sizes = args.sizes
    progress = Progress(total=2 + 1 + len(sizes) * args.reps * args.cheap_reps)
    run = Run(args, progress)
    started = time.perf_counter()
    try:
        await run.start()
        bs = run.pic.builder.span_config.block_size
        counts = {size: spans_for(size, args.span_tokens, bs, RESERVE_TOKENS) for size in sizes}
        docs = run.documents(max(counts.values()))
        t0 = time.perf_counter()
        sent = await run.pic.warm(docs, SYSTEM)
        progress(f"warmed {len(docs)} spans of {args.span_tokens} tokens ({sent} prefills, "
                 f"{time.perf_counter() - t0:.1f} s)")
        for size in sizes:
            await run.point(size, docs[:counts[size]])
        pool = await run.pic.backend.rotated_pool_stats()
        breakdowns = None
        if profile_dir is not None:  # read while the engines live: they flush periodically
            from minipic.engine_ext.profiling.step_profile import FLUSH_INTERVAL_S

            await asyncio.sleep(3 * FLUSH_INTERVAL_S)
            breakdowns = _breakdowns(run.windows, profile_dir)
    finally:
        await run.close()
    points = _points(run.samples)
    for p in points:
        p["spans"] = counts[p["size"]]
    report: dict[str, Any] = {
        "meta": {
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()} {os.cpu_count()} cores",
            "model": "SmolLM2-135M-Instruct (fp32, vLLM CPU 0.32.0, eager)",
            "tree": args.tree or _tree_state(), "wall_s": time.perf_counter() - started,
            "profile": profile_dir is not None,
            "command": " ".join(["python", *sys.argv]),
        },
        "config": {"sizes": sizes, "reps": args.reps, "cheap_reps": args.cheap_reps,
                   "span_tokens": args.span_tokens, "seed": args.seed,
                   "max_model_len": args.max_model_len, "spans": counts},
        "definitions": {
            "speedup": "stock_full / minipic (TTFT p50s)",
            "bound": "stock_full / stock_uncached (TTFT p50s)",
            "speedup_over_bound": "speedup / bound = stock_uncached / minipic",
        },
        "points": points, "goals": goals(points), "rotated_pool": pool,
        "samples": {str(k): v for k, v in run.samples.items()},
    }
    if breakdowns is not None:
        report["breakdown"] = breakdowns
    return report


def _write(report: dict[str, Any], out: Path) -> list[Path]:
    from minipic.bench.ttft_bound import markdown, plot

    out.mkdir(parents=True, exist_ok=True)
    written = []
    bd = report.pop("breakdown", None)
    main_json = out / "ttft_bound.json"
    main_json.write_text(json.dumps(report, indent=1))
    written.append(main_json)
    plot(report, out / "ttft_bound.png", bd["by_size"] if bd is not None else None)
    written.append(out / "ttft_bound.png")
    if bd is not None:
        (out / "breakdown.json").write_text(json.dumps({"meta": report["meta"], **bd},
                                                       indent=1))
        md = markdown({**report, "breakdown": bd["by_size"]})
        (out / "breakdown.md").write_text(md)
        written += [out / "breakdown.json", out / "breakdown.md"]
    return written


def _replot(out: Path) -> int:
    """Redraw the figure and the markdown from a finished run (no engine)."""
    from minipic.bench.ttft_bound import markdown, plot

    report = json.loads((out / "ttft_bound.json").read_text())
    source = out / "breakdown.json"
    by_size = json.loads(source.read_text())["by_size"] if source.is_file() else None
    plot(report, out / "ttft_bound.png", by_size)
    print(f"wrote {out / 'ttft_bound.png'}")
    if by_size is not None:
        (out / "breakdown.md").write_text(markdown({**report, "breakdown": by_size}))
        print(f"wrote {out / 'breakdown.md'}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run it under `flock /tmp/minipic-cpu.lock` on a shared machine.")
    parser.add_argument("--out", type=Path, default=Path("results/ttft_bound"),
                        help="output folder (default results/ttft_bound)")
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")],
                        default=[2048, 4096, 8192],
                        help="prompt sizes in tokens, comma-separated (default 2048,4096,8192)")
    parser.add_argument("--reps", type=int, default=3,
                        help="stock prefills of the full prompt per size (default 3)")
    parser.add_argument("--cheap-reps", type=int, default=3,
                        help="document orders per rep for the cheap pair (minipic final and "
                             "stock uncached-only; default 3)")
    parser.add_argument("--span-tokens", type=int, default=128,
                        help="tokens per passage span, SSEP included (default 128)")
    parser.add_argument("--max-model-len", type=int, default=8192,
                        help="both engines' max_model_len (default 8192: SmolLM2's limit)")
    parser.add_argument("--seed", type=int, default=0, help="documents/questions seed")
    parser.add_argument("--tree", default=None,
                        help="what code was measured, for the report (default: git HEAD and "
                             "whether engine_ext/kernels have local changes)")
    parser.add_argument("--no-profile", action="store_true",
                        help="no step profile (no breakdown.json/md): timers off everywhere")
    parser.add_argument("--profile-dir", type=Path, default=None,
                        help="keep the raw step-profile events here (default: a temporary "
                             "folder, removed after the run)")
    parser.add_argument("--engine-log", default=None,
                        help="write every engine log line to this file (default: warnings)")
    parser.add_argument("--plot-only", action="store_true",
                        help="redraw OUT/ttft_bound.png and breakdown.md from OUT's JSON")
    args = parser.parse_args()
    if args.plot_only:
        return _replot(args.out)
    if max(args.sizes) > args.max_model_len:
        parser.error(f"--sizes up to {max(args.sizes)} need --max-model-len >= that")
    from minipic.engine_logs import quiet_engine_logs

    quiet_engine_logs(log_file=args.engine_log)
    profile_dir = None
    with tempfile.TemporaryDirectory(prefix="minipic-ttft-profile-") as tmp:
        if args.profile_dir is not None:  # keep the raw events
            args.profile_dir.mkdir(parents=True, exist_ok=True)
            tmp = str(args.profile_dir.resolve())
        if not args.no_profile:
            from minipic.engine_ext.profiling import step_profile

            profile_dir = Path(tmp)
            os.environ[step_profile.PROFILE_ENV] = tmp  # inherited by the engine processes
            step_profile.install(profile_dir)  # this process: the front-end's calls
        report = asyncio.run(_main(args, profile_dir))
    for path in _write(report, args.out):
        print(f"wrote {path}")
    header = (f"{'tokens':>7} {'uncached':>8} {'stock full':>11} {'minipic':>9} "
              f"{'uncached-only':>13} {'speedup':>8} {'bound':>7} {'ratio':>6} {'ideal':>7}")
    print(header)
    for p in report["points"]:
        print(f"{p['prompt_tokens']:>7.0f} {p['uncached_tokens']:>8.0f} "
              f"{p['stock_full_s_p50']:>10.2f}s {p['minipic_s_p50'] * 1e3:>7.0f}ms "
              f"{p['stock_uncached_s_p50'] * 1e3:>11.0f}ms {p['speedup']:>7.1f}x "
              f"{p['bound']:>6.1f}x {p['speedup_over_bound']:>6.2f} "
              f"{p['ideal_over_bound']:>7.2f}")
    print(json.dumps(report["goals"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
