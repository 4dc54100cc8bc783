"""Indexing itself: documents laid out as the SDK lays them out, prefilled in batches, each
batch recorded in the manifest once its blocks are durable; and the run's report."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minipic.index.corpus import Document
from minipic.index.engine_probe import block_payload_bytes, store_usage
from minipic.orchestrator.span_index import ManifestRecord, read_manifest, salt_digest

if TYPE_CHECKING:
    from rich.console import Console

    from minipic.index.engine_probe import Probe
    from minipic.orchestrator import Orchestrator

# a batch's blocks stay below the store writer's queue (256 entries): a full queue drops saves
MAX_BATCH_BLOCKS = 128
BASELINE_BATCHES = 2  # prefills timed for the engine's plain prefill rate


@dataclass
class IndexReport:
    """What one ``minipic index`` run did (``--json`` writes it)."""

    corpus: str
    store: str
    mode: str
    fingerprint: str = ""
    documents: int = 0  # in the corpus
    already_indexed: int = 0  # skipped: the manifest lists them
    indexed: int = 0  # recorded in the manifest by this run
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> documents not indexable
    unrecorded: int = 0  # prefilled, but the store did not confirm their blocks
    evicted_blocks: int = 0  # blocks the bounded store evicted while indexing (embedded only)
    prefills: int = 0  # span prefills sent
    span_tokens: int = 0  # laid-out span tokens of the indexed documents
    doc_tokens: int = 0
    saved_blocks: int = 0  # blocks the engine saved into the store during this run
    engine_start_s: float = 0.0
    wall_s: float = 0.0  # indexing only (engine start excluded), disk writes included
    tokens_per_s: float = 0.0
    baseline_prefill_tokens_per_s: float | None = None  # plain prefills, same engine
    store_entries: int = 0
    store_bytes: int = 0
    store_bytes_per_token: float | None = None
    kv_bytes_per_token: float | None = None  # the engine's KV page bytes per token
    error: str | None = None


@dataclass
class _Prepared:
    doc: Document
    prompt: Any  # BuiltPrompt
    keys: tuple[str, ...]
    tokens: int
    doc_tokens: int


def _prepare(orc: Orchestrator, doc: Document, mode: str) -> _Prepared | str:
    """The document laid out as the SDK lays it out, or why it cannot be a span."""
    from minipic.orchestrator.errors import MinipicError

    try:
        prompt = orc.build("?", [doc.text], None, mode, max_tokens=1)
    except MinipicError as exc:
        return type(exc).__name__
    spans = [s for s in prompt.spans if s.kind == "span"]
    if not spans:
        return "empty"
    keys = tuple(s.prefill_key for s in spans if s.prefill_key is not None)
    by_key = dict(zip(prompt.prefill_keys, prompt.span_prefills, strict=True))
    tokens = sum(len(by_key[k]) for k in keys)
    return _Prepared(doc, prompt, keys, tokens, sum(s.token_count for s in spans))


def _batches(docs: Sequence[Document], orc: Orchestrator, mode: str, size: int,
             report: IndexReport) -> Iterator[list[_Prepared]]:
    """Prepared documents in batches of ``size`` (fewer when their blocks would overflow the
    store writer's queue); unindexable ones counted in ``report.skipped``."""
    block = orc.builder.span_config.block_size
    batch: list[_Prepared] = []
    blocks = 0
    for doc in docs:
        prepared = _prepare(orc, doc, mode)
        if isinstance(prepared, str):
            report.skipped[prepared] = report.skipped.get(prepared, 0) + 1
            continue
        n = prepared.tokens // block
        if batch and (len(batch) >= size or blocks + n > MAX_BATCH_BLOCKS):
            yield batch
            batch, blocks = [], 0
        batch.append(prepared)
        blocks += n
    if batch:
        yield batch


async def index_documents(
    orc: Orchestrator, probe: Probe, docs: Sequence[Document], store_dir: Path, *,
    mode: str, salt: str | None, batch: int, force: bool, report: IndexReport,
    console: Console | None = None, baseline: bool = True,
) -> IndexReport:
    """Prefill the documents' spans into the store, batch by batch, recording each finished
    batch in the manifest. Fills ``report`` as it goes (also when interrupted)."""
    from minipic.orchestrator.span_index import append_records

    await probe.counts()  # learns the fingerprint
    fingerprint = report.fingerprint = probe.fingerprint
    sdigest = salt_digest(salt)
    done = set() if force else {r.resume_key() for r in read_manifest(store_dir)}
    todo = [d for d in docs if (d.digest, fingerprint, mode, sdigest) not in done]
    report.documents, report.already_indexed = len(docs), len(docs) - len(todo)
    block = orc.builder.span_config.block_size
    timed: list[list[int]] = []
    started = time.perf_counter()
    saved_before = (await probe.counts()).get("saved_blocks", 0)
    with _progress(console, len(todo)) as advance:
        for group in _batches(todo, orc, mode, batch, report):
            before = (await probe.counts()).get("saved_blocks", 0)
            sent = await asyncio.gather(*(orc.scheduler.prewarm(p.prompt, salt) for p in group))
            report.prefills += sum(sent)
            saved = (await probe.counts()).get("saved_blocks", 0) - before
            problem = await probe.durable(saved)
            tokens = sum(p.tokens for p in group)
            if problem is not None:
                report.unrecorded += len(group)
                if console is not None:
                    console.print(f"[yellow]batch not recorded[/]: {problem}; a rerun "
                                  "indexes it again", highlight=False)
                if "writes are off" in problem:
                    raise RuntimeError(problem)
            else:
                append_records(store_dir, (ManifestRecord(
                    doc=p.doc.digest, id=p.doc.id, fingerprint=fingerprint, mode=mode,
                    salt=sdigest, prefill_keys=p.keys, tokens=p.tokens, doc_tokens=p.doc_tokens,
                    blocks=p.tokens // block) for p in group))
                report.indexed += len(group)
                report.span_tokens += tokens
                report.doc_tokens += sum(p.doc_tokens for p in group)
            if len(timed) < BASELINE_BATCHES * batch:
                timed.extend(_plain_ids(p, orc) for p in group)
            report.wall_s = time.perf_counter() - started
            advance(len(group), report)
    report.saved_blocks = (await probe.counts()).get("saved_blocks", 0) - saved_before
    report.evicted_blocks = int(getattr(probe, "last", {}).get("evictions", 0))
    report.wall_s = time.perf_counter() - started
    report.tokens_per_s = report.span_tokens / report.wall_s if report.wall_s else 0.0
    if baseline and timed:
        report.baseline_prefill_tokens_per_s = await _baseline(orc, timed, batch)
    return report


def _plain_ids(prepared: _Prepared, orc: Orchestrator) -> list[int]:
    """The document's tokens with no span markers: an ordinary prompt, which the store never
    keeps (no SSEP, no span chain)."""
    cfg = orc.builder.span_config
    markers = {cfg.ssep_id, cfg.pdep_id, cfg.pad_id}
    by_key = dict(zip(prepared.prompt.prefill_keys, prepared.prompt.span_prefills, strict=True))
    return [t for k in prepared.keys for t in by_key[k] if t not in markers]


async def _baseline(orc: Orchestrator, prompts: list[list[int]], batch: int) -> float | None:
    """The engine's plain prefill rate on the same documents, in the same batches, under a
    fresh salt (nothing cached): what indexing costs beyond computing the KV."""
    from minipic.orchestrator.backends import Sampling

    salt = f"minipic-index-baseline-{uuid.uuid4().hex}"
    sampling = Sampling(max_tokens=1)
    started = time.perf_counter()
    for i in range(0, len(prompts), batch):
        await asyncio.gather(*(orc.backend.generate(ids, sampling=sampling, cache_salt=salt)
                               for ids in prompts[i:i + batch] if ids))
    wall = time.perf_counter() - started
    return sum(len(p) for p in prompts) / wall if wall else None


class _progress:
    """A rich progress bar over the documents (nothing without a console)."""

    def __init__(self, console: Console | None, total: int) -> None:
        self.console, self.total = console, total
        self.bar: Any = None

    def __enter__(self) -> Any:
        if self.console is None:
            return lambda n, report: None
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.bar = Progress(TextColumn("indexing"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
                            TimeRemainingColumn(), console=self.console)
        task = self.bar.add_task("indexing", total=self.total, rate="")
        self.bar.start()

        def advance(n: int, report: IndexReport) -> None:
            rate = report.span_tokens / report.wall_s if report.wall_s else 0.0
            self.bar.update(task, advance=n, rate=f"{rate:,.0f} tok/s")

        return advance

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def finish_report(report: IndexReport, store_dir: Path, block_size: int) -> IndexReport:
    """Store size from the directory itself: what any later engine will find there."""
    report.store_entries, report.store_bytes = store_usage(store_dir)
    if report.store_entries:
        report.store_bytes_per_token = report.store_bytes / (report.store_entries * block_size)
    payload = block_payload_bytes(store_dir)
    if payload is not None:
        report.kv_bytes_per_token = payload / block_size
    return report
