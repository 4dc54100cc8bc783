"""``minipic plan``: checkpoint positions for one cached prefix, from a depth histogram.

The subcommand is registered on the caller's argparse ``subparsers`` (``add_subparser``) so that
the ``minipic`` CLI owns the top-level parser; ``main`` runs it stand-alone
(``python -m minipic.checkpoint_planner.cli plan ...``). Output is one JSON object on stdout;
bad input is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from minipic.checkpoint_planner.estimator import load_histogram
from minipic.checkpoint_planner.planner import METHODS, make_plan

_DESCRIPTION = """\
Choose where to store recurrent-state checkpoints along a cached prefix of N tokens, given the
distribution of overlap depths of future requests, so that the expected number of recomputed
tokens is minimal for a budget of M checkpoint slots (docs/design.md §4).

Histogram FILE (JSON), one of:
  [p0, p1, ..., pN]          probabilities of overlap depth 0..N (sum 1), or
  [c0, c1, ..., cN]          integer counts per depth (normalised), or
  {"depths": [d, ...], "n": N [, "half_life": H]}
                             observed depths in arrival order, each in 0..N; with half_life,
                             an observation H arrivals old weighs half as much (drift).

Prints JSON: n, budget, granularity, method, positions, expected_recompute, no_cache_recompute
(recompute with no checkpoints, E[T]) and, under "baselines", positions and expected_recompute
of every other method. With --reference, also tv and suboptimality_bound = 2 N TV(ref, hist):
how much worse than optimal the plan can be if the reference is the true distribution.
"""

_METHOD_HELP = (
    "dp: exact optimum (default); balanced: equal spacing; block: every multiple of G, first M; "
    "log: geometric spacing; sqrt: spacing sqrt(N), first M"
)


def add_subparser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``plan`` on an ``argparse`` subparsers object; returns the new parser."""
    parser = subparsers.add_parser(
        "plan",
        help="plan sparse recurrent-state checkpoints from an overlap-depth histogram",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--histogram", required=True, metavar="FILE",
                        help="overlap-depth histogram (JSON; formats above)")
    parser.add_argument("--budget", required=True, type=int, metavar="M",
                        help="number of checkpoint slots (>= 0)")
    parser.add_argument("--granularity", type=int, default=1, metavar="G",
                        help="checkpoints only at multiples of G, e.g. the KV block size "
                             "(default 1)")
    parser.add_argument("--method", choices=METHODS, default="dp", help=_METHOD_HELP)
    parser.add_argument("--reference", metavar="FILE",
                        help="a second histogram (same N), e.g. the latest window, to report "
                             "TV distance and the suboptimality bound against")
    parser.set_defaults(func=run)
    return parser


def _summary(q: Any, args: argparse.Namespace, ref: Any) -> dict[str, Any]:
    chosen = make_plan(q, args.budget, args.method, args.granularity, ref)
    out: dict[str, Any] = {
        "n": chosen.n,
        "budget": chosen.budget,
        "granularity": chosen.granularity,
        "method": chosen.method,
        "positions": list(chosen.positions),
        "expected_recompute": chosen.expected_recompute,
        "no_cache_recompute": chosen.no_cache_recompute,
    }
    if ref is not None:
        out["tv"] = chosen.tv
        out["suboptimality_bound"] = chosen.suboptimality_bound
    out["baselines"] = {}
    for method in METHODS:
        if method != args.method:
            other = make_plan(q, args.budget, method, args.granularity)
            out["baselines"][method] = {
                "positions": list(other.positions),
                "expected_recompute": other.expected_recompute,
            }
    return out


def run(args: argparse.Namespace) -> int:
    """Execute ``plan``; 0 on success, 2 on bad input (message on stderr)."""
    try:
        q = load_histogram(args.histogram)
        ref = None
        if args.reference is not None:
            ref = load_histogram(args.reference)
            if ref.size != q.size:
                raise ValueError(f"--reference has N = {ref.size - 1}, histogram has "
                                 f"N = {q.size - 1}")
        out = _summary(q, args, ref)
    except ValueError as e:
        print(f"minipic plan: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry point with the same ``plan`` subcommand."""
    parser = argparse.ArgumentParser(prog="minipic")
    add_subparser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
