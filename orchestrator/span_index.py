"""The span store's index manifest: which span prefills ``minipic index`` put into a store.

Why a manifest and not a question to the store: the store's index lives in the engine process
(its scheduler-side lookup and the worker's tiers), keys are block hashes mixed with the
engine's root hash, and a client cannot compute them. The client only needs a cheap local
answer to "would this span prefill be wasted?" before it sends one, so ``minipic index`` appends
one line per indexed document to ``<store dir>/index-manifest.jsonl`` naming the prefill keys
the SDK uses for that document (``prompt_builder.spans.prefill_key``: the laid-out ids of
``[SSEP doc PAD...]``) once the store has those blocks on disk. An orchestrator started on the
store reads it (``Orchestrator.learn_stored_spans``) and its warmth registry treats those spans
as warm, so ``answer()`` sends no prefill for them; the final prompt then loads their blocks
from the store (the engine counts them as cached tokens).

A belief, like every warmth belief (``orchestrator.warmth``): the store is bounded and may
evict, be deleted or be corrupted. A wrong belief costs one cold final prompt, never a wrong
answer (the engine computes a missing span in isolation inside the final, and saves it), and
the final's cached-token count corrects it.

Format: JSON Lines, one record per document, appended per finished batch with one ``write``
and an ``fsync``. A line is complete or unparseable (a ``SIGKILL`` mid-append can only leave a
torn last line, which readers skip and the next append starts after). Each record carries the
engine's store fingerprint (model weights, dtype, block size, span ids, page layout): records
of another configuration sharing the directory are never learned. Salts are stored as digests,
so the manifest does not name the tenants' salts.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

logger = logging.getLogger("minipic.span_index")

MANIFEST_NAME = "index-manifest.jsonl"
MANIFEST_VERSION = 1


def salt_digest(salt: str | None) -> str | None:
    """What the manifest and the registry's stored beliefs hold instead of a cache salt."""
    if salt is None:
        return None
    return hashlib.sha256(b"minipic-salt-v1:" + salt.encode("utf-8")).hexdigest()[:32]


def document_digest(text: str) -> str:
    """A document's identity for resuming: its text (before tokenization; cheap to recompute
    for a whole corpus, unlike token ids)."""
    return hashlib.sha256(b"minipic-doc-v1:" + text.encode("utf-8")).hexdigest()[:32]


class ManifestRecord(BaseModel):
    """One indexed document."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    v: int = MANIFEST_VERSION
    doc: str  # document_digest of the text the app passes as the document
    id: str | None = None  # the corpus's id for it (for people reading the file)
    fingerprint: str  # the engine's span-store fingerprint
    mode: str  # the prompt layout the prefill keys are for
    salt: str | None = None  # salt_digest of the cache salt
    prefill_keys: tuple[str, ...] = ()  # the SDK's keys of this document's span prefills
    tokens: int = 0  # laid-out span tokens (SSEP + document + padding), all in full blocks
    doc_tokens: int = 0  # the document's own tokens
    blocks: int = 0  # span blocks the prefills cover

    def resume_key(self) -> tuple[str, str, str, str | None]:
        return (self.doc, self.fingerprint, self.mode, self.salt)


def manifest_path(store_dir: str | os.PathLike[str]) -> Path:
    return Path(store_dir) / MANIFEST_NAME


def read_manifest(store_dir: str | os.PathLike[str]) -> Iterator[ManifestRecord]:
    """Every complete record (a torn or foreign line is skipped, never an error)."""
    path = manifest_path(store_dir)
    try:
        handle = path.open("rb")
    except OSError:
        return
    with handle:
        for line in handle:
            if not line.endswith(b"\n"):
                break  # a torn tail: the append it belonged to never finished
            try:
                record = ManifestRecord.model_validate_json(line)
            except (ValidationError, ValueError):
                continue
            if record.v == MANIFEST_VERSION:
                yield record


def append_records(store_dir: str | os.PathLike[str], records: Iterable[ManifestRecord]) -> int:
    """Append records with one write (then fsync); returns how many. Starts on a fresh line
    when an earlier append was torn, so a torn line never swallows a complete one."""
    lines = [r.model_dump_json().encode() + b"\n" for r in records]
    if not lines:
        return 0
    path = manifest_path(store_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    # private like the store's entries: it lists which documents the store holds
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        size = os.fstat(fd).st_size
        data = b"".join(lines)
        if size:
            with path.open("rb") as fh:
                fh.seek(size - 1)
                if fh.read(1) != b"\n":
                    data = b"\n" + data
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    return len(lines)


def stored_warm_keys(store_dirs: Iterable[str | os.PathLike[str]], fingerprint: str
                     ) -> set[tuple[str | None, str]]:
    """``(salt digest, prefill key)`` of every span the manifests of ``store_dirs`` list for
    this engine configuration."""
    keys: set[tuple[str | None, str]] = set()
    foreign = 0
    for store_dir in store_dirs:
        for record in read_manifest(store_dir):
            if record.fingerprint != fingerprint:
                foreign += 1
                continue
            keys.update((record.salt, key) for key in record.prefill_keys)
    if foreign:
        logger.info("span index: %d manifest records were written for another model or "
                    "config; not learned", foreign)
    return keys


def embedded_fingerprint(backend: Any) -> str | None:
    """The span-store fingerprint of an in-process engine, computed here from the engine's
    ``VllmConfig`` exactly as its KV connector computes it (no call into the engine: the
    orchestrator's event loop is not running yet when it starts)."""
    settings = getattr(backend, "settings", None)
    engine = getattr(backend, "engine", None)
    store = getattr(settings, "span_store", None)
    if store is None or engine is None:
        return None
    from minipic.span_contract.span_store_config import config_fingerprint

    return config_fingerprint(engine.vllm_config, store.weights_digest, settings.span_config)
