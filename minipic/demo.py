"""``minipic demo``: the same RAG questions answered twice, with and without span caching.

Real questions (fanoutqa sub-questions answerable from the offline Wikipedia corpus), BM25
retrieval of a few passages, answers from SmolLM2-135M-Instruct on an in-process vLLM engine
through ``Orchestrator.embedded``. Each question runs in ``prefix`` mode (plain concatenation:
stock prefix caching, only the system prompt is reused) and in ``block_attention`` mode (each
passage is a span, prefilled on its own and reused at any position). Per question it prints the
final prompt's time to first token and the cached prompt tokens of both; the summary gives the
median TTFT per mode, their ratio, the end-to-end time including span prefills, and accuracy.

Honest caveats, printed too: SmolLM2 was not fine-tuned for Block-Attention, so its answers from
independently computed passages can be worse; and a span prefill costs time the first time a
passage is seen — the TTFT gain is what later questions over the same passages get.

Eager by default, unlike ``minipic serve``: torch.compile makes CPU steps ~1.1x faster
(results/compiled_vs_eager) but costs 2-2.5 min more on a first start on 2 cores (its cache
under ~/.cache/vllm makes later starts cheaper; results/demo_first_run.json). Six questions spend
about a minute in the engine, so a first-time user would wait minutes to save seconds; a server
runs long enough to win it back. ``--compiled`` opts in. While a step blocks, a spinner with the
elapsed seconds says which one.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

    from minipic.orchestrator import Answer

SYSTEM_PROMPT = (
    "You are a concise assistant. Answer the question using only the documents provided. "
    "Reply with a short phrase, not a sentence."
)
MODES = ("prefix", "block_attention")


def add_subparser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="answer real questions over the offline Wikipedia corpus, with and without spans",
        description=(
            "Runs a small retrieval-augmented QA job in-process: BM25 retrieves passages from "
            "10k offline Wikipedia lead sections and SmolLM2-135M-Instruct answers on vLLM (CPU) "
            "twice per question — plain prompt (prefix mode) and span-aware (block_attention "
            "mode) — printing time to first token and cached prompt tokens for both, then the "
            "median TTFT per mode and the accuracy of each."
        ),
    )
    p.add_argument("--questions", type=int, default=6, help="how many questions (default: 6)")
    p.add_argument("--k", type=int, default=3, help="passages retrieved per question (default: 3)")
    p.add_argument("--max-tokens", type=int, default=24, help="answer length cap (default: 24)")
    p.add_argument("--model", default=None, help="model folder (default: embedded SmolLM2)")
    speed = p.add_mutually_exclusive_group()
    speed.add_argument(
        "--compiled", action="store_true",
        help="run vLLM compiled (torch.compile): ~1.1x faster steps on CPU, for 2-2.5 min "
             "more start-up on a first run on 2 cores (cached under ~/.cache/vllm afterwards). "
             "Six questions spend about a minute in the engine and cannot win that back, so "
             "the demo runs eager by default; `minipic serve` runs compiled by default because "
             "a server runs long enough to win it back (results/demo_first_run.json)")
    # the demo's default since it turned eager; accepted so that older command lines still work
    speed.add_argument("--eager", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--verbose", action="store_true",
                   help="show the engine's INFO logs (on stderr), known noise included; "
                        "default: warnings only, minus vLLM's known CPU noise "
                        "(minipic/engine_logs.py)")
    p.add_argument("--engine-log", default=None, metavar="FILE",
                   help="write the engine's logs to FILE instead of the terminal")
    p.set_defaults(func=run)


@dataclass
class Row:
    question: str
    gold: str
    answers: dict[str, Answer]  # mode -> its answer

    def ok(self, mode: str) -> bool:
        return self.gold.lower() in self.answers[mode].text.lower()


def run(args: argparse.Namespace) -> int:
    from minipic.engine_logs import quiet_engine_logs

    quiet_engine_logs(args.verbose, args.engine_log)  # before vLLM is imported: stdout is ours
    from rich.console import Console

    from minipic.orchestrator import SyncOrchestrator
    from minipic.orchestrator.corpus import default_corpus, load_qa_items

    console = Console()
    kind = "compiled" if args.compiled else "eager"
    console.print(f"[bold]minipic demo[/] — {ENGINE_START[kind]}", highlight=False)
    # a spinner only on a terminal, and not with --verbose: INFO lines would tear it apart
    live = console.is_terminal and not args.verbose
    started = time.perf_counter()
    with _step(console, "loading the corpus (10k Wikipedia lead sections) and retrieving "
               "passages", "corpus loaded, passages retrieved", live):
        items = load_qa_items()[: args.questions]
        corpus = default_corpus()
        retrieved = [[p.as_document for p in corpus.search(item.question, args.k)]
                     for item in items]
    with _step(console, f"starting the vLLM engine ({kind}): its EngineCore process, "
               "model weights, KV cache" + (", torch.compile" if args.compiled else ""),
               f"engine ready ({kind})", live) as engine_start:
        # no tqdm bar for the weights unless verbose: the spinner already says what runs
        orc = SyncOrchestrator.embedded(args.model, enforce_eager=not args.compiled,
                                        use_tqdm_on_load=args.verbose)
    with orc:
        with _step(console, "first request (the engine's one-off set-up for its first step)",
                   "first request done", live):
            orc.answer("Warm-up?", ["warm-up"], mode="prefix", max_tokens=1)  # untimed
        rows = _answer_all(orc, items, retrieved, args, console)
    _print_table(console, rows)
    _print_summary(console, rows, time.perf_counter() - started, engine_start.seconds)
    return 0


# What the user is told before the engine starts (measured on 2 CPU cores: results/
# demo_first_run.json); the compiled figure is for a first start, with an empty compile cache.
ENGINE_START = {
    "eager": "eager engine: it starts in about a minute on 2 CPU cores, the whole demo takes "
             "about 2 min (--compiled: ~1.1x faster steps, ~2 min more to start the first time)",
    "compiled": "compiled engine: a first start spends ~2 min more in torch.compile on 2 CPU "
                "cores (later starts reuse its cache under ~/.cache/vllm)",
}


@dataclass
class StepTime:
    seconds: float = 0.0


@contextlib.contextmanager
def _step(console: Console, doing: str, done: str, live: bool = True) -> Iterator[StepTime]:
    """Show what a blocking step is doing while it runs, then one line with how long it took.

    Why: starting the engine blocks this thread for a minute or more, and users took a silent
    screen for a hang. ``live``: a spinner with the elapsed time, redrawn by rich's own thread
    while this one waits. Not live (a pipe, a file, ``--verbose``): the ``doing`` line, printed
    once. Either way the ``done`` line with the step's time follows."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    timing = StepTime()
    started = time.perf_counter()
    try:
        if live:
            with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                          console=console, transient=True) as progress:
                progress.add_task(doing, total=None)
                yield timing
        else:
            console.print(f"  {doing}…", highlight=False)
            yield timing
    finally:
        timing.seconds = time.perf_counter() - started
    console.print(f"  {done} in {timing.seconds:.0f} s", highlight=False)


def _answer_all(orc, items, retrieved, args, console) -> list[Row]:
    from rich.progress import Progress

    rows = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("answering", total=len(items) * len(MODES))
        for item, docs in zip(items, retrieved, strict=True):
            answers = {}
            for mode in MODES:
                progress.update(task, description=f"{mode:>15}: {item.question[:40]}")
                answers[mode] = orc.answer(item.question, docs, SYSTEM_PROMPT, mode,
                                           max_tokens=args.max_tokens)
                progress.advance(task)
            rows.append(Row(item.question, item.answer, answers))
    return rows


def _print_table(console, rows: list[Row]) -> None:
    from rich.table import Table

    table = Table(title="SmolLM2-135M-Instruct on vLLM (CPU): prefix vs block_attention",
                  caption="block = block_attention mode; span prefill = its wait before the "
                          "final prompt")
    table.add_column("#", justify="right")
    table.add_column("question", overflow="fold")
    for mode in MODES:
        table.add_column(f"{mode.split('_')[0]}\nok", justify="center")
        table.add_column("TTFT\nms", justify="right")
        table.add_column("cached/\nprompt", justify="right")
    table.add_column("span\nprefill ms", justify="right")
    for i, row in enumerate(rows, 1):
        cells = [str(i), row.question]
        for mode in MODES:
            a = row.answers[mode]
            cells += ["✓" if row.ok(mode) else "✗", f"{a.ttft_s * 1e3:.0f}",
                      f"{a.cached_tokens}/{a.prompt_tokens}"]
        cells.append(f"{row.answers['block_attention'].warm_s * 1e3:.0f}")
        table.add_row(*cells)
    console.print(table)
    for i, row in enumerate(rows, 1):
        console.print(f"[bold]{i}[/] gold: {row.gold}")
        for mode in MODES:
            answer = " ".join(row.answers[mode].text.split())
            console.print(f"   {mode:>15}: {answer[:60]}", highlight=False)


def _print_summary(console, rows: list[Row], elapsed: float, engine_start: float) -> None:
    from rich.table import Table

    ttft = {m: statistics.median(r.answers[m].ttft_s for r in rows) for m in MODES}
    table = Table(title="summary")
    for col in ("mode", "median TTFT ms", "median end-to-end ms", "cached/prompt", "correct"):
        table.add_column(col, justify="right")
    for mode in MODES:
        answers = [r.answers[mode] for r in rows]
        table.add_row(
            mode, f"{ttft[mode] * 1e3:.0f}",
            f"{statistics.median(a.total_s for a in answers) * 1e3:.0f}",
            f"{sum(a.cached_tokens for a in answers)}/{sum(a.prompt_tokens for a in answers)}",
            f"{sum(r.ok(mode) for r in rows)}/{len(rows)}",
        )
    console.print(table)
    ratio = ttft["prefix"] / ttft["block_attention"] if ttft["block_attention"] else float("nan")
    console.print(
        f"TTFT ratio prefix / block_attention: [bold]{ratio:.1f}x[/]. End-to-end includes the "
        "span prefills block_attention runs the first time it sees a passage; later questions "
        "over the same passages skip them.\n"
        "SmolLM2 is not Block-Attention fine-tuned: block_attention answers come from passages "
        "computed independently and may be less accurate (\"correct\" = the gold answer occurs "
        f"in the reply). Total {elapsed:.0f} s, of which the engine's start {engine_start:.0f} s."
    )
