"""Do a cold prompt's store lookups stall the streams already running, on a slow mount?

    .venv/bin/python benchmarks/store_lookup_stall.py --out results/span_store/lookup_stall

SmolLM2-135M (fp32, eager), fresh random token ids. The store's folder behaves like a slow
network mount: every metadata call under it (``lstat``, ``stat``, ``scandir``) takes
``--delay-ms`` more, injected by a ``sitecustomize`` on the EngineCore's ``PYTHONPATH`` (nothing
in minipic changes for it). One stream decodes (``--decode-tokens``); once past its first
``--warmup`` tokens, a *cold* prompt of ``--prompt-tokens`` span tokens arrives: none of its
blocks is stored, so every lookup is a miss. Three engines, one after the other:

* **no store**: the baseline;
* **store, every miss asks the mount**: probe deadline and budget unbounded, so the scheduler
  waits for one ``lstat`` per span block -- what ``DirTier.has`` did before issue 54;
* **store, index + budgeted probe** (the defaults, ``tiers/probe.py``): the index answers, a
  miss is probed off the scheduler's thread within 20 ms, and at most 50 ms per second.

Reported per engine, median over ``--reps`` reps: the stream's inter-token gaps while the prompt
is looked up and computed (p50, p99, max), the prompt's TTFT, and both as ratios to the engine
without a store. Writes ``OUT.json`` and ``OUT.png``.
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
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from store_read_stall import (  # noqa: E402
    _ids,
    _spans,
    _stream_while_loading,
    gap_stats,
    log,
    plot,
)

UNBOUNDED = {"probe_deadline_ms": 1e9, "probe_budget_ms": 1e9}
CONFIGS: dict[str, dict[str, float] | None] = {
    "no store": None,
    "store, every miss asks the mount": UNBOUNDED,
    "store, index + budgeted probe": {},
}
SLOW_DIR_ENV = "STORE_LOOKUP_STALL_SLOW_DIR"  # read by the shim only
SLOW_MS_ENV = "STORE_LOOKUP_STALL_SLOW_MS"
# A process that imports this (every interpreter, through PYTHONPATH) sees metadata calls under
# the slow folder take SLOW_MS longer, on whichever thread makes them.
SITECUSTOMIZE = f'''
import os, time
_root = os.environ.get("{SLOW_DIR_ENV}")
_delay = float(os.environ.get("{SLOW_MS_ENV}", "0")) / 1e3
if _root and _delay > 0:
    def _slow(real):
        def call(path=".", *args, **kwargs):
            if not isinstance(path, int) and os.fsdecode(os.fspath(path)).startswith(_root):
                time.sleep(_delay)
            return real(path, *args, **kwargs)
        return call
    os.lstat, os.stat, os.scandir = _slow(os.lstat), _slow(os.stat), _slow(os.scandir)
'''


async def _one_config(name: str, probe: dict[str, float] | None, args: argparse.Namespace,
                      work: Path) -> dict[str, Any]:
    from minipic.orchestrator.embedded_backend import EmbeddedBackend
    from minipic.span_contract.engine_config import EngineSettings
    from minipic.span_contract.span_store_config import SpanStoreConfig

    store_dir = work / "slow" / name.replace(" ", "_").replace(",", "").replace("+", "")
    store = None if probe is None else SpanStoreConfig(dir=str(store_dir), ram_mib=0, **probe)
    settings = EngineSettings(max_model_len=8192, span_store=store,
                              extra={"max_num_batched_tokens": args.chunk}).resolved()
    started = time.monotonic()
    backend = EmbeddedBackend.start(settings)
    log(f"{name}: engine up in {time.monotonic() - started:.0f} s")
    rng = random.Random(args.seed)
    reps = []
    try:
        for rep in range(args.reps):
            spans = _spans(rng, settings.span_config, args.prompt_tokens, args.span_tokens)
            prompt = [t for s in spans for t in s] + [settings.span_config.pdep_id,
                                                     *_ids(rng, 32)]
            stamps, window = await _stream_while_loading(backend.engine, prompt, rng, args, rep)
            row = gap_stats(stamps, window)
            log(f"{name} rep {rep}: TTFT {row['ttft_s']:.2f} s, gaps p50 "
                f"{row['gap_p50_ms']:.0f} / p99 {row['gap_p99_ms']:.0f} / max "
                f"{row['gap_max_ms']:.0f} ms (steady {row['steady_gap_ms']:.0f} ms)")
            reps.append(row)
    finally:
        backend.close()
    return {"probe": probe, "reps": reps,
            **{key: statistics.median(r[key] for r in reps)
               for key in ("ttft_s", "gap_p50_ms", "gap_p99_ms", "gap_max_ms", "steady_gap_ms",
                           "cached")}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=7680,
                        help="span tokens of the cold prompt (SmolLM2 takes 8192 in all)")
    parser.add_argument("--span-tokens", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--delay-ms", type=float, default=5.0,
                        help="added to every metadata call under the store's folder")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--quick", action="store_true",
                        help="a 2k-token prompt, 120 decode tokens, one rep")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--out", default=str(ROOT / "results" / "span_store" / "lookup_stall"))
    args = parser.parse_args()
    if args.quick:
        args.prompt_tokens, args.decode_tokens, args.reps = 2048, 120, 1
    args.seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    log(f"seed {args.seed}")
    result: dict[str, Any] = {"seed": args.seed, "prompt_tokens": args.prompt_tokens,
                              "delay_ms": args.delay_ms, "chunk": args.chunk, "configs": {}}
    with tempfile.TemporaryDirectory(prefix="minipic-lookup-stall-") as work:
        shim = Path(work) / "shim"
        shim.mkdir()
        (shim / "sitecustomize.py").write_text(SITECUSTOMIZE)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(shim), os.environ.get("PYTHONPATH")) if p)
        os.environ[SLOW_DIR_ENV] = str(Path(work) / "slow")
        os.environ[SLOW_MS_ENV] = str(args.delay_ms)
        for name, probe in CONFIGS.items():
            result["configs"][name] = asyncio.run(_one_config(name, probe, args, Path(work)))
    base = result["configs"]["no store"]
    for row in result["configs"].values():
        row["gap_p99_vs_no_store"] = row["gap_p99_ms"] / base["gap_p99_ms"]
        row["ttft_vs_no_store"] = row["ttft_s"] / base["ttft_s"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"), while_="the cold prompt arrives",
         title=f"A running stream while a cold span prompt is looked up, {args.delay_ms:g} ms "
               f"per metadata call (median of reps)")
    for name, row in result["configs"].items():
        print(f"{name:34s} TTFT {row['ttft_s']:6.2f} s ({row['ttft_vs_no_store']:.2f}x)  gap "
              f"p50 {row['gap_p50_ms']:5.0f} ms  p99 {row['gap_p99_ms']:5.0f} ms "
              f"({row['gap_p99_vs_no_store']:.2f}x)  max {row['gap_max_ms']:5.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
