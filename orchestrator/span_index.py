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
of another configuration sharing the directory are never learned.

Tenants' salts: a record needs its salt's identity (a span warmed under one salt is cold under
another), but a plain hash of a salt lets whoever reads the file test guesses (a salt is often a
tenant's name). So a record holds the salt's digest *sealed* under the store's index key
(``.index-key`` beside the manifest, 32 random bytes, 0600, created with the first salted
record): a fresh nonce and the digest XOR-ed with HMAC-SHA256(key, nonce). Without the key the
file says nothing about any salt, and two records of one tenant do not even look alike; the
orchestrator and ``minipic index``, which read the key, get the digest back (``salt_digest``,
never written). A lost key costs the salted beliefs, nothing else.

Bounded: an append that takes the file past ``MAX_MANIFEST_BYTES`` rewrites it (under an
``flock`` every appender takes, to a temp file renamed over it) with one record per document --
the newest -- and only the newest records, up to half the bound. A record is a belief: dropping
an old one costs at most one cold prompt or a re-index, and the bounded store has long evicted
most of what very old records name. Opens never follow a symlink and never wait on a FIFO:
anything but a regular file at the manifest's or key's name is refused.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import hmac
import logging
import os
import secrets
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

logger = logging.getLogger("minipic.span_index")

MANIFEST_NAME = "index-manifest.jsonl"
INDEX_KEY_NAME = ".index-key"
# 2: salts sealed under the index key; 1: plain salt digests (still read, sealed when rewritten)
MANIFEST_VERSION = 2
MAX_MANIFEST_BYTES = 16 << 20
_KEY_BYTES = 32
_SEAL_PREFIX = "s2:"
_NOFOLLOW = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def salt_digest(salt: str | None) -> str | None:
    """What the registry's stored beliefs hold instead of a cache salt (the manifest holds it
    sealed under the store's index key: the module docstring)."""
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
    """Every complete record, salts unsealed (a torn or foreign line, or a salted record whose
    key is missing, is skipped, never an error; so is a manifest that is no regular file)."""
    path = manifest_path(store_dir)
    data = _read_regular(path)
    if not data:
        return
    key = _index_key(Path(store_dir), create=False)
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break  # a torn tail: the append it belonged to never finished
        record = _parse(line, key)
        if record is not None:
            yield record


def append_records(store_dir: str | os.PathLike[str], records: Iterable[ManifestRecord], *,
                   max_bytes: int | None = None) -> int:
    """Append records with one write (then fsync); returns how many. Starts on a fresh line
    when an earlier append was torn, so a torn line never swallows a complete one; rewrites the
    file when it grows past ``max_bytes`` (None: ``MAX_MANIFEST_BYTES``; module docstring).
    Raises ``OSError`` when the manifest's name holds anything but a regular file."""
    records = list(records)
    if not records:
        return 0
    path = manifest_path(store_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = _index_key(path.parent, create=any(r.salt is not None for r in records))
    if key is None and any(r.salt is not None for r in records):
        raise OSError(errno.EACCES, f"cannot read or create {path.parent / INDEX_KEY_NAME} "
                                    f"(32 random bytes) to seal the salts with")
    data = b"".join(_dump(r, key) for r in records)
    fd = _open_locked(path)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        bound = MAX_MANIFEST_BYTES if max_bytes is None else max_bytes
        if size + len(data) > bound:
            _compact(path, fd, key, bound // 2)
    finally:
        os.close(fd)  # releases the lock
    return len(records)


def _read_regular(path: Path) -> bytes | None:
    """The bytes of the regular file at ``path``; None when it is missing, unreadable, or a
    symlink, FIFO, folder or device (refused without following or waiting on it)."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            logger.warning("span index: %s is a symlink; not read", path)
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            logger.warning("span index: %s is not a regular file; not read", path)
            return None
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def _open_locked(path: Path) -> int:
    """The manifest open for appending (created private, like the store's entries: it lists
    which documents the store holds), under an exclusive ``flock``; reopened when a rewrite
    replaced the file while we waited for the lock."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | _NOFOLLOW, 0o600)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, f"{path} is not a regular file")
            fcntl.flock(fd, fcntl.LOCK_EX)
            now = os.lstat(path)
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _compact(path: Path, fd: int, key: bytes | None, budget: int) -> None:
    """Under the lock held on ``fd``: rewrite the manifest with the newest record of each
    document, newest first up to ``budget`` bytes, salts sealed anew."""
    size = os.fstat(fd).st_size
    data = os.pread(fd, size, 0)
    newest: dict[tuple[str, str, str, str | None], bytes] = {}
    for line in reversed(data.splitlines(keepends=True)):
        record = _parse(line, key) if line.endswith(b"\n") else None
        if record is None or record.resume_key() in newest:
            continue
        if key is None and record.salt is not None:
            key = _index_key(path.parent, create=True)
        newest[record.resume_key()] = _dump(record, key)
    kept: list[bytes] = []
    total = 0
    for line in newest.values():  # newest first
        if total + len(line) > budget:
            break
        kept.append(line)
        total += len(line)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(out, b"".join(reversed(kept)))
        os.fsync(out)
        os.replace(tmp, path)
    finally:
        os.close(out)
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _parse(line: bytes, key: bytes | None) -> ManifestRecord | None:
    """A record from one line with its salt unsealed; None for what is not one of ours (a
    salted record whose seal does not open under ``key`` included)."""
    try:
        record = ManifestRecord.model_validate_json(line)
    except (ValidationError, ValueError):
        return None
    if record.v not in (1, MANIFEST_VERSION):
        return None
    if record.v == 1 or record.salt is None:
        return record.model_copy(update={"v": MANIFEST_VERSION})
    salt = _unseal(record.salt, key)
    return None if salt is None else record.model_copy(update={"salt": salt})


def _dump(record: ManifestRecord, key: bytes | None) -> bytes:
    """One line for ``record``, its salt digest sealed under ``key``."""
    if record.salt is not None:
        assert key is not None, "a salted record needs the index key"
        record = record.model_copy(update={"salt": _seal(record.salt, key)})
    return record.model_copy(update={"v": MANIFEST_VERSION}).model_dump_json().encode() + b"\n"


def _pad(key: bytes, nonce: bytes, size: int) -> bytes:
    return hmac.new(key, b"minipic-manifest-salt\0" + nonce, hashlib.sha256).digest()[:size]


def _seal(digest: str, key: bytes) -> str:
    plain = bytes.fromhex(digest)
    nonce = secrets.token_bytes(16)
    return _SEAL_PREFIX + nonce.hex() + bytes(
        a ^ b for a, b in zip(plain, _pad(key, nonce, len(plain)), strict=True)).hex()


def _unseal(sealed: str, key: bytes | None) -> str | None:
    if key is None or not sealed.startswith(_SEAL_PREFIX):
        return None
    try:
        raw = bytes.fromhex(sealed[len(_SEAL_PREFIX):])
    except ValueError:
        return None
    nonce, body = raw[:16], raw[16:]
    if len(nonce) != 16 or not body or len(body) > 32:
        return None
    return bytes(a ^ b for a, b in zip(body, _pad(key, nonce, len(body)), strict=True)).hex()


def _index_key(store_dir: Path, *, create: bool) -> bytes | None:
    """The store's index key (module docstring); created when missing if ``create``. None
    when it is missing (and not created), unreadable or not a 32-byte regular file."""
    path = store_dir / INDEX_KEY_NAME
    for _ in range(2):
        data = _read_regular(path)
        if data is not None:
            return data if len(data) == _KEY_BYTES else None
        if not create or os.path.lexists(path):
            return None
        tmp = store_dir / f"{INDEX_KEY_NAME}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, secrets.token_bytes(_KEY_BYTES))
            os.fsync(fd)
            with contextlib.suppress(FileExistsError):  # another appender published first
                os.link(tmp, path)
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return None


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
