"""How long the scheduler waits on the store's ``has`` when the disk is slow: a tier-level
measurement with an injected delay per filesystem metadata call.

    .venv/bin/python benchmarks/store_lookup_latency.py --out results/span_store/lookup_latency
    .venv/bin/python benchmarks/store_lookup_latency.py --quick --out /tmp/lookup

The scheduler asks, on its own thread, whether each span block of an arriving prompt is in the
store (``scheduler_side.StoreLookup.source_of``): 512 lookups for a cold 8k-token span prompt at
16-token blocks, per tier and per tensor-parallel rank. Every running decode waits for that
step. A network mount answering a metadata call in 5 ms is a typical slow case (issue 54 asks for
the decode inter-token p99 with such a tier; that needs an engine, this measures the part the
tier controls: the scheduler-thread time per batch of lookups, which is added to one step).

Every ``os.lstat``, ``os.stat``, ``os.scandir`` and ``os.statvfs`` made in this process sleeps
``--delay-ms`` first (an in-process shim, like a FUSE or ``LD_PRELOAD`` one). Modes, on one real
``DirTier`` over a folder with ``--entries`` entries (half the looked-up keys present):

* ``lstat probe``: the former ``has`` -- one ``lstat`` of the entry's name per lookup;
* ``index``: ``has`` now (``tiers/dir_index.py``): memory only;
* ``listing``: the background listing that keeps the index current (off the scheduler's
  thread; names only, one ``scandir`` per shard folder), for scale.

With ``--base DIR`` the former code itself (a checkout before issue 54, e.g. ``/tmp/base54``)
is timed too, in a child process. Writes ``OUT.json`` and ``OUT.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import stat
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FP = "lookup-latency|model=tiny"
SHIMMED = ("lstat", "stat", "scandir", "statvfs")

# the former DirTier.has, run in a checkout before issue 54 (``--base``)
BASE_CHILD = r"""
import json, os, random, sys, time
sys.path.insert(0, sys.argv[1])
from engine_ext.span_store.tiers import DirTier
root, delay, keys = sys.argv[2], float(sys.argv[3]), json.loads(sys.argv[4])
tier = DirTier(root + "-base", 1 << 30, "lookup-latency|model=tiny")
for name in ("lstat", "stat", "scandir", "statvfs"):
    real = getattr(os, name)
    def slow(*a, _real=real, **k):
        time.sleep(delay)
        return _real(*a, **k)
    setattr(os, name, slow)
t0 = time.perf_counter()
found = sum(tier.has(k) for k in keys)
print(json.dumps({"seconds": time.perf_counter() - t0, "found": found}))
"""


def shim(delay_s: float) -> dict[str, Any]:
    """Make every metadata call of this process sleep ``delay_s`` first; the real functions."""
    real = {name: getattr(os, name) for name in SHIMMED}
    for name, fn in real.items():
        def slow(*args: Any, _fn: Any = fn, **kwargs: Any) -> Any:
            time.sleep(delay_s)
            return _fn(*args, **kwargs)

        setattr(os, name, slow)
    return real


def unshim(real: dict[str, Any]) -> None:
    for name, fn in real.items():
        setattr(os, name, fn)


def run(entries: int, batch: int, reps: int, delay_ms: float, seed: int,
        base: str | None = None) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    from minipic.engine_ext.span_store.tiers import DirTier, Entry

    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="minipic-lookup-"))
    tier = DirTier(work / "store", 1 << 30, FP, fsync=False, refresh_s=0)
    stored = [rng.randbytes(32).hex() for _ in range(entries)]
    for key in stored:
        tier.put(key, Entry(rng.randbytes(64), {"home": 0}))
    modes: dict[str, list[float]] = {"lstat probe": [], "index": [], "listing": []}
    found: dict[str, int] = {}
    for _ in range(reps):
        keys = rng.sample(stored, batch // 2) + [rng.randbytes(32).hex()
                                                 for _ in range(batch - batch // 2)]
        rng.shuffle(keys)
        real = shim(delay_ms / 1e3)
        try:
            t0 = time.perf_counter()
            hits = 0
            for key in keys:  # the former has(): one lstat per lookup
                try:
                    hits += stat.S_ISREG(os.lstat(tier.entry_path(key)).st_mode)
                except OSError:
                    pass
            modes["lstat probe"].append(time.perf_counter() - t0)
            found["lstat probe"] = hits
            t0 = time.perf_counter()
            found["index"] = sum(tier.has(key) for key in keys)
            modes["index"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            tier._idx.refresh()
            modes["listing"].append(time.perf_counter() - t0)
        finally:
            unshim(real)
        if base:
            out = subprocess.run([sys.executable, "-c", BASE_CHILD, base, str(work / "store"),
                                  str(delay_ms / 1e3), json.dumps(keys)],
                                 capture_output=True, text=True, check=True, cwd=base)
            got = json.loads(out.stdout.strip().splitlines()[-1])
            modes.setdefault("former code (--base)", []).append(got["seconds"])
    if found["index"] != found["lstat probe"]:
        raise AssertionError(f"index and lstat disagree: {found}")
    return {
        "entries": entries, "batch": batch, "reps": reps, "delay_ms_per_metadata_call": delay_ms,
        "seed": seed, "found_per_batch": found["index"],
        "modes": {mode: {"median_batch_ms": statistics.median(times) * 1e3,
                         "max_batch_ms": max(times) * 1e3,
                         "per_lookup_us": statistics.median(times) / batch * 1e6,
                         "on_scheduler_thread": mode != "listing"}
                  for mode, times in modes.items() if times},
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = result["modes"]
    names = list(modes)
    values = [max(modes[n]["median_batch_ms"], 1e-3) for n in names]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    bars = ax.barh(names, values, color=["#c44" if modes[n]["on_scheduler_thread"] else "#999"
                                         for n in names])
    for bar, value in zip(bars, values, strict=True):
        ax.text(value * 1.15, bar.get_y() + bar.get_height() / 2, f"{value:.3g} ms",
                va="center", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel(f"ms per batch of {result['batch']} lookups "
                  f"({result['delay_ms_per_metadata_call']:g} ms per metadata call)")
    ax.set_title("span store has(): scheduler-thread time per cold 8k-token prompt (red), "
                 "background listing (grey)", fontsize=8)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=512, help="lookups per prompt")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--delay-ms", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--base", default=None, help="a checkout before issue 54, timed too")
    parser.add_argument("--quick", action="store_true", help="512 entries, 1 rep")
    parser.add_argument("--out", default=str(ROOT / "results" / "span_store" / "lookup_latency"))
    args = parser.parse_args()
    if args.quick:
        args.entries, args.reps = 512, 1
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    result = run(args.entries, args.batch, args.reps, args.delay_ms, seed, args.base)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    for mode, row in result["modes"].items():
        print(f"{mode:>22}: {row['median_batch_ms']:10.3f} ms per batch of {args.batch} "
              f"({row['per_lookup_us']:.2f} us per lookup)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
