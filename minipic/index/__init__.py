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

Modules: ``corpus`` (the documents), ``engine_probe`` (the worker extension and what the index
asks of the engine or server), ``runner`` (batches, the manifest, the report), ``cli`` (the
command line).
"""

from minipic.index.cli import add_subparser, run
from minipic.index.corpus import DEFAULT_TITLE_FORMAT, WIKI, CorpusError, Document, load_corpus
from minipic.index.engine_probe import IndexWorkerExtension, store_usage
from minipic.index.runner import IndexReport, finish_report, index_documents

__all__ = [
    "DEFAULT_TITLE_FORMAT",
    "WIKI",
    "CorpusError",
    "Document",
    "IndexReport",
    "IndexWorkerExtension",
    "add_subparser",
    "finish_report",
    "index_documents",
    "load_corpus",
    "run",
    "store_usage",
]
