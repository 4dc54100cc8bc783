"""The span store (``engine_ext/span_store``) measured on real vLLM (CPU), side by side in one run.

SmolLM2-135M (the default model), fp32, eager, fresh random token ids every run. What it measures:

1. **TTFT by span source.** The same spans (``--span-min``..``--span-max`` tokens each, padded to
   the block) behind a fresh ``--question-tokens`` question, at each ``--sizes`` prompt length,
   with the spans from: the engine's pool (warm), the store's RAM tier (after
   ``reset_prefix_cache()``), the store's disk tier (a second engine on the same directory with
   its RAM tier off: every load reads and verifies a file), and recomputed (an engine without a
   store, cold). TTFT = wall time of a ``max_tokens=1`` generate; median over ``--reps`` reps,
   each with fresh spans. The cold final on the store engine is timed as well: against the
   no-store engine on the *same* prompt it is the cost of saving.
2. **A corpus 4x the pool.** Two engines with a small KV budget (``kv_cache_memory_bytes``
   computed from the block bytes so that the pool holds ``--pool-blocks`` blocks; vLLM's CPU
   platform reads ``VLLM_CPU_KVCACHE_SPACE`` as whole GiB), one with a store, one without.
   The corpus (4x the pool's blocks of spans) is prefilled once, as ``minipic index`` would;
   then random questions, each over ``--k`` random documents: two batches of ``--questions``
   (one engine first, then the other) and ``--seq-questions`` sent one at a time (taking
   turns): hit rate (cached / prompt tokens) and samples/s.
3. **Restart.** The first store engine prefills a corpus and stops; the disk engine (a new
   process on the same directory) answers questions over it, one at a time; the no-store engine
   answers the same questions (documents it never saw). First-question TTFT and the median.
4. **Bytes per token.** Store entries on disk (file sizes / tokens) vs the engine's KV bytes per
   token (``orchestrator.kv_usage.kv_block_bytes``).

Every engine computes on the same cores (``--reserved-cpus``: vLLM would otherwise reserve one
more core for the EngineCore of an engine with a KV connector, i.e. with the store). Writes
``span_store.json`` and ``span_store.png`` under ``--out``. Usage (about 8 minutes on 2
cores; every engine start takes the CPU lock other sessions use)::

    flock /tmp/minipic-cpu.lock python benchmarks/span_store.py --out results/span_store
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from _provenance import git_state

T0 = time.monotonic()
# VLLM_CPU_NUM_OF_RESERVED_CPU for every engine (--reserved-cpus): vLLM reserves one more core
# for the EngineCore whenever a KV connector is configured (meant for NIXL), so without this a
# store engine and a stock one would not compute on the same cores.
RESERVED_CPUS: list[int | None] = [None]


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:7.1f}s] {msg}", flush=True)


# -- prompts ------------------------------------------------------------------------------------


class Tokens:
    """Fresh random ordinary token ids and PIC spans (SSEP + body + PAD to the block)."""

    def __init__(self, rng: random.Random, config: Any, vocab: int) -> None:
        self.rng = rng
        self.config = config
        self.vocab = vocab
        self.avoid = {config.ssep_id, config.pdep_id, config.pad_id}

    def ids(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            t = self.rng.randrange(200, self.vocab)
            if t not in self.avoid:
                out.append(t)
        return out

    def span(self, lo: int, hi: int) -> list[int]:
        """One span whose padded length is a multiple of the block in [lo, hi]."""
        bs = self.config.block_size
        length = bs * self.rng.randint(-(-lo // bs), hi // bs)
        body = self.ids(length - 1 - self.rng.randrange(bs))  # some padding, like real text
        span = [self.config.ssep_id, *body]
        return span + [self.config.pad_id] * (-len(span) % bs)

    def spans_for(self, target: int, lo: int, hi: int, question: int) -> list[list[int]]:
        """Spans filling a prompt of at most ``target`` tokens with a ``question`` behind."""
        spans: list[list[int]] = []
        room = target - question - 1
        while True:
            span = self.span(lo, hi)
            if sum(map(len, spans)) + len(span) > room:
                return spans or [span[:room]]
            spans.append(span)

    def final(self, spans: list[list[int]], question: int) -> list[int]:
        return [t for s in spans for t in s] + [self.config.pdep_id, *self.ids(question)]


# -- engines ------------------------------------------------------------------------------------


class Engine:
    """A ``vllm.LLM`` with minipic's defaults, timed generates and the store's counters."""

    def __init__(self, name: str, store: Any, max_model_len: int,
                 kv_bytes: int | None = None) -> None:
        from minipic.span_contract.engine_config import EngineSettings, patched_environ

        self.name = name
        started = time.monotonic()
        settings = EngineSettings(max_model_len=max_model_len, span_store=store, extra=(
            {} if kv_bytes is None else {"kv_cache_memory_bytes": kv_bytes})).resolved()
        env = settings.plugin_env()
        if RESERVED_CPUS[0] is not None:
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(RESERVED_CPUS[0])
        if kv_bytes is not None:
            # vLLM's CPU platform reads VLLM_CPU_KVCACHE_SPACE as whole GiB (int()) and lets it
            # override the engine's byte budget: without it, kv_cache_memory_bytes is exact.
            env.pop("VLLM_CPU_KVCACHE_SPACE")
        if kv_bytes is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = None  # unset while the engine starts
        with patched_environ(env):  # what engine_config.build_llm does, with that difference
            from vllm import LLM

            self.llm = LLM(**settings.llm_kwargs())
            self.llm.minipic_settings = settings
        self.settings = self.llm.minipic_settings
        self.vllm_config = self.llm.llm_engine.vllm_config
        self.pool_blocks = int(self.vllm_config.cache_config.num_gpu_blocks)
        self.start_s = time.monotonic() - started
        log(f"engine {name}: up in {self.start_s:.0f} s, {self.pool_blocks} KV blocks"
            f"{'' if store is None else f', store {store.dir} RAM {store.ram_mib} MiB'}")

    def generate(self, prompts: list[list[int]], max_tokens: int = 1,
                 opt_in: bool = True) -> tuple[float, list[Any]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from minipic.span_contract.span_config import SPANS_OPT_IN_KEY

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                extra_args={SPANS_OPT_IN_KEY: True} if opt_in else None)
        start = time.perf_counter()
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                 use_tqdm=False)
        return time.perf_counter() - start, outs

    def counts(self) -> dict[str, int]:
        from minipic.engine_ext.recurrent.checkpoints import call_engine
        from minipic.span_contract.engine_utilities import SPAN_STORE_STATS_UTILITY

        stats = call_engine(self.llm, SPAN_STORE_STATS_UTILITY)
        return {} if stats is None else dict(stats["counts"])

    def reset(self) -> None:
        assert self.llm.reset_prefix_cache(), "reset_prefix_cache refused"

    def close(self) -> None:
        from minipic.span_contract.engine_config import close_llm

        started = time.monotonic()
        close_llm(self.llm)
        self.close_s = time.monotonic() - started
        log(f"engine {self.name}: closed in {self.close_s:.1f} s")


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)
            if after.get(k, 0) != before.get(k, 0)}


def _entries(root: Path) -> list[Path]:
    return [p for p in root.rglob("*.kvb") if not p.name.startswith(".")] if root.exists() else []


def _wait_written(root: Path, expected: int, timeout: float = 120.0) -> float:
    """Seconds until ``expected`` entries are on disk (written off the engine's thread)."""
    start = time.monotonic()
    while len(_entries(root)) < expected:
        if time.monotonic() - start > timeout:
            log(f"  only {len(_entries(root))} of {expected} entries on disk after {timeout} s")
            break
        time.sleep(0.02)
    return time.monotonic() - start


def _timed(engine: Engine, prompt: list[int]) -> dict[str, Any]:
    before = engine.counts()
    seconds, (out,) = engine.generate([prompt])
    return {"ttft_s": seconds, "cached": int(out.num_cached_tokens), "prompt": len(prompt),
            "store": _delta(engine.counts(), before)}


# -- 1 + 3: TTFT by source, restart -------------------------------------------------------------


def ttft_and_restart(args: argparse.Namespace, tok: Tokens, work: Path) -> dict[str, Any]:
    from minipic.span_contract.span_store_config import SpanStoreConfig

    store_dir = work / "store"
    max_len = -(-(max(args.sizes) + 64) // 256) * 256
    cases = {size: [tok.spans_for(size, args.span_min, args.span_max, args.question_tokens)
                    for _ in range(args.reps)] for size in args.sizes}
    restart_docs = [[tok.span(args.span_min, args.span_max) for _ in range(args.k)]
                    for _ in range(args.restart_questions)]
    rows: dict[int, dict[str, list[dict[str, Any]]]] = {s: {} for s in args.sizes}
    q = args.question_tokens

    def add(size: int, source: str, row: dict[str, Any]) -> None:
        rows[size].setdefault(source, []).append(row)
        log(f"  {size:>5} tokens, {source:<13} {row['ttft_s'] * 1e3:8.0f} ms  cached "
            f"{row['cached']}/{row['prompt']}  {row['store'] or ''}")

    ram = Engine("store+RAM", SpanStoreConfig(dir=str(store_dir), ram_mib=args.ram_mib), max_len)
    none = Engine("no store", None, max_len)
    info: dict[str, Any] = {"engine_start_s": {"store+RAM": ram.start_s, "no store": none.start_s},
                            "pool_blocks": ram.pool_blocks}
    written = 0
    try:
        for engine in (ram, none):  # first-step costs, on prompts nothing else uses
            engine.generate([tok.final([tok.span(128, 128)], q)])
        ram.reset()
        written = len(_entries(store_dir))
        write_s = []
        for size in args.sizes:
            for rep, spans in enumerate(cases[size]):
                cold = tok.final(spans, q)
                order = (none, ram) if rep % 2 == 0 else (ram, none)
                for engine in order:  # the same cold prompt on both: the cost of saving
                    add(size, "recomputed" if engine is none else "cold, saving", _timed(
                        engine, cold))
                blocks = sum(map(len, spans)) // tok.config.block_size
                written += blocks
                wait = _wait_written(store_dir, written)
                write_s.append({"blocks": blocks, "seconds_after_final": wait})
                add(size, "pool", _timed(ram, tok.final(spans, q)))
                ram.reset()
                add(size, "store RAM", _timed(ram, tok.final(spans, q)))
        info["disk_write_after_final"] = write_s
        # 3. engine 1 prefills the restart corpus (as `minipic index` would) and stops
        docs = [d for question in restart_docs for d in question]
        seconds, _ = ram.generate(docs)
        written += sum(map(len, docs)) // tok.config.block_size
        info["restart_corpus"] = {"docs": len(docs), "tokens": sum(map(len, docs)),
                                  "prefill_s": seconds}
        log(f"  restart corpus: {len(docs)} docs prefilled in {seconds:.1f} s")
        info["counts_store+RAM"] = ram.counts()
    finally:
        ram.close()  # flushes the store's writes
    info["engine_close_s"] = {"store+RAM": ram.close_s}
    info["entries_after_close"] = len(_entries(store_dir))
    info["entries_expected"] = written
    disk = Engine("store disk", SpanStoreConfig(dir=str(store_dir), ram_mib=0), max_len)
    info["engine_start_s"]["store disk"] = disk.start_s
    restart: dict[str, list[dict[str, Any]]] = {"store": [], "none": []}
    try:
        disk.generate([tok.final([tok.span(128, 128)], q)])  # same warm-up as the others had
        for i, question_docs in enumerate(restart_docs):
            prompt = tok.final(question_docs, q)
            for name, engine in (("store", disk), ("none", none)):
                row = _timed(engine, prompt)
                restart[name].append(row)
                log(f"  restart question {i}, {name:<5} {row['ttft_s'] * 1e3:8.0f} ms  cached "
                    f"{row['cached']}/{row['prompt']}")
        for size in args.sizes:
            for spans in cases[size]:
                add(size, "store disk", _timed(disk, tok.final(spans, q)))
        info["counts_store disk"] = disk.counts()
    finally:
        disk.close()
        none.close()
    info["engine_close_s"].update({"store disk": disk.close_s, "no store": none.close_s})
    entries = _entries(store_dir)
    sizes = [p.stat().st_size for p in entries]
    return {"rows": {str(s): r for s, r in rows.items()}, "restart": restart, "info": info,
            "entries": {"count": len(entries), "bytes": sum(sizes),
                        "first_meta": _first_meta(entries)},
            "kv": _kv_bytes(none)}


def _first_meta(entries: list[Path]) -> dict[str, Any] | None:
    """The metadata JSON of one entry (header layout in ``engine_ext/span_store/tiers/``)."""
    if not entries:
        return None
    data = entries[0].read_bytes()
    f_len = int.from_bytes(data[10:12], "little")
    m_len = int.from_bytes(data[12:16], "little")
    p_len = int.from_bytes(data[16:24], "little")
    meta = json.loads(data[56 + f_len:56 + f_len + m_len])
    return {"meta": meta, "file_bytes": len(data), "payload_bytes": p_len,
            "header_bytes": len(data) - p_len}


def _kv_bytes(engine: Engine) -> dict[str, Any]:
    from minipic.orchestrator.kv_usage import kv_block_bytes

    block = kv_block_bytes(engine.vllm_config)
    return {"block_bytes": block, "block_size": engine.settings.block_size,
            "bytes_per_token": block / engine.settings.block_size}


# -- 2: a corpus 4x the pool --------------------------------------------------------------------


def corpus(args: argparse.Namespace, tok: Tokens, work: Path, block_bytes: int
           ) -> dict[str, Any]:
    from minipic.engine_ext.attention.key_shadow.pool import DEFAULT_SHARE, SHARE_ENV
    from minipic.span_contract.span_store_config import SpanStoreConfig

    share = float(os.environ.get(SHARE_ENV, DEFAULT_SHARE))
    kv_bytes = int((args.pool_blocks + 0.5) * block_bytes / (1 - share))
    kv_gib = kv_bytes / 2**30
    max_len = args.corpus_max_len
    engines = {"store": Engine("corpus store", SpanStoreConfig(
                   dir=str(work / "corpus-store"), ram_mib=args.corpus_ram_mib), max_len,
                   kv_bytes),
               "none": Engine("corpus none", None, max_len, kv_bytes)}
    out: dict[str, Any] = {"kv_gib": kv_gib, "pool_blocks": {}, "ram_mib": args.corpus_ram_mib}
    try:
        pool = min(e.pool_blocks for e in engines.values())
        bs = tok.config.block_size
        docs: list[list[int]] = []
        while sum(len(d) // bs for d in docs) < args.corpus_factor * pool:
            docs.append(tok.span(args.span_min, args.span_max))
        def questions(n: int) -> list[list[int]]:
            return [tok.final([docs[i] for i in tok.rng.sample(range(len(docs)), args.k)],
                              args.question_tokens) for _ in range(n)]

        sets = {"batch": [questions(args.questions), questions(args.questions)],
                "sequential": [questions(args.seq_questions)]}
        out.update({"docs": len(docs), "corpus_blocks": sum(len(d) // bs for d in docs),
                    "corpus_tokens": sum(map(len, docs)), "k": args.k,
                    "answer_tokens": args.answer_tokens,
                    "questions": {m: sum(map(len, qs)) for m, qs in sets.items()}})
        log(f"corpus: {len(docs)} docs = {out['corpus_blocks']} blocks = "
            f"{out['corpus_blocks'] / pool:.1f}x the pool ({pool} blocks, {kv_gib:.3f} GiB)")
        names = list(engines)
        result = {name: {"corpus_prefill_s": 0.0, "batch": [], "sequential": []}
                  for name in names}
        for name, engine in engines.items():
            out["pool_blocks"][name] = engine.pool_blocks
            engine.generate([tok.final([tok.span(128, 128)], args.question_tokens)])
            engine.reset()
        # Both engines are up at once and take turns (alternating which goes first), so load
        # from other processes on the machine falls on both alike.
        for turn, start in enumerate(range(0, len(docs), 32)):  # the corpus, prefilled once
            for name in names[::(-1) ** turn]:
                seconds, _ = engines[name].generate(docs[start:start + 32])
                result[name]["corpus_prefill_s"] += seconds
        log(f"  corpus prefilled: {result['store']['corpus_prefill_s']:.1f} s with the store "
            f"(saving it), {result['none']['corpus_prefill_s']:.1f} s without")

        def ask(name: str, mode: str, prompts: list[list[int]]) -> None:
            engine = engines[name]
            before = engine.counts()
            seconds, outs = engine.generate(prompts, max_tokens=args.answer_tokens)
            row = {"seconds": seconds, "prompt_tokens": sum(map(len, prompts)),
                   "cached_tokens": sum(int(o.num_cached_tokens) for o in outs),
                   "store": _delta(engine.counts(), before),
                   "answers": [list(o.outputs[0].token_ids) for o in outs]}
            result[name][mode].append(row)
            if mode == "batch":
                log(f"  batch of {len(prompts)}, {name:<5}: {seconds:5.1f} s, hit rate "
                    f"{row['cached_tokens'] / row['prompt_tokens']:.1%}  {row['store'] or ''}")

        for turn, batch in enumerate(sets["batch"]):  # store first, then none first
            for name in names[::(-1) ** turn]:
                ask(name, "batch", batch)
        for turn, prompt in enumerate(sets["sequential"][0]):
            for name in names[::(-1) ** turn]:
                ask(name, "sequential", [prompt])
        span_tokens = {m: sum(len(q) - args.question_tokens - 1 for qs in sets[m] for q in qs)
                       for m in sets}
        prompt_tokens = {m: sum(len(q) for qs in sets[m] for q in qs) for m in sets}
        out["span_share_of_prompt"] = {m: span_tokens[m] / prompt_tokens[m] for m in sets}
        for name in names:
            r = result[name]
            out[name] = {"corpus_prefill_s": r["corpus_prefill_s"],
                         "corpus_tokens_per_s": out["corpus_tokens"] / r["corpus_prefill_s"]}
            for mode in sets:
                rows = r[mode]
                seconds = sum(x["seconds"] for x in rows)
                store: dict[str, int] = {}
                for x in rows:
                    for key, value in x["store"].items():
                        store[key] = store.get(key, 0) + value
                out[name][mode] = {
                    "seconds": seconds, "samples_per_s": out["questions"][mode] / seconds,
                    "hit_rate": sum(x["cached_tokens"] for x in rows) / prompt_tokens[mode],
                    "store": store, "per_call_s": [x["seconds"] for x in rows]}
                log(f"  {mode:<10} {name:<5}: {out[name][mode]['samples_per_s']:.2f} "
                    f"samples/s, hit rate {out[name][mode]['hit_rate']:.1%}")
        out["answers_equal"] = all(
            [x["answers"] for x in result["store"][m]] == [x["answers"] for x in
                                                           result["none"][m]] for m in sets)
    finally:
        for engine in engines.values():
            engine.close()
    return out


# -- summary, plot ------------------------------------------------------------------------------


SOURCES = ("pool", "store RAM", "store disk", "recomputed", "cold, saving")


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    ttft = report["ttft"]
    out: dict[str, Any] = {"ttft_ms": {}, "speedup_vs_recomputed": {}}
    for size, rows in ttft["rows"].items():
        med = {src: statistics.median(r["ttft_s"] for r in rows[src]) * 1e3
               for src in SOURCES if src in rows}
        out["ttft_ms"][size] = med
        out["speedup_vs_recomputed"][size] = {src: med["recomputed"] / v
                                              for src, v in med.items()}
        out.setdefault("prompt_tokens", {})[size] = statistics.median(
            r["prompt"] for r in rows["recomputed"])
        out.setdefault("save_overhead", {})[size] = med["cold, saving"] / med["recomputed"] - 1
    restart = ttft["restart"]
    out["restart_ms"] = {name: {"first": rows[0]["ttft_s"] * 1e3,
                                "median": statistics.median(r["ttft_s"] for r in rows) * 1e3,
                                "cached_first": rows[0]["cached"],
                                "prompt_first": rows[0]["prompt"]}
                         for name, rows in restart.items()}
    entries, kv = ttft["entries"], ttft["kv"]
    tokens = entries["count"] * kv["block_size"]
    out["bytes_per_token"] = {"store_disk": entries["bytes"] / tokens if tokens else None,
                              "engine_kv": kv["bytes_per_token"]}
    if entries["first_meta"]:
        meta = entries["first_meta"]["meta"]
        out["bytes_per_token"]["entry_payload"] = (meta["page_bytes"] * meta["layers"]
                                                   / kv["block_size"])
        out["bytes_per_token"]["entry_header_bytes"] = entries["first_meta"]["header_bytes"]
    if "corpus" in report:
        c = report["corpus"]
        out["corpus"] = {mode: {name: {"hit_rate": c[name][mode]["hit_rate"],
                                       "samples_per_s": c[name][mode]["samples_per_s"]}
                                for name in ("store", "none")}
                         for mode in ("batch", "sequential")}
        for mode in ("batch", "sequential"):
            out["corpus"][mode]["samples_per_s_ratio"] = (
                c["store"][mode]["samples_per_s"] / c["none"][mode]["samples_per_s"])
        out["corpus"]["prefill_s"] = {n: c[n]["corpus_prefill_s"] for n in ("store", "none")}
        out["corpus"]["prefill_overhead"] = (c["store"]["corpus_prefill_s"]
                                             / c["none"]["corpus_prefill_s"] - 1)
        out["corpus"]["span_share_of_prompt"] = c["span_share_of_prompt"]
    return out


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = report["summary"]
    panels = 3 if "corpus" in s else 2
    fig, axes = plt.subplots(1, panels, figsize=(4.6 * panels, 3.8))
    ax = axes[0]
    colors = {"pool": "#2a7", "store RAM": "#49c", "store disk": "#36a", "recomputed": "#999",
              "cold, saving": "#c84"}
    sizes = list(s["ttft_ms"])
    width = 0.8 / len(SOURCES)
    for i, src in enumerate(SOURCES):
        values = [s["ttft_ms"][size].get(src, 0) for size in sizes]
        bars = ax.bar([j + i * width for j in range(len(sizes))], values, width, label=src,
                      color=colors[src])
        for bar, size in zip(bars, sizes, strict=True):
            ratio = s["speedup_vs_recomputed"][size].get(src)
            label = f"{ratio:.1f}x" if ratio else ""
            if src == "cold, saving":
                label = f"{s['save_overhead'][size]:+.0%}"
            if label and src != "recomputed":
                ax.annotate(label, (bar.get_x() + bar.get_width() / 2,
                                              bar.get_height()), ha="center", va="bottom",
                            fontsize=6)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))],
                  [f"{s['prompt_tokens'][size]:.0f}-token prompt" for size in sizes])
    ax.set_yscale("log")
    ax.set_ylabel("TTFT, median (ms)")
    ax.set_title("TTFT by where the spans come from (x: vs recomputed)", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[1]
    r = s["restart_ms"]
    ax.bar(["store (new engine,\nsame directory)", "no store"],
           [r["store"]["first"], r["none"]["first"]], color=["#36a", "#999"])
    ax.set_ylabel("first-question TTFT (ms)")
    ax.set_title(f"after a restart: {r['none']['first'] / r['store']['first']:.1f}x")
    if panels == 3:
        ax = axes[2]
        c = s["corpus"]
        modes = ["batch", "sequential"]
        for i, (name, color) in enumerate((("store", "#36a"), ("none", "#999"))):
            bars = ax.bar([j + i * 0.4 for j in range(2)],
                          [c[m][name]["hit_rate"] * 100 for m in modes], 0.4,
                          label="store" if name == "store" else "no store", color=color)
            for bar, m in zip(bars, modes, strict=True):
                ax.annotate(f"{c[m][name]['samples_per_s']:.2f}/s",
                            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=7)
        ax.set_xticks([0.2, 1.2], [f"{m} ({report['corpus']['questions'][m]} questions)"
                                   for m in modes], fontsize=8)
        ax.set_ylabel("hit rate (cached / prompt tokens, %)")
        ax.set_ylim(0, 115)
        ax.legend(fontsize=7, loc="upper left")
        factor = report["corpus"]["corpus_blocks"] / report["corpus"]["pool_blocks"]["store"]
        ax.set_title(f"corpus {factor:.0f}x the pool, {report['corpus']['k']} docs/question "
                     "(labels: samples/s)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _commit() -> str | None:
    state = git_state("engine_ext", "span_contract")
    if state is None:
        return None
    head, dirty = state
    return head + ("+dirty engine code" if dirty else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/span_store"))
    parser.add_argument("--sizes", type=lambda v: [int(x) for x in v.split(",")],
                        default=[2048, 8000], help="prompt lengths (tokens), comma-separated")
    parser.add_argument("--reps", type=int, default=5, help="fresh prompts per size and source")
    parser.add_argument("--span-min", type=int, default=128, help="span tokens, padded")
    parser.add_argument("--span-max", type=int, default=256)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--ram-mib", type=int, default=1024,
                        help="RAM tier of the store engines (must hold one prompt's spans)")
    parser.add_argument("--k", type=int, default=4, help="documents per question")
    parser.add_argument("--restart-questions", type=int, default=3)
    parser.add_argument("--questions", type=int, default=24,
                        help="corpus questions per batch (two batches)")
    parser.add_argument("--seq-questions", type=int, default=16,
                        help="corpus questions sent one at a time")
    parser.add_argument("--answer-tokens", type=int, default=8, help="corpus answers")
    parser.add_argument("--pool-blocks", type=int, default=96,
                        help="KV blocks of the corpus engines' pool")
    parser.add_argument("--corpus-factor", type=float, default=4.0,
                        help="corpus span blocks / pool blocks")
    parser.add_argument("--corpus-max-len", type=int, default=2048)
    parser.add_argument("--corpus-ram-mib", type=int, default=256,
                        help="RAM tier of the corpus store engine (256: SpanStoreConfig's "
                             "default; the rest of the corpus is read from disk)")
    parser.add_argument("--parts", type=lambda v: v.split(","), default=["ttft", "corpus"],
                        help="ttft (sources, restart, bytes) and/or corpus; the summary and "
                             "plot need both")
    parser.add_argument("--reserved-cpus", type=int, default=1,
                        help="VLLM_CPU_NUM_OF_RESERVED_CPU of every engine (-1: vLLM's choice, "
                             "which reserves one more core when a KV connector, i.e. the "
                             "store, is configured)")
    parser.add_argument("--work", type=Path, default=None,
                        help="where the stores live (default: a temp dir, removed after)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--plot-only", action="store_true", help="redraw from the JSON")
    args = parser.parse_args()
    json_path, png_path = args.out / "span_store.json", args.out / "span_store.png"
    if args.plot_only:
        plot(json.loads(json_path.read_text()), png_path)
        return
    from transformers import AutoConfig

    from minipic.span_contract.engine_config import EngineSettings

    RESERVED_CPUS[0] = None if args.reserved_cpus < 0 else args.reserved_cpus

    settings = EngineSettings().resolved()
    vocab = AutoConfig.from_pretrained(settings.model).vocab_size
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    tok = Tokens(random.Random(seed), settings.span_config, vocab)
    work = args.work or Path(tempfile.mkdtemp(prefix="minipic-span-store-bench-"))
    report: dict[str, Any] = {
        "seed": seed, "model": Path(settings.model).name, "dtype": settings.dtype,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "commit": _commit(),
        "date": datetime.now(UTC).isoformat(timespec="seconds")}
    log(f"seed {seed}, model {report['model']}, work dir {work}")
    hf = AutoConfig.from_pretrained(settings.model)
    head = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    block_bytes = (hf.num_hidden_layers * settings.block_size * hf.num_key_value_heads * 2
                   * head * 4)  # fp32; checked against the engine's own figure below
    try:
        if "ttft" in args.parts:
            report["ttft"] = ttft_and_restart(args, tok, work)
            assert report["ttft"]["kv"]["block_bytes"] == block_bytes, report["ttft"]["kv"]
        if "corpus" in args.parts:
            report["corpus"] = corpus(args, tok, work, block_bytes)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    report["wall_s"] = time.monotonic() - T0
    args.out.mkdir(parents=True, exist_ok=True)
    if "ttft" in report:
        report["summary"] = summarize(report)
    json_path.write_text(json.dumps(report, indent=1))
    if "ttft" in report:
        plot(report, png_path)
    print(json.dumps(report.get("summary", report.get("corpus")), indent=1))
    log(f"wrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()
