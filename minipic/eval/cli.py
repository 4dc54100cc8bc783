"""``minipic eval``: how much each mode changes the answers, paired against full attention.

    minipic eval                                   # built-in QA, n=300, embedded default model
    minipic eval --data mine.jsonl --url http://127.0.0.1:8000
    minipic eval --n 40 --modes prefix,block_attention --out /tmp/eval

For every item and mode: KL(full ‖ mode) and top-1 agreement of the next-token distributions
over the full-attention answer (teacher-forced; the engine's top-20 log-probs), greedy exact
match with full attention and the first divergence, EM / F1 against the gold answer, and the
mode's warm TTFT, in one run; paired bootstrap CIs throughout (``minipic/eval/metrics.py``).
Writes ``eval.json`` (summary, per item, per-line errors), ``eval.md`` (the table) and
``eval.png`` (quality vs TTFT) to ``--out``. ``evaluate()`` is the same from Python.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from minipic.eval.datasets import EvalItem, builtin_items, load_jsonl
from minipic.eval.report import evaluate, table, write
from minipic.eval.runner import DEFAULT_MODES

__all__ = ["add_subparser", "run"]


def add_subparser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "eval", help="answer quality of each mode vs full attention, beside its TTFT",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="builtin",
                   help="builtin (fanoutqa + BIG-bench knowledge conflicts), fanoutqa, cpkc, or "
                        "a JSONL of {question, documents, answer?, system?} (default builtin)")
    p.add_argument("--n", type=int, default=300, help="items (built-in data; default 300)")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help=f"comma-separated (default {','.join(DEFAULT_MODES)}); "
                        f"boundary_recompute@TOKENS sets its head length (default one block), "
                        f"selective@SHARE the share of each span's blocks recomputed in "
                        f"context (e.g. selective@0.15)")
    p.add_argument("--passages", default="3-10",
                   help="documents per built-in item, MIN-MAX (default 3-10)")
    p.add_argument("--max-tokens", type=int, default=16, help="answer length (default 16)")
    p.add_argument("--url", help="a running `minipic serve` (default: an embedded engine)")
    p.add_argument("--model", default=None, help="embedded model (default SmolLM2-135M)")
    p.add_argument("--reference-model", default=None,
                   help="compare every mode with this model's full attention instead of the "
                        "evaluated model's own (e.g. the base model of a `minipic tune` output; "
                        "a second embedded engine, same tokenizer)")
    p.add_argument("--concurrency", type=int, default=1,
                   help="items at once (their requests share engine steps; default 1)")
    p.add_argument("--max-words", type=int, default=80,
                   help="built-in passages are cut to this many words (default 80)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("results/eval"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from minipic.eval.runner import parse_mode

    try:
        modes = [parse_mode(m.strip()) for m in args.modes.split(",") if m.strip()]
        if not modes:
            raise ValueError("--modes is empty")
    except ValueError as exc:
        print(f"minipic eval: {exc}")
        return 2
    try:
        low, high = (int(x) for x in args.passages.split("-"))
        assert 1 <= low <= high
    except (ValueError, AssertionError):
        print(f"minipic eval: --passages must be MIN-MAX, got {args.passages!r}")
        return 2
    errors: list[dict[str, Any]] = []
    if args.data.endswith(".jsonl"):
        if not Path(args.data).is_file():
            print(f"minipic eval: {args.data} not found")
            return 2
        loaded = load_jsonl(args.data)
        items, errors = loaded.items, loaded.errors
    else:
        items = builtin_items(args.data, args.n, args.seed, (low, high), args.max_words)
    if not args.url:
        from minipic.tune.data import without_tuned
        from span_contract.errors import BadInputError
        from span_contract.models import resolve_model

        try:
            items, dropped = without_tuned(items, resolve_model(args.model))
        except BadInputError as exc:
            print(f"minipic eval: {exc}")
            return 2
        if dropped:
            print(f"minipic eval: {dropped} item(s) dropped: the model was tuned on them")
        if not items:
            print("minipic eval: no item left to score")
            return 2
    print(f"minipic eval: {len(items)} items, modes {modes}, "
          f"{'server ' + args.url if args.url else 'embedded engine'}")
    from orchestrator import Orchestrator

    if args.reference_model and args.url:
        print("minipic eval: --reference-model needs the embedded engine (no --url)")
        return 2
    orc = Orchestrator.connect(args.url) if args.url else Orchestrator.embedded(args.model)
    reference = Orchestrator.embedded(args.reference_model) if args.reference_model else None
    if reference is not None and reference.builder.tokenizer.get_vocab() != (
            orc.builder.tokenizer.get_vocab()):
        print(f"minipic eval: --reference-model {args.reference_model} has another tokenizer: "
              f"its answers cannot be compared token by token")
        return 2
    report = asyncio.run(_run(args, orc, items, modes, errors, reference))
    write(report, args.out)
    print(table(report))
    print(f"wrote {args.out}/eval.json, eval.md, eval.png")
    return 0


async def _run(args: argparse.Namespace, orc: Any, items: list[EvalItem], modes: list[str],
               errors: list[dict[str, Any]], reference: Any = None) -> dict[str, Any]:
    try:
        return await evaluate(orc, items, modes, max_tokens=args.max_tokens, errors=errors,
                              seed=args.seed, concurrency=args.concurrency,
                              reference_orc=reference)
    finally:
        await orc.backend.aclose()
        if reference is not None:
            await reference.backend.aclose()
