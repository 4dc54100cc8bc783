"""The ``minipic index`` command line: arguments, the supervised child, the printed report."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from minipic.index.corpus import (
    DEFAULT_TITLE_FORMAT,
    TEXT_SUFFIXES,
    WIKI,
    CorpusError,
    Document,
    load_corpus,
)
from minipic.index.engine_probe import EmbeddedProbe, HttpProbe, Probe
from minipic.index.runner import IndexReport, finish_report, index_documents
from minipic.span_contract.env import INDEX_CHILD_ENV
from minipic.span_contract.span_store_config import default_store_dir

if TYPE_CHECKING:
    from rich.console import Console

CHILD_ENV = INDEX_CHILD_ENV  # "1": this process is the supervised indexer


def add_subparser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "index", help="precompute a corpus's span KV into a span store (resumable)",
        description=(
            "Prefill every document of a corpus as a span, as the SDK lays it out, on an engine "
            "with a span store, so that later prompts load the documents' KV from the store "
            "instead of computing it: after an eviction, a restart, on another replica. An "
            "orchestrator started on the store (Orchestrator.embedded(span_store=DIR), or "
            "connected to `minipic serve --span-store DIR`) sends no prefill for indexed "
            "documents. Resumable: finished batches are listed in DIR/index-manifest.jsonl and "
            "a rerun skips them. The system prompt does not change a span's KV, so it is no "
            "option; the layout mode, cache salt, model and block size must be the app's."),
        epilog=(
            "CORPUS: a .jsonl file of {\"text\": ..., \"title\"?: ..., \"id\"?: ...} objects (a "
            f"titled document is indexed as '{DEFAULT_TITLE_FORMAT}', like the offline wiki "
            "passages: the app must pass exactly that text), a folder of "
            f"{'/'.join(TEXT_SUFFIXES)} files (each file's text as is), or `{WIKI}` (the 10k "
            "offline Wikipedia lead sections the demo and WikiRetriever use)."),
    )
    p.add_argument("corpus", metavar="CORPUS", help=f"JSONL file, folder, or `{WIKI}`")
    p.add_argument("--store", default=None, metavar="DIR",
                   help="the span store directory (the app's span_store / `minipic serve "
                        "--span-store`); default: <minipic cache>/span-store, or with --url "
                        "the server's")
    p.add_argument("--model", default=None,
                   help="model folder or tiny-llama (default: the embedded SmolLM2-135M)")
    p.add_argument("--block-size", type=int, default=32, help="KV block size (default: 32)")
    p.add_argument("--max-model-len", type=int, default=2048,
                   help="longer documents cannot be spans and are skipped (default: 2048)")
    p.add_argument("--mode", default="block_attention",
                   choices=("block_attention", "boundary_recompute"),
                   help="the layout the app answers with (default: %(default)s)")
    p.add_argument("--salt", default=None, metavar="TEXT",
                   help="the cache_salt the app passes (a tenant's spans are its own)")
    p.add_argument("--batch", type=int, default=16, metavar="N",
                   help="documents prefilled together, and recorded together (default: 16)")
    p.add_argument("--disk-gib", type=float, default=8.0, metavar="GIB",
                   help="bound of the store's disk tier; use the serving engine's "
                        "(default: %(default)s, as `minipic serve`)")
    p.add_argument("--title-format", default=DEFAULT_TITLE_FORMAT, metavar="FMT",
                   help="JSONL documents with a title (default: %(default)r)")
    p.add_argument("--url", default=None,
                   help="index through a running `minipic serve --span-store` at this URL "
                        "instead of an engine in this process")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="index only the corpus's first N documents")
    p.add_argument("--force", action="store_true",
                   help="prefill every document again, manifest or not")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip timing the engine's plain prefill rate for comparison")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="also write the report as JSON to FILE")
    p.add_argument("--verbose", action="store_true", help="show the engine's INFO logs")
    p.add_argument("--engine-log", default=None, metavar="FILE",
                   help="write the engine's logs to FILE")
    p.set_defaults(func=run)


def _fail(message: str) -> int:
    print(f"minipic index: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    if args.batch < 1:
        return _fail("--batch must be at least 1")
    if args.salt is not None and not args.salt:
        return _fail("--salt must not be empty")
    if args.url and args.model:
        return _fail("--model is the server's with --url")
    if args.limit is not None and args.limit < 1:
        return _fail("--limit must be at least 1")
    try:
        docs = load_corpus(args.corpus, args.title_format)[:args.limit]
    except CorpusError as exc:
        return _fail(str(exc))
    if os.environ.get(CHILD_ENV) != "1":
        return _supervised(args)
    from minipic.engine_logs import quiet_engine_logs

    quiet_engine_logs(args.verbose, args.engine_log)  # before vLLM is imported
    from rich.console import Console

    console = Console()
    try:
        report = asyncio.run(_run(args, docs, console))
    except CorpusError as exc:  # a store the server does not expose here
        return _fail(str(exc))
    except KeyboardInterrupt:
        console.print("interrupted: finished batches are in the manifest; rerun to resume")
        return 130
    _print_report(console, report)
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=2) + "\n")
    return 1 if report.error else 0


def _supervised(args: argparse.Namespace) -> int:
    """Run the index in a child process group that dies with this process.

    Why: vLLM's EngineCore and worker outlive a killed parent (nothing stops them: a SIGKILL of
    an in-process index left both running, holding the model and the KV cache). As for
    ``minipic serve`` (``serving.supervise``), the work runs in a session of its own, watched by
    a guard that stops the whole group once this process is gone, however it ended.
    """
    from minipic.serving.supervise import supervise

    argv = [sys.executable, "-m", "minipic.cli", *args.argv]
    return supervise(argv, {**os.environ, CHILD_ENV: "1"})


def make_store_root(store: Path) -> None:
    """Create the store folder with the modes the engine's store gives its own folders (0700,
    whatever the umask): ``minipic index`` often creates it before any server does, and a
    0755 root would let other local users list which documents are stored."""
    from minipic.engine_ext.span_store.tiers.files import Modes, make_dir

    make_dir(store, Modes.for_access(False))


async def _run(args: argparse.Namespace, docs: list[Document], console: Console
               ) -> IndexReport:
    from minipic.orchestrator import MinipicError, Orchestrator

    store = Path(args.store).expanduser().resolve() if args.store else None
    options = {"max_in_flight": max(64, args.batch), "max_prefills_in_flight": args.batch}
    started = time.perf_counter()
    console.print(f"[bold]minipic index[/] — {len(docs)} documents from {args.corpus}; "
                  + (f"connecting to {args.url}" if args.url else "starting the engine"),
                  highlight=False)
    if args.url:
        orc = Orchestrator.connect(args.url, options=options, learn_stored_spans=False)
        dirs = getattr(orc.backend, "span_store_dirs", ())
        store = store or (Path(dirs[0]) if dirs else None)
        if store is None or not store.is_dir():
            await orc.aclose()
            raise CorpusError(f"{args.url} reports no store directory readable here; pass "
                              "--store DIR (the server's --span-store)")
        probe: Probe = HttpProbe(orc, store)
    else:
        from minipic.span_contract.span_store_config import SpanStoreConfig

        store = store or default_store_dir()
        make_store_root(store)
        orc = Orchestrator.embedded(
            args.model, options=options, learn_stored_spans=False, block_size=args.block_size,
            max_model_len=args.max_model_len, use_tqdm_on_load=args.verbose,
            # no RAM tier: this process ends when the corpus is done; the disk is the point
            span_store=SpanStoreConfig(dir=str(store), ram_mib=0, disk_gib=args.disk_gib),
            worker_extension_cls="minipic.index.engine_probe.IndexWorkerExtension")
        probe = EmbeddedProbe(orc)
    report = IndexReport(corpus=args.corpus, store=str(store), mode=args.mode,
                         engine_start_s=time.perf_counter() - started)
    block = orc.builder.span_config.block_size
    try:
        await index_documents(orc, probe, docs, store, mode=args.mode, salt=args.salt,
                              batch=args.batch, force=args.force, report=report,
                              console=console, baseline=not args.no_baseline)
    except (MinipicError, RuntimeError) as exc:
        report.error = f"{type(exc).__name__}: {exc}"
    finally:
        await orc.aclose()
    return finish_report(report, store, block)


def _print_report(console: Console, r: IndexReport) -> None:
    from rich.table import Table

    table = Table(title=f"minipic index → {r.store}", show_header=False)
    table.add_column(justify="right")
    table.add_column()
    skipped = ", ".join(f"{n} {why}" for why, n in sorted(r.skipped.items())) or "none"
    rows = [
        ("documents", f"{r.documents} ({r.indexed} indexed now, {r.already_indexed} already "
                      f"in the manifest)"),
        ("not indexable", skipped),
        ("span tokens", f"{r.span_tokens:,} ({r.doc_tokens:,} of the documents' own); "
                        f"{r.prefills} prefills, {r.saved_blocks:,} blocks saved"),
        ("time", f"{r.wall_s:.1f} s indexing (+{r.engine_start_s:.0f} s engine start)"),
        ("tokens/s", f"{r.tokens_per_s:,.0f} (disk writes included)"),
    ]
    if r.baseline_prefill_tokens_per_s:
        ratio = r.tokens_per_s / r.baseline_prefill_tokens_per_s
        rows.append(("engine prefill", f"{r.baseline_prefill_tokens_per_s:,.0f} tokens/s "
                                       f"plain (index at {ratio:.2f}x)"))
    per_token = (f"{r.store_bytes_per_token:,.0f} bytes/token"
                 if r.store_bytes_per_token else "-")
    kv = f" (engine KV {r.kv_bytes_per_token:,.0f})" if r.kv_bytes_per_token else ""
    rows.append(("store", f"{r.store_entries:,} entries, {r.store_bytes / 2**20:,.1f} MiB, "
                          f"{per_token}{kv}"))
    if r.unrecorded:
        rows.append(("unrecorded", f"{r.unrecorded} documents (rerun to index them)"))
    if r.evicted_blocks:
        rows.append(("evicted", f"{r.evicted_blocks:,} blocks: the corpus outgrew the store's "
                                "bound (raise --disk-gib, and the server's --span-store-gib)"))
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    if r.error:
        console.print(f"[red]stopped[/]: {r.error}; finished batches are in the manifest, "
                      "rerun to resume", highlight=False)
