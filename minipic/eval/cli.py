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

A model ``minipic tune`` wrote is never scored on an item it was tuned on: the items its folder's
``minipic_tune.json`` lists are dropped (``minipic/tune/data.py``). With ``--url`` the folder is
the one the server says it loaded (``served_model_dir``); when that cannot be read here, eval
refuses unless ``--unchecked-model`` is given.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from minipic.eval.datasets import EvalItem, builtin_items, load_jsonl
from minipic.eval.report import evaluate, table, write
from minipic.eval.runner import DEFAULT_MODES
from minipic.span_contract.errors import BadInputError

__all__ = ["ModelNotCheckableError", "add_subparser", "run", "served_model_dir", "untuned_items"]


def add_subparser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "eval", help="answer quality of each mode vs full attention, beside its TTFT",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="builtin",
                   help="builtin (fanoutqa + SQuAD 1.1 dev), fanoutqa, squad, or a .jsonl of "
                        "{question, documents, answer?, system?} (default builtin)")
    p.add_argument("--n", type=int, default=300, help="items (built-in data; default 300)")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help=f"comma-separated (default {','.join(DEFAULT_MODES)}); "
                        f"boundary_recompute@TOKENS sets its head length (default one block), "
                        f"selective@SHARE the share of each span's own tokens recomputed in "
                        f"context (e.g. selective@0.15); MODE/no-sink lays the spans out "
                        f"without their sink (the model's opening each span carries)")
    p.add_argument("--passages", default="3-10",
                   help="documents per built-in item, MIN-MAX (default 3-10)")
    p.add_argument("--max-tokens", type=int, default=16, help="answer length (default 16)")
    p.add_argument("--url", help="a running `minipic serve` (default: an embedded engine)")
    p.add_argument("--unchecked-model", action="store_true",
                   help="with --url, when the served model's folder cannot be read here: score "
                        "every item without checking whether the served model was tuned on "
                        "some of them (`minipic tune`; default: refuse)")
    p.add_argument("--model", default=None, help="embedded model (default SmolLM2-135M)")
    p.add_argument("--sink-gap", type=int, default=None, metavar="G",
                   help="the embedded engine's sink gap: positions between a span's sink and its "
                        "first token (default 0; see `minipic serve --help`)")
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
        try:
            items = builtin_items(args.data, args.n, args.seed, (low, high), args.max_words)
        except BadInputError as exc:  # an unknown set, or one that could not be downloaded
            print(f"minipic eval: {exc}")
            return 2
    kept = untuned_items(args, items)
    if kept is None:
        return 2
    items = kept
    print(f"minipic eval: {len(items)} items, modes {modes}, "
          f"{'server ' + args.url if args.url else 'embedded engine'}")
    from minipic.orchestrator import Orchestrator

    if args.reference_model and args.url:
        print("minipic eval: --reference-model needs the embedded engine (no --url)")
        return 2
    if args.sink_gap is not None and args.url:
        print("minipic eval: --sink-gap sets the embedded engine's; a server has its own "
              "(`minipic serve --sink-gap`)")
        return 2
    gap = {} if args.sink_gap is None else {"sink_gap": args.sink_gap}
    orc = (Orchestrator.connect(args.url) if args.url
           else Orchestrator.embedded(args.model, **gap))
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


class ModelNotCheckableError(BadInputError):
    """The served model's folder cannot be read here, so which items it was tuned on is
    unknown."""


def served_model_dir(url: str, timeout: float = 10.0) -> Path:
    """The folder the server at ``url`` loaded its model from: the ``root`` of its one
    ``GET /v1/models`` entry (vLLM's OpenAI server names the path it loaded there), when that
    folder is on this machine. ``ModelNotCheckableError`` saying why not otherwise.

    Why ask the server: ``--url`` gives no model folder, and the one the user might pass could
    be another model than the one answering."""
    import httpx

    endpoint = url.rstrip("/") + "/v1/models"
    try:
        answer = httpx.get(endpoint, timeout=timeout)
        answer.raise_for_status()
        cards = answer.json()["data"]
    except httpx.HTTPError as exc:
        raise ModelNotCheckableError(f"cannot read {endpoint} ({type(exc).__name__}: "
                                     f"{exc})") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelNotCheckableError(f"{endpoint} is not a model list ({exc!r})") from exc
    if not isinstance(cards, list) or len(cards) != 1 or not isinstance(cards[0], dict):
        names = [c.get("id") for c in cards if isinstance(c, dict)] if isinstance(
            cards, list) else cards
        raise ModelNotCheckableError(f"{endpoint} lists {names!r}, not one model")
    root = cards[0].get("root")
    if not isinstance(root, str) or not root:
        raise ModelNotCheckableError(f"{endpoint} does not say which folder the model was "
                                     f"loaded from (no 'root')")
    folder = Path(root)
    if not folder.is_absolute():
        # relative to the server's working directory, which this process cannot know
        raise ModelNotCheckableError(f"the server names its model by the relative path "
                                     f"{root!r}; serve it by an absolute path")
    if not folder.is_dir():
        raise ModelNotCheckableError(f"the served model's folder {root} is not on this "
                                     f"machine")
    return folder


def untuned_items(args: argparse.Namespace, items: list[EvalItem]) -> list[EvalItem] | None:
    """``items`` minus those the evaluated model (embedded, or the one ``--url`` serves) was
    tuned on, saying how many were dropped; None, after saying why, when eval must stop."""
    from minipic.span_contract.models import resolve_model
    from minipic.tune.data import without_tuned

    model_dir: str | Path | None = None
    if args.url:
        try:
            model_dir = served_model_dir(args.url)
        except ModelNotCheckableError as exc:
            if not getattr(args, "unchecked_model", False):
                print(f"minipic eval: cannot check which items the served model was tuned on: "
                      f"{exc}. A model `minipic tune` wrote must not be scored on its tuning "
                      f"items: run eval where its folder is readable, or pass "
                      f"--unchecked-model to score every item unchecked")
                return None
            print(f"minipic eval: warning: {exc}; scoring every item without checking whether "
                  f"the served model was tuned on it (--unchecked-model)")
    else:
        model_dir = resolve_model(args.model)
    dropped = 0
    if model_dir is not None:
        try:
            items, dropped = without_tuned(items, model_dir)
        except BadInputError as exc:
            print(f"minipic eval: {exc}")
            return None
    if dropped:
        print(f"minipic eval: {dropped} item(s) dropped: the model was tuned on them")
    if not items:
        print("minipic eval: no item left to score")
        return None
    return items


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
