"""``minipic index CORPUS``: precompute a corpus's span KV into a span store.

Why: the first question on a document pays its span prefill, and a restarted server starts
cold. Indexed, every document's span blocks are in the store before the first question, and an
orchestrator started on the store sends no prefill for them: the final prompt loads them
(``engine_ext/span_store``; the engine counts them as cached tokens).

How, so that later finals hit: each document goes through the SDK's own path — the
orchestrator's ``PromptBuilder`` lays it out as a span, and the scheduler's ``prewarm`` (what
``Orchestrator.warm`` runs) sends its span prefill, under the same cache salt and mode the app
uses. The engine saves every full span block it computes into the store. The system prompt does
not enter a span's KV (spans are SSEP-led and attend only within themselves; the system span
is an ordinary prefix, which the store does not keep), so it is no option here; the layout
mode is (``boundary_recompute`` stores a span's body without its opening).

Resumable: a batch is recorded in the store's manifest (``orchestrator.span_index``) only
after the store's writer has put the batch's blocks on disk (the worker's store is flushed
through a vLLM worker extension, ``IndexWorkerExtension``), so a rerun skips exactly the
documents whose blocks are durable, and a ``SIGKILL`` at any moment leaves no manifest line for
blocks that are not on disk. The store's own files are crash-safe on their own (``tiers``: a
killed writer leaves only a temp file no reader opens).

``--url`` indexes through a running ``minipic serve --span-store``: the same path over HTTP;
there the batch's blocks are known durable once the store directory holds as many new entries
as the server reports saved (poll, bounded), so the directory must be readable here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.span_index import ManifestRecord, document_digest, read_manifest, salt_digest
from span_contract.errors import BadInputError
from span_contract.span_store_config import default_store_dir

if TYPE_CHECKING:
    from rich.console import Console

    from orchestrator import Orchestrator

WIKI = "wiki"
TEXT_SUFFIXES = (".txt", ".md")
DEFAULT_TITLE_FORMAT = "{title}: {text}"  # orchestrator.corpus.Passage.as_document
# a batch's blocks stay below the store writer's queue (256 entries): a full queue drops saves
MAX_BATCH_BLOCKS = 128
FLUSH_METHOD = "minipic_index_flush"
DURABLE_TIMEOUT_S = 120.0
BASELINE_BATCHES = 2  # prefills timed for the engine's plain prefill rate
CHILD_ENV = "MINIPIC_INDEX_CHILD"  # "1": this process is the supervised indexer


class CorpusError(BadInputError):
    """The corpus cannot be read (missing, empty, malformed): said before any engine starts."""


@dataclass(frozen=True)
class Document:
    text: str  # exactly what the app passes as the document
    id: str | None
    digest: str


# -- corpus -------------------------------------------------------------------------------------


def load_corpus(spec: str, title_format: str = DEFAULT_TITLE_FORMAT) -> list[Document]:
    """Documents of a JSONL file, a folder of text files, or ``wiki`` (the offline corpus)."""
    if spec == WIKI:
        return _wiki_documents()
    path = Path(spec).expanduser()
    if not path.exists():
        raise CorpusError(f"corpus {spec!r} does not exist (a .jsonl file, a folder of "
                          f"{'/'.join(TEXT_SUFFIXES)} files, or `{WIKI}`)")
    docs = list(_folder_documents(path) if path.is_dir() else _jsonl_documents(path,
                                                                               title_format))
    if not docs:
        what = f"no {'/'.join(TEXT_SUFFIXES)} files" if path.is_dir() else "no documents"
        raise CorpusError(f"corpus {spec!r} holds {what}")
    return docs


def _doc(text: str, doc_id: str | None) -> Document:
    return Document(text, doc_id, document_digest(text))


def _wiki_documents() -> list[Document]:
    from orchestrator.corpus import CorpusUnavailableError, load_passages

    try:
        passages = load_passages()
    except CorpusUnavailableError as exc:
        raise CorpusError(str(exc)) from None
    # as the demo and WikiRetriever pass them
    return [_doc(p.as_document, f"wiki:{p.title}") for p in passages]


def _folder_documents(root: Path) -> Iterator[Document]:
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES
                   and not any(part.startswith(".") for part in p.relative_to(root).parts))
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise CorpusError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})"
                              ) from None
        yield _doc(text, str(path.relative_to(root)))


def _jsonl_documents(path: Path, title_format: str) -> Iterator[Document]:
    try:
        handle = path.open(encoding="utf-8")
    except OSError as exc:
        raise CorpusError(f"cannot read {path}: {exc.strerror or exc}") from None
    with handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                item = json.loads(line)
            except ValueError as exc:
                raise CorpusError(f"{where}: not JSON ({exc})") from None
            if not isinstance(item, dict) or not isinstance(item.get("text"), str):
                raise CorpusError(f'{where}: expected an object with a "text" string, e.g. '
                                  '{"text": "...", "title": "...", "id": "..."}')
            title = item.get("title")
            if title is not None and not isinstance(title, str):
                raise CorpusError(f'{where}: "title" must be a string')
            raw_id = item.get("id")
            doc_id = None if raw_id is None else str(raw_id)
            text = item["text"]
            if title:
                text = title_format.format(title=title, text=text)
            yield _doc(text, doc_id)


# -- the engine side ----------------------------------------------------------------------------


class IndexWorkerExtension:
    """Mixed into the index engine's worker (vLLM's ``worker_extension_cls``, an extension
    point): lets the index wait until the worker's span store has written what it was given.

    Why: the store writes off the engine's step (a background writer per tier); a manifest line
    written before its blocks are on disk would make a rerun skip a document the store lost.
    """

    def minipic_index_flush(self, timeout_s: float) -> dict[str, Any]:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group():
            return {}
        pages = getattr(get_kv_transfer_group(), "pages", None)
        store = getattr(pages, "store", None)
        if store is None:
            return {}
        store.flush(timeout_s)
        stats = store.stats()
        tiers = stats.get("tiers") or {}
        return {
            "tiers": len(tiers),
            "pending_writes": int(stats.get("pending_writes", 0)),
            "skipped_queue_full": int(stats.get("skipped_queue_full", 0)),
            "writer_errors": int(stats.get("writer_errors", 0)),
            "write_errors": sum(int(t.get("write_errors", 0)) for t in tiers.values()),
            "writes_enabled": all(bool(t.get("writes_enabled", True)) for t in tiers.values()),
            "evictions": sum(int(t.get("evictions", 0)) for t in tiers.values()),
            "kv_bytes_per_block": int(pages.page_bytes) * len(pages.caches),
        }


class _Probe:
    """What the index asks of the engine besides prefills: its store counters, and when a
    batch's blocks are on disk."""

    fingerprint: str = ""

    async def counts(self) -> dict[str, int]:
        raise NotImplementedError

    async def durable(self, new_blocks: int) -> str | None:
        """Wait until the batch's saves are on disk; None, or why they may not be."""
        raise NotImplementedError


class _EmbeddedProbe(_Probe):
    def __init__(self, orc: Orchestrator) -> None:
        self.backend: Any = orc.backend  # not the engine: close() must be able to free it
        self.last: dict[str, Any] = {}

    @property
    def engine(self) -> Any:
        return self.backend.engine

    async def stats(self) -> dict[str, Any]:
        from engine_ext.span_store.stats import STATS_METHOD

        stats = await self.engine.engine_core.call_utility_async(STATS_METHOD)
        if not stats:
            raise RuntimeError("the engine runs no span store")
        self.fingerprint = str(stats["fingerprint"])
        return stats

    async def counts(self) -> dict[str, int]:
        return dict((await self.stats())["counts"])

    async def durable(self, new_blocks: int) -> str | None:
        (flushed,) = await self.engine.collective_rpc(FLUSH_METHOD, args=(DURABLE_TIMEOUT_S,))
        before, self.last = self.last, flushed
        if flushed.get("tiers", 1) == 0:
            return ("the store's writes are off: it has no usable directory (its secret could "
                    "not be read or created, or the weights are unknown; see the engine log)")
        if not flushed.get("writes_enabled", True):
            return ("the store's writes are off for now: paused after a full, read-only or "
                    "forbidden disk (see the engine log)")
        if flushed.get("pending_writes", 0):
            return f"{flushed['pending_writes']} writes still pending after {DURABLE_TIMEOUT_S} s"
        for key in ("skipped_queue_full", "write_errors", "writer_errors"):
            if flushed.get(key, 0) > before.get(key, 0):
                return f"the store dropped writes ({key})"
        return None


class _HttpProbe(_Probe):
    def __init__(self, orc: Orchestrator, store_dir: Path) -> None:
        self.base_url = orc.backend.base_url  # type: ignore[attr-defined]
        # the server's API key, when the client has one: /minipic/config asks for it too
        self.headers = dict(getattr(orc.backend, "_headers", None) or {})
        self.store_dir = store_dir
        self.entries = store_usage(store_dir)[0]

    async def stats(self) -> dict[str, Any]:
        import httpx

        from orchestrator.http_backend import CONFIG_PATH

        async with httpx.AsyncClient(base_url=self.base_url, timeout=30,
                                     headers=self.headers) as client:
            reply = await client.get(CONFIG_PATH)
        reply.raise_for_status()
        stats = reply.json().get("span_store")
        if not stats:
            raise RuntimeError(f"{self.base_url} runs no span store (minipic serve "
                               "--span-store DIR)")
        self.fingerprint = str(stats["fingerprint"])
        return stats

    async def counts(self) -> dict[str, int]:
        return dict((await self.stats())["counts"])

    async def durable(self, new_blocks: int) -> str | None:
        want = self.entries + new_blocks
        deadline = time.monotonic() + DURABLE_TIMEOUT_S
        while True:
            now = (await asyncio.to_thread(store_usage, self.store_dir))[0]
            if now >= want:
                self.entries = now
                return None
            if time.monotonic() > deadline:
                self.entries = now
                return (f"{want - now} of {new_blocks} saved blocks not in {self.store_dir} "
                        f"after {DURABLE_TIMEOUT_S} s (another store directory, or evicted?)")
            await asyncio.sleep(0.01)


def store_usage(store_dir: Path) -> tuple[int, int]:
    """``(entries, bytes)`` of the span-store entry files in a directory (temp files and the
    manifest excluded; not verified)."""
    from engine_ext.span_store.tiers import SUFFIX, TEMP_PREFIX

    entries = size = 0
    try:
        shards = list(os.scandir(store_dir))
    except OSError:
        return 0, 0
    for shard in shards:
        if shard.name.startswith(".") or not shard.is_dir(follow_symlinks=False):
            continue
        try:
            items = list(os.scandir(shard.path))
        except OSError:
            continue
        for item in items:
            if item.name.endswith(SUFFIX) and not item.name.startswith(TEMP_PREFIX):
                try:
                    size += item.stat(follow_symlinks=False).st_size
                except OSError:
                    continue
                entries += 1
    return entries, size


def _payload_bytes(store_dir: Path) -> int | None:
    """KV bytes of one stored block (an entry's payload length, from its header)."""
    from engine_ext.span_store.tiers import HEADER, SUFFIX

    for shard in sorted(store_dir.glob("??")):
        for path in shard.glob(f"*{SUFFIX}"):
            try:
                with path.open("rb") as fh:
                    head = fh.read(HEADER.size)
            except OSError:
                continue
            if len(head) == HEADER.size:
                return int(HEADER.unpack(head)[4])
    return None


# -- indexing -----------------------------------------------------------------------------------


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
    from orchestrator.errors import MinipicError

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
    orc: Orchestrator, probe: _Probe, docs: Sequence[Document], store_dir: Path, *,
    mode: str, salt: str | None, batch: int, force: bool, report: IndexReport,
    console: Console | None = None, baseline: bool = True,
) -> IndexReport:
    """Prefill the documents' spans into the store, batch by batch, recording each finished
    batch in the manifest. Fills ``report`` as it goes (also when interrupted)."""
    from orchestrator.span_index import append_records

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
    from orchestrator.backends import Sampling

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
    payload = _payload_bytes(store_dir)
    if payload is not None:
        report.kv_bytes_per_token = payload / block_size
    return report


# -- command line -------------------------------------------------------------------------------


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
    from serving.supervise import supervise

    argv = [sys.executable, "-m", "minipic.cli", *args.argv]
    return supervise(argv, {**os.environ, CHILD_ENV: "1"})


async def _run(args: argparse.Namespace, docs: list[Document], console: Console
               ) -> IndexReport:
    from orchestrator import MinipicError, Orchestrator

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
        probe: _Probe = _HttpProbe(orc, store)
    else:
        from span_contract.span_store_config import SpanStoreConfig

        store = store or default_store_dir()
        store.mkdir(parents=True, exist_ok=True)
        orc = Orchestrator.embedded(
            args.model, options=options, learn_stored_spans=False, block_size=args.block_size,
            max_model_len=args.max_model_len, use_tqdm_on_load=args.verbose,
            # no RAM tier: this process ends when the corpus is done; the disk is the point
            span_store=SpanStoreConfig(dir=str(store), ram_mib=0, disk_gib=args.disk_gib),
            worker_extension_cls="minipic.index.IndexWorkerExtension")
        probe = _EmbeddedProbe(orc)
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
