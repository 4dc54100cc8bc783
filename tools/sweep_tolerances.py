"""Sweep the randomized tests of the fast tier over many fresh seeds, and report how close each
comes to its tolerance.

    .venv/bin/python tools/sweep_tolerances.py               # 200 seeds per test
    .venv/bin/python tools/sweep_tolerances.py --seeds 20 tests/engine/test_kernels.py -k move_keys

Every test that takes the ``seed`` fixture and is marked ``fast`` runs once per seed
(``pytest --seed-sweep N``). Each tolerance check (``tests/support/tolerances.py``) records its
error as a share of its tolerance; the report lists, per test and check, the worst share seen and
the seed that gave it (``MINIPIC_TEST_SEED=<seed>`` replays it). The run fails if a test failed or a
share reached ``--max-share`` (default 0.5: no test within 2x of its tolerance).

Writes ``--out`` + ``.json`` and ``.md`` (default ``results/tolerance_sweep/all``). The Triton
tests run in Triton's CPU interpreter (~0.5 s each): sweep them with fewer seeds.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from minipic.span_contract.env import TEST_SEED_ENV, TOLERANCE_LOG_ENV

ROOT = Path(__file__).resolve().parents[1]
SWEEP_ID = re.compile(r"-?sweep\d+")


def test_name(nodeid: str) -> str:
    """The test's id without the sweep's seed parameter (``f[sweep3]`` -> ``f``)."""
    name = SWEEP_ID.sub("", nodeid)
    return name.replace("[]", "").replace("[-", "[")


def summarize(records: list[dict]) -> list[dict]:
    worst: dict[tuple[str, str], dict] = {}
    runs: collections.Counter[tuple[str, str]] = collections.Counter()
    for rec in records:
        key = (test_name(rec["test"]), SEED_IN_TEXT.sub("", rec["what"]))
        runs[key] += 1
        if key not in worst or rec["share"] > worst[key]["share"]:
            worst[key] = rec
    rows = [{"test": test, "check": what, "checks": runs[(test, what)],
             "worst_share": worst[(test, what)]["share"],
             "worst_seed": worst[(test, what)]["seed"] or _seed_in(worst[(test, what)]["what"])}
            for test, what in worst]
    return sorted(rows, key=lambda r: -r["worst_share"])


SEED_IN_TEXT = re.compile(r",? ?\(?seed=\d+\)?")


def _seed_in(what: str) -> int | None:
    found = re.search(r"seed=(\d+)", what)
    return int(found.group(1)) if found else None


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# Tolerance sweep: {meta['seeds']} seeds per randomized fast test",
             "",
             f"{meta['tests_run']} test runs, {meta['failed']} failed, {meta['seconds']:.0f} s; "
             f"worst share of a tolerance: {meta['worst_share']:.3f} (limit {meta['max_share']}).",
             "",
             "| worst share | checks | test | check | worst seed |",
             "|---:|---:|---|---|---:|"]
    lines += [f"| {r['worst_share']:.3f} | {r['checks']} | `{r['test']}` | {r['check']} | "
              f"{r['worst_seed']} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", default=["tests"], help="test files (default: all)")
    parser.add_argument("--seeds", type=int, default=200, help="seeds per test (default 200)")
    parser.add_argument("-k", dest="select", default=None,
                        help="pytest -k expression: sweep only the matching tests")
    parser.add_argument("--max-share", type=float, default=0.5,
                        help="fail when a check uses this share of its tolerance (default 0.5)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "tolerance_sweep" / "all",
                        help="report path without suffix (.json and .md are written)")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")

    with tempfile.TemporaryDirectory(prefix="minipic-sweep-") as tmp:
        log = Path(tmp) / "shares.jsonl"
        report = Path(tmp) / "report.json"
        env = {**os.environ, TOLERANCE_LOG_ENV: str(log)}
        env.pop(TEST_SEED_ENV, None)
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-m", "fast", "-p", "no:cacheprovider",
             f"--seed-sweep={args.seeds}", "--junitxml", str(report),
             *(["-k", args.select] if args.select else []), *args.paths],
            cwd=ROOT, env=env)
        seconds = time.monotonic() - started
        records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() \
            else []
        junit = report.read_text() if report.exists() else ""
    tests_run = int(_attr(junit, "tests"))
    failed = int(_attr(junit, "failures")) + int(_attr(junit, "errors"))
    rows = summarize(records)
    worst = max((r["worst_share"] for r in rows), default=0.0)
    meta = {"seeds": args.seeds, "paths": args.paths, "select": args.select,
            "tests_run": tests_run, "failed": failed, "seconds": seconds,
            "worst_share": worst, "max_share": args.max_share, "pytest_exit": done.returncode}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({**meta, "checks": rows}, indent=2))
    text = markdown(rows, meta)
    args.out.with_suffix(".md").write_text(text)
    print(text)
    if not records:
        print("no tolerance check ran: nothing was swept", file=sys.stderr)
        return 1
    return 0 if done.returncode == 0 and worst < args.max_share else 1


def _attr(xml: str, name: str) -> str:
    found = re.search(rf'<testsuite [^>]*\b{name}="(\d+)"', xml)
    return found.group(1) if found else "0"


if __name__ == "__main__":
    sys.exit(main())
