"""Does loading spans from the store stall the streams already running? Measured side by side.

    .venv/bin/python benchmarks/store_read_stall.py --out results/span_store/read_stall

SmolLM2-135M (fp32, eager), fresh random token ids. One stream decodes (``--decode-tokens``
tokens); once it is past its first ``--warmup`` tokens, a prompt of ``--prompt-tokens`` span
tokens plus a short question arrives. Three engines, one after the other:

* **no store**: the prompt's spans are computed (chunked prefill shares steps with the stream);
* **store, reads on the step** (``read_threads=0``): every span block is
  read from disk, MAC-checked and copied on the engine's step thread;
* **store, reads ahead** (``read_threads=4``, the default): reads run on threads, each step
  copies in at most ``fill_mib_per_step`` of finished reads.

With the store, the spans were prefilled and saved first, then the pool emptied and the entry
files dropped from the page cache (``posix_fadvise(DONTNEED)``), so every load reads the disk.
Reported per engine, median over ``--reps`` reps with fresh spans: the stream's inter-token gaps
while the prompt is being loaded or computed (p50, p99, max) and the prompt's TTFT. Writes
``OUT.json`` and ``OUT.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CONFIGS = {"no store": None, "store, reads on the step": 0, "store, reads ahead": 4}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _spans(rng: random.Random, span_config: Any, total: int, span_tokens: int) -> list[list[int]]:
    avoid = {span_config.ssep_id, span_config.pdep_id, span_config.pad_id}
    spans = []
    for _ in range(total // span_tokens):
        body = []
        while len(body) < span_tokens - 1:
            token = rng.randrange(200, 40000)
            if token not in avoid:
                body.append(token)
        spans.append([span_config.ssep_id, *body])
    return spans


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(200, 40000) for _ in range(n)]


def _drop_page_cache(root: Path) -> int:
    dropped = 0
    for path in root.rglob("*.kvb"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            dropped += 1
        finally:
            os.close(fd)
    return dropped


async def _stream_while_loading(engine: Any, prompt: list[int], rng: random.Random,
                                args: argparse.Namespace, rep: int
                                ) -> tuple[list[float], dict[str, float]]:
    """Token times of a decoding stream, and when ``prompt`` was sent and answered (sent once
    the stream is past its first ``args.warmup`` tokens)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from minipic.span_contract.span_config import SPANS_OPT_IN_KEY

    opt_in = {SPANS_OPT_IN_KEY: True}
    stamps: list[float] = []
    window: dict[str, float] = {}

    async def decode() -> None:
        params = SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True,
                                temperature=0.0, extra_args=opt_in)
        async for _ in engine.generate(TokensPrompt(prompt_token_ids=_ids(rng, 64)), params,
                                       f"decode-{rep}"):
            stamps.append(time.perf_counter())

    async def load() -> None:
        while len(stamps) < args.warmup:
            await asyncio.sleep(0.005)
        window["sent"] = time.perf_counter()
        params = SamplingParams(max_tokens=1, extra_args=opt_in)
        async for out in engine.generate(TokensPrompt(prompt_token_ids=prompt), params,
                                         f"load-{rep}"):
            window["first"] = time.perf_counter()
            window["cached"] = float(out.num_cached_tokens or 0)

    await asyncio.gather(decode(), load())
    return stamps, window


async def _one_config(name: str, threads: int | None, args: argparse.Namespace,
                      work: Path) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from minipic.orchestrator.embedded_backend import EmbeddedBackend
    from minipic.span_contract.engine_config import EngineSettings
    from minipic.span_contract.span_config import SPANS_OPT_IN_KEY
    from minipic.span_contract.span_store_config import SpanStoreConfig

    store_dir = work / name.replace(" ", "_").replace(",", "")
    store = None if threads is None else SpanStoreConfig(dir=str(store_dir), ram_mib=0,
                                                         read_threads=threads)
    settings = EngineSettings(max_model_len=8192, span_store=store,
                              extra={"max_num_batched_tokens": args.chunk}).resolved()
    started = time.monotonic()
    backend = EmbeddedBackend.start(settings)
    engine = backend.engine
    log(f"{name}: engine up in {time.monotonic() - started:.0f} s")
    opt_in = {SPANS_OPT_IN_KEY: True}
    rng = random.Random(args.seed)
    reps = []
    try:
        for rep in range(args.reps):
            spans = _spans(rng, settings.span_config, args.prompt_tokens, args.span_tokens)
            prompt = [t for s in spans for t in s] + [settings.span_config.pdep_id,
                                                     *_ids(rng, 32)]
            if store is not None:
                for i, span in enumerate(spans):
                    async for _ in engine.generate(
                            TokensPrompt(prompt_token_ids=span),
                            SamplingParams(max_tokens=1, extra_args=opt_in), f"pre-{rep}-{i}"):
                        pass
                # the writer thread puts the entries on disk off the engine's thread
                expected = (rep + 1) * sum(len(span) for span in spans) // settings.block_size
                deadline = time.monotonic() + 180
                while len(list(store_dir.rglob("*.kvb"))) < expected:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the store wrote fewer than {expected} entries")
                    await asyncio.sleep(0.1)
                await engine.reset_prefix_cache()
                dropped = _drop_page_cache(store_dir)
            else:
                dropped = 0
            stamps, window = await _stream_while_loading(engine, prompt, rng, args, rep)
            row = {"prompt_tokens": len(prompt), "files_dropped_from_cache": dropped,
                   **gap_stats(stamps, window)}
            log(f"{name} rep {rep}: TTFT {row['ttft_s']:.2f} s, cached {row['cached']:.0f}, "
                f"gaps p50 {row['gap_p50_ms']:.0f} / p99 {row['gap_p99_ms']:.0f} / max "
                f"{row['gap_max_ms']:.0f} ms (steady {row['steady_gap_ms']:.0f} ms)")
            reps.append(row)
    finally:
        backend.close()
    return {"read_threads": threads, "reps": reps,
            **{key: statistics.median(r[key] for r in reps)
               for key in ("ttft_s", "gap_p50_ms", "gap_p99_ms", "gap_max_ms", "steady_gap_ms",
                           "cached")}}


def gap_stats(stamps: list[float], window: dict[str, float]) -> dict[str, float]:
    """The stream's inter-token gaps while the prompt was in flight (p50, p99, max), its steady
    gap before, and the prompt's TTFT and cached tokens."""
    gaps = sorted(b - a for a, b in zip(stamps, stamps[1:], strict=False)
                  if b >= window["sent"] and a <= window["first"])
    steady = [b - a for a, b in zip(stamps, stamps[1:], strict=False) if b < window["sent"]]
    return {"ttft_s": window["first"] - window["sent"], "cached": window["cached"],
            "gaps": len(gaps), "gap_p50_ms": 1e3 * statistics.median(gaps),
            "gap_p99_ms": 1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))],
            "gap_max_ms": 1e3 * gaps[-1], "steady_gap_ms": 1e3 * statistics.median(steady)}


def plot(result: dict[str, Any], path: Path,
         title: str = "A running stream while another request's spans load (median of reps)",
         while_: str = "the prompt loads") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["configs"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    for offset, key in ((-0.25, "gap_p50_ms"), (0.0, "gap_p99_ms"), (0.25, "gap_max_ms")):
        left.bar([i + offset for i in range(len(names))],
                 [result["configs"][n][key] for n in names], width=0.25,
                 label=key.split("_")[1])
    left.set_xticks(range(len(names)), names, fontsize=7)
    left.set_ylabel(f"decode inter-token gap while {while_} (ms)")
    left.legend()
    right.bar(range(len(names)), [result["configs"][n]["ttft_s"] for n in names])
    right.set_xticks(range(len(names)), names, fontsize=7)
    right.set_ylabel(f"TTFT of the {result['prompt_tokens']}-token prompt (s)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=7680,
                        help="span tokens of the loaded prompt (SmolLM2 takes 8192 in all)")
    parser.add_argument("--span-tokens", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--out", default=str(ROOT / "results" / "span_store" / "read_stall"))
    args = parser.parse_args()
    args.seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    log(f"seed {args.seed}")
    result: dict[str, Any] = {"seed": args.seed, "prompt_tokens": args.prompt_tokens,
                              "chunk": args.chunk, "configs": {}}
    with tempfile.TemporaryDirectory(prefix="minipic-stall-") as work:
        for name, threads in CONFIGS.items():
            result["configs"][name] = asyncio.run(_one_config(name, threads, args, Path(work)))
    base = result["configs"]["store, reads on the step"]
    for row in result["configs"].values():
        row["gap_p99_vs_reads_on_step"] = row["gap_p99_ms"] / base["gap_p99_ms"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    for name, row in result["configs"].items():
        print(f"{name:28s} TTFT {row['ttft_s']:6.2f} s  gap p50 {row['gap_p50_ms']:6.0f} ms  "
              f"p99 {row['gap_p99_ms']:6.0f} ms  max {row['gap_max_ms']:6.0f} ms  "
              f"(steady {row['steady_gap_ms']:.0f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
