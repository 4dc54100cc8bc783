"""The paper-style evaluation, on real vLLM (CPU) and the real default model.

Every figure is measured side by side in one run against a baseline in the same run: two
engines (stock vLLM with prefix caching = plugin off, and minipic) are up at once and each
phase runs the same workload on both. Phases:

* ``throughput`` — 2Wiki-shaped RAG batch, cold cache: samples/s for vanilla (prefix mode on
  stock vLLM), minipic barrier, minipic ISPS; plus the PIC-off overhead (prefix mode on the
  minipic engine vs stock), cache hit rates, KV memory in use (peak and mean blocks, from the
  engine's own step statistics: ``orchestrator.kv_usage``) and the time after the batch's last
  span prefill (barrier's prefill-free tail: the most ISPS can overlap).
* ``ttft`` — long contexts (~2k tokens) whose spans are warm vs vanilla, p50/p95, and sweeps of
  TTFT vs number of spans and vs span length.
* ``agent`` — tool descriptions and memories reused across turns in changing order.
* ``accuracy`` — gold-answer substring accuracy for full attention (prefix), block_attention and
  boundary_recompute, beside each mode's TTFT (the default model is not block-attention
  fine-tuned: this is where that shows).
"""

from __future__ import annotations

import asyncio
import json
import math
import platform
import random
import statistics
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from minipic.bench.workloads import RagItem, agent_workload, is_correct, rag_workload
from minipic.orchestrator.corpus import load_qa_items

PHASES = ("throughput", "ttft", "agent", "accuracy")
# Tokens generated per answer in the throughput and accuracy phases (greedy, stops at EOS): a
# "sample" is a question answered the way the accuracy phase scores it.
ANSWER_TOKENS = 24


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion: says how far apart modes must be to differ."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def _questions(items: Sequence[RagItem], mode: str) -> list[dict[str, Any]]:
    return [{"question": it.question, "documents": it.documents, "system": it.system,
             "mode": mode} for it in items]


def _answers(results: Sequence[Any]) -> tuple[list[Any], int]:
    from minipic.orchestrator.errors import MinipicError

    ok = [r for r in results if not isinstance(r, MinipicError)]
    return ok, len(results) - len(ok)


def _histogram_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """Prompts per prefill-step count between two ``prefill_step_stats`` snapshots."""
    old = before.get("histogram", {})
    return {k: v - old.get(k, 0) for k, v in after.get("histogram", {}).items()
            if v - old.get(k, 0) > 0}


class Bench:
    """Holds the two engines and runs the phases; results accumulate in ``self.report``."""

    def __init__(self, scale: float, seed: int, progress: Callable[[str], None]):
        self.scale = scale
        self.seed = seed
        self.progress = progress
        self.report: dict[str, Any] = {}
        self.stock = None
        self.pic = None

    def _n(self, base: int, minimum: int = 2) -> int:
        return max(minimum, round(base * self.scale))

    def planned_steps(self, phases: Sequence[str]) -> int:
        """How many ``progress`` calls a run of ``phases`` makes (for a progress bar)."""
        per_phase = {"throughput": 4 * 2 + 2, "ttft": 1 + 4 + 3, "agent": self._n(8, 4),
                     "accuracy": 3}
        return 2 + sum(per_phase[p] for p in phases)  # 2: the engine starts

    async def start(self, max_model_len: int) -> None:
        from minipic.orchestrator import Orchestrator

        self.progress("starting stock vLLM (plugin off)")
        self.stock = Orchestrator.embedded(pic=False, max_model_len=max_model_len)
        self.progress("starting minipic vLLM (plugin on)")
        self.pic = Orchestrator.embedded(pic=True, max_model_len=max_model_len)
        tok = self.pic.builder
        self.count = tok.count_tokens

    async def close(self) -> None:
        for orc in (self.stock, self.pic):
            if orc is not None:
                await orc.aclose()

    async def _batch(self, orc: Any, items: Sequence[RagItem], mode: str, policy: str,
                     max_tokens: int, *, reset: bool = True) -> dict[str, Any]:
        if reset:
            await orc.reset_cache()
        monitor = orc.backend.kv_usage
        monitor.reset()
        started = time.perf_counter()
        with orc.record_events() as events:
            results = await orc.answer_many(_questions(items, mode), policy=policy,
                                            max_tokens=max_tokens)
        elapsed = time.perf_counter() - started
        kv = monitor.snapshot()
        prefill_ends = [e.t for e in events if e.kind == "prefill_done"]
        ok, failed = _answers(results)
        prompt = sum(a.prompt_tokens for a in ok)
        return {
            "kv_peak_mib": kv.peak_mib, "kv_mean_mib": kv.mean_mib,
            "kv_peak_blocks": kv.peak_blocks, "kv_block_bytes": kv.block_bytes,
            "samples": len(items), "failed": failed, "elapsed_s": elapsed,
            "samples_per_s": len(items) / elapsed,
            "ttft_p50_s": percentile([a.ttft_s for a in ok], 0.5),
            "ttft_p95_s": percentile([a.ttft_s for a in ok], 0.95),
            "prompt_tokens": prompt, "cached_tokens": sum(a.cached_tokens for a in ok),
            "hit_rate": sum(a.cached_tokens for a in ok) / max(1, prompt),
            "prefills_sent": sum(a.prefills_sent for a in ok),
            # after the last span prefill only finals run: under barrier, this tail (finals'
            # prefill + decode with no prefill to overlap) bounds what ISPS can hide
            "after_last_prefill_s": started + elapsed - max(prefill_ends)
            if prefill_ends else None,
        }

    async def throughput(self) -> None:
        items = rag_workload(self._n(24, 4), self.count, seed=self.seed)
        runs: dict[str, list[dict[str, Any]]] = {}
        systems = {
            "vanilla": (self.stock, "prefix", "isps"),
            "minipic_pic_off": (self.pic, "prefix", "isps"),
            "minipic_barrier": (self.pic, "block_attention", "barrier"),
            "minipic_isps": (self.pic, "block_attention", "isps"),
        }
        for rep in range(2):  # alternate systems, twice: the machine is noisy
            for name, (orc, mode, policy) in systems.items():
                self.progress(f"throughput {name} (round {rep + 1}/2)")
                runs.setdefault(name, []).append(
                    await self._batch(orc, items, mode, policy, ANSWER_TOKENS))
        summary = {name: {**r[-1], "samples_per_s": statistics.median(
            x["samples_per_s"] for x in r), "rounds": [x["samples_per_s"] for x in r]}
            for name, r in runs.items()}
        v = summary["vanilla"]["samples_per_s"]
        self.report["throughput"] = {
            "questions": len(items), "answer_tokens": ANSWER_TOKENS, "systems": summary,
            "kv_cache": self._kv_cache(),
            "isps_vs_vanilla": summary["minipic_isps"]["samples_per_s"] / v,
            "isps_vs_barrier": summary["minipic_isps"]["samples_per_s"]
            / summary["minipic_barrier"]["samples_per_s"],
            "pic_off_overhead": v / summary["minipic_pic_off"]["samples_per_s"] - 1,
            "steady_state": await self._steady_state(len(items)),
        }

    async def _steady_state(self, n: int) -> dict[str, Any]:
        """Throughput once the corpus is warm: ``n`` questions answered (untimed) over a passage
        pool, then ``n`` other questions over the same pool, timed. Popular passages recur and
        are warm; the new questions' own relevant passages mostly are not. One round per
        system (the cold-cache batches above are the two-round comparison)."""
        both = rag_workload(2 * n, self.count, seed=self.seed + 2)
        warmup, timed = both[:n], both[n:]
        out: dict[str, Any] = {"questions": n}
        for name, orc, mode in (("vanilla", self.stock, "prefix"),
                                ("minipic_isps", self.pic, "block_attention")):
            self.progress(f"throughput, warm corpus: {name}")
            await orc.reset_cache()
            await orc.answer_many(_questions(warmup, mode), max_tokens=ANSWER_TOKENS)
            out[name] = await self._batch(orc, timed, mode, "isps", ANSWER_TOKENS, reset=False)
        out["isps_vs_vanilla"] = (out["minipic_isps"]["samples_per_s"]
                                  / out["vanilla"]["samples_per_s"])
        return out

    def _kv_cache(self) -> dict[str, Any]:
        """Each engine's KV pool at the same byte budget (blocks as vLLM sized them)."""
        out = {}
        for name, orc in (("stock", self.stock), ("minipic", self.pic)):
            kv = orc.backend.kv_usage.snapshot()
            out[name] = {"blocks_total": kv.blocks_total, "block_bytes": kv.block_bytes,
                         "total_mib": kv.total_mib,
                         "bytes_per_token": kv.block_bytes // orc.builder.span_config.block_size}
        return out

    def _long_items(self, n_items: int, n_spans: int, span_tokens: int) -> list[RagItem]:
        """Questions over ``n_spans`` passages of about ``span_tokens`` each (shared pool)."""
        from minipic.orchestrator.corpus import load_passages

        rng = random.Random(f"{self.seed}:{n_spans}:{span_tokens}")
        passages = [p for p in load_passages() if self.count(p.as_document) >= span_tokens]
        pool = rng.sample(passages, n_spans)
        docs = []
        for p in pool:
            ids = self.pic.builder.encode(p.as_document)[:span_tokens - 2]
            docs.append(self.pic.builder.decode(ids))
        base = rag_workload(n_items, self.count, seed=self.seed)
        out = []
        for it in base:
            order = docs[:]
            rng.shuffle(order)
            out.append(it.model_copy(update={"documents": order}))
        return out

    async def _ttft(self, items: Sequence[RagItem]) -> dict[str, Any]:
        """Sequential requests (clean TTFT): minipic with warm spans vs vanilla."""
        await self.pic.reset_cache()
        await self.stock.reset_cache()
        await self.pic.warm(items[0].documents, items[0].system)
        pic_t, van_t, cached, prompt = [], [], 0, 0
        for it in items:
            a = await self.pic.answer(it.question, it.documents, it.system,
                                      mode="block_attention", max_tokens=1)
            pic_t.append(a.ttft_s)
            cached += a.cached_tokens
            prompt += a.prompt_tokens
            b = await self.stock.answer(it.question, it.documents, it.system, mode="prefix",
                                        max_tokens=1)
            van_t.append(b.ttft_s)
        return {
            "prompt_tokens_mean": prompt / len(items),
            "hit_rate": cached / max(1, prompt),
            "minipic_p50_s": percentile(pic_t, 0.5), "minipic_p95_s": percentile(pic_t, 0.95),
            "vanilla_p50_s": percentile(van_t, 0.5), "vanilla_p95_s": percentile(van_t, 0.95),
            "speedup_p50": percentile(van_t, 0.5) / percentile(pic_t, 0.5),
        }

    async def ttft(self) -> None:
        n = self._n(5, 3)
        self.progress("ttft at ~2k-token contexts")
        headline = await self._ttft(self._long_items(n, 14, 144))
        by_spans, by_len = [], []
        for spans in (2, 4, 8, 16):
            self.progress(f"ttft sweep: {spans} spans")
            by_spans.append({"spans": spans, **await self._ttft(self._long_items(3, spans, 128))})
        for length in (64, 128, 256):
            self.progress(f"ttft sweep: spans of {length} tokens")
            by_len.append({"span_tokens": length,
                           **await self._ttft(self._long_items(3, 8, length))})
        self.report["ttft"] = {"headline": headline, "vs_spans": by_spans, "vs_span_len": by_len}

    async def agent(self) -> None:
        turns = agent_workload(self._n(8, 4), seed=self.seed)
        rows = []
        await self.pic.reset_cache()
        await self.stock.reset_cache()
        for i, it in enumerate(turns):
            self.progress(f"agent turn {i + 1}/{len(turns)}")
            a = await self.pic.answer(it.question, it.documents, it.system, max_tokens=8)
            b = await self.stock.answer(it.question, it.documents, it.system, mode="prefix",
                                        max_tokens=8)
            rows.append({"turn": i, "prompt_tokens": a.prompt_tokens,
                         "minipic_cached": a.cached_tokens, "vanilla_cached": b.cached_tokens,
                         "minipic_ttft_s": a.ttft_s, "vanilla_ttft_s": b.ttft_s})
        self.report["agent"] = {"turns": rows}

    async def accuracy(self) -> None:
        # every offline QA item at scale 1 (69): fewer cannot separate modes a few points apart
        items = rag_workload(self._n(len(load_qa_items()), 6), self.count, seed=self.seed + 1,
                             passages_per_question=4, relevant=3, pool_factor=1.0)
        modes = {"full_attention": (self.stock, "prefix"),
                 "block_attention": (self.pic, "block_attention"),
                 "boundary_recompute": (self.pic, "boundary_recompute")}
        out = {}
        for name, (orc, mode) in modes.items():
            self.progress(f"accuracy: {name}")
            await orc.reset_cache()
            steps_before = await orc.backend.prefill_step_stats()
            results = await orc.answer_many(_questions(items, mode),
                                            max_tokens=ANSWER_TOKENS)
            steps = _histogram_delta(steps_before, await orc.backend.prefill_step_stats())
            ok, failed = _answers(results)
            correct = sum(is_correct(a.text, it.answer)
                          for a, it in zip(results, items, strict=True) if a in ok)
            out[name] = {"accuracy": correct / len(items), "correct": correct,
                         "ci95": wilson_interval(correct, len(items)),
                         "failed": failed, "n": len(items),
                         "ttft_p50_s": percentile([a.ttft_s for a in ok], 0.5),
                         "hit_rate": sum(a.cached_tokens for a in ok)
                         / max(1, sum(a.prompt_tokens for a in ok)),
                         # engine steps each opted-in prompt (finals and span prefills) took
                         # to prefill, counted by the scheduler; empty for stock vLLM
                         "prefill_steps": steps}
        self.report["accuracy"] = out


async def run_bench(out_dir: Path, phases: Sequence[str], scale: float, seed: int,
                    progress: Callable[[str], None]) -> dict[str, Any]:
    bench = Bench(scale, seed, progress)
    started = time.perf_counter()
    try:
        await bench.start(max_model_len=4096)
        for phase in phases:
            await getattr(bench, phase)()
    finally:
        await bench.close()
    bench.report["meta"] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''} "
                   f"{__import__('os').cpu_count()} cores".strip(),
        "model": "SmolLM2-135M-Instruct (fp32, vLLM CPU 0.32.0, eager)",
        "scale": scale, "seed": seed, "wall_s": time.perf_counter() - started,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(bench.report, indent=2))
    return bench.report


def run_sync(out_dir: Path, phases: Sequence[str], scale: float, seed: int,
             progress: Callable[[str], None]) -> dict[str, Any]:
    return asyncio.run(run_bench(out_dir, phases, scale, seed, progress))
