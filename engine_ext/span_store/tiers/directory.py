"""The persistent tier: one file per entry in a directory, bounded, LRU-evicting and crash-safe.

It is the embedded default (a local disk) and also the shared tier for several replicas or
nodes (the same directory on a shared mount). The bytes of an entry file are ``format``'s; how
the tier touches the filesystem without trusting it (modes, no-follow opens, the MAC) is
``files``'; the store's secret, ``secret``'s; when writes resume after a fault, ``backoff``'s.

**Why a shared directory and not Redis/Valkey for replicas.** It needs no extra server to run,
configure, secure or monitor; it works on one node (several ``minipic serve`` replicas on one
disk) and across nodes on any shared mount that offers atomic rename/link (NFS, CephFS, Lustre,
a cloud file share). Entries are written once and never modified, which is exactly what such
mounts handle well. A Redis tier would implement the same ``has/get/put`` and can be added as
another tier later; the connector does not care which tier answered.

**Crash safety.** A writer creates a uniquely named temp file (``.tmp.<host>.<pid>.<rand>.<key>``)
in the entry's shard folder, holds an ``flock`` on it, writes, fsyncs and then *links* it to the
final name (``os.link``: atomic, and it fails if the name exists — so the first complete entry
wins and two replicas writing the same block leave exactly one; filesystems without hard links
fall back to ``os.replace``). A final name therefore only ever points at a complete, fsynced file;
a killed writer leaves only a temp file, which no reader opens (readers derive paths from keys,
and keys never start with a dot). Every read verifies magic, version, fingerprint, lengths and
digest, so even a file damaged after the fact reads as a miss, never as KV.

Stray temp files are removed at startup (and at each rescan) when no live writer can own them:
the file is not ``flock``-ed by anyone and either its writer's pid is dead on this host or it is
older than ``stale_temp_s`` (a writer on another node whose lock this mount does not show is
still protected by the age rule).

**Shared-directory semantics.** The size bound holds for the folder, whatever the number of
processes writing into it (TP ranks, replicas, ``minipic index``): every write reserves its
bytes in the folder's ledger first, evicting least recently used entries to make room, and a
write that would leave the disk's free space below a floor pauses writes (``folder_usage``).
``has`` answers from memory, never from the filesystem (``dir_index``: what it knows, the
scans that refresh it, eviction). LRU order is the file mtime (set with nanosecond precision on
write and on every hit, so recency is shared between processes). Removing a file another
process is reading is safe on POSIX (its open file stays readable); on NFS that reader may get
``ESTALE``, which is a miss. A read refuses, before reading a byte, any file larger than the
largest entry this engine writes (``bound_entries``): a planted sparse file costs nothing.

An entry whose fingerprint is not the tier's (another model or config sharing the directory —
keys normally already differ, so this is rare) is a miss and is **left in place**: it is valid
data of someone else, deleting it would make two configurations on one directory destroy each
other's stores. It ages out through LRU like anything nobody reads (until then that key
stays a miss for us: ``put`` never overwrites an existing file). A newer format version
(a newer minipic sharing the directory) is kept for the same reason. Corrupt, truncated or
foreign-format files are removed. Each reason is logged once per tier (logger
``vllm.minipic.span_store``), and the startup scan samples headers and says once if the
directory holds another configuration's entries.

**The secret can change under a running process** (a rotation: ``secret`` says how it is
noticed and adopted, and why a bad look at the file keeps the last good one). Entries under the
old secret become misses left in place (``other_key``). The first ``put`` of a block whose name
holds an entry under a key id neither ours nor the file's (read just before) replaces it, the
one overwrite ``put`` does: keys do not name the secret, so the old entry would otherwise keep
that block a miss until LRU evicted it.

**Faults never reach the caller.** A full or read-only disk (``ENOSPC``, ``EROFS``, ``EACCES``,
``EPERM``, ``EDQUOT``) pauses the tier's writes with a warning, for 1 s, then 2 s, 4 s ... up to
5 minutes (``backoff``); the first write after a pause is a probe, and when it succeeds
writing resumes (logged, and counted as ``write_pauses`` / ``writes_resumed``). Reads keep
working throughout. A store directory deleted under a running process gives misses; the next
write recreates it (or, if it cannot, pauses writes the same way).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from minipic.engine_ext.span_store.tiers.backoff import WriteBackoff
from minipic.engine_ext.span_store.tiers.base import (
    KEPT_REASONS,
    RAM_SOURCE,
    REMOVED_REASONS,
    Entry,
    check_key,
    logger,
)
from minipic.engine_ext.span_store.tiers.dir_index import HOST_ID as _HOST_ID
from minipic.engine_ext.span_store.tiers.dir_index import DirIndex, foreign_sample
from minipic.engine_ext.span_store.tiers.files import (
    Modes,
    NotAnEntry,
    check_root,
    create_file,
    make_dir,
    open_entry,
    read_exactly,
    remove_entry_name,
)
from minipic.engine_ext.span_store.tiers.folder_usage import (
    USAGE_NAME,
    FolderUsage,
    free_space_floor,
)
from minipic.engine_ext.span_store.tiers.format import (
    FORMAT_VERSION,
    HEADER,
    SUFFIX,
    TEMP_PREFIX,
    encode_entry,
    read_entry,
    unpack_header,
)
from minipic.engine_ext.span_store.tiers.probe import MetadataProbe
from minipic.engine_ext.span_store.tiers.secret import SecretKeeper

# Write errors that mean "this disk takes no more writes": writes go off, reads continue.
_WRITES_OFF_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, getattr(errno, "EDQUOT", errno.ENOSPC)}
)
# link() errors meaning "this filesystem has no hard links" (fall back to rename).
_NO_LINK_ERRNOS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK,
                             errno.ENOSYS})
# how often reads and writes look at the secret file for a rotation (one lstat)
KEY_CHECK_INTERVAL_S = 1.0
# the largest entry file a tier reads or writes until told its engine's (``bound_entries``)
MAX_ENTRY_BYTES = 64 << 20
# an entry's metadata JSON is ~100 B; what ``bound_entries`` allows for it
META_ALLOWANCE = 4096


class _DirectoryVanished(OSError):
    """The store directory is gone and cannot be recreated."""


def _write_all(fd: int, parts: Sequence[bytes]) -> None:
    for part in parts:
        view = memoryview(part)
        while view:
            written = os.write(fd, view)
            view = view[written:]


def _fsync_dir(path: Path) -> None:
    """Make a new directory entry durable (best effort: some filesystems refuse dir fsync)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _publish(tmp: Path, final: Path) -> bool:
    """Give the complete temp file its final name; False if an entry is already there."""
    try:
        os.link(tmp, final)
        return True
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in _NO_LINK_ERRNOS:
            raise
    # no hard links here: rename. Two writers racing here each rename a complete file, so the
    # name still ends on one complete entry.
    if os.path.lexists(final):
        return False
    os.replace(tmp, final)
    return True


class DirTier:
    """Persistent tier on a directory: the local disk (default) or a directory shared by
    several replicas or nodes. See the module docstring for semantics, ``format`` for the
    files' bytes.

    ``has`` touches no file (``dir_index``); ``get`` reads and verifies the whole file (at
    most ``max_entry_bytes``); ``put`` reserves room in the folder (``folder_usage``), writes
    atomically and returns False when writes are paused or failed, or there is no room. No
    method raises for an I/O fault; an invalid key is a ``ValueError`` (a caller bug). A tier
    whose secret cannot be read when it starts (``secret``) is *unusable*: every lookup misses
    and nothing is written; a secret file that reads bad later pauses writes only.
    """

    def __init__(self, path: str | Path, capacity_bytes: int, fingerprint: str,
                 name: str = "disk", *, fsync: bool = True, stale_temp_s: float = 300.0,
                 rescan_interval_s: float = 300.0, header_sample: int = 64,
                 group_access: bool = False, group: int | str | None = None,
                 backoff: WriteBackoff | None = None, max_entry_bytes: int | None = None,
                 min_free_bytes: int | None = None, refresh_s: float = 10.0,
                 probe: MetadataProbe | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if not fingerprint:
            raise ValueError("a DirTier needs a non-empty config fingerprint")
        if not name or name == RAM_SOURCE:
            raise ValueError(f"invalid tier name {name!r}")
        self.path = Path(path)
        self.capacity_bytes = int(capacity_bytes)
        self.fingerprint = fingerprint
        self.name = name
        self.fsync = fsync
        self.stale_temp_s = stale_temp_s
        self.rescan_interval_s = rescan_interval_s
        self._fp = fingerprint.encode()
        if len(self._fp) > 0xFFFF:
            raise ValueError("fingerprint longer than 65535 bytes")
        self._lock = threading.Lock()
        self.modes = Modes.for_access(group_access, group)
        # the largest file a read opens (``bound_entries``), the free space writes leave
        # (None: 5% of the disk, at most 1 GiB), how often has() learns of others' entries
        self.max_entry_bytes = min(self.capacity_bytes, max_entry_bytes or MAX_ENTRY_BYTES)
        self.min_free_bytes = min_free_bytes
        self.refresh_s = refresh_s
        self._usage = FolderUsage(self.path, self.modes, _HOST_ID, stale_temp_s)
        self._idx = DirIndex(self.path, self._usage, stale_temp_s, self._count)
        self._probe = probe or MetadataProbe(name=f"span-store-probe-{name}")
        self._backoff = backoff or WriteBackoff()
        self._logged: set[str] = set()
        self._c = dict.fromkeys(
            ("hits", "misses", "corrupt_removed", "foreign_skipped", "read_errors", "writes",
             "already_present", "write_errors", "skipped_writes_off", "too_large", "evictions",
             "temps_removed", "write_pauses", "writes_resumed", "other_key_skipped",
             "key_changes", "old_secret_replaced", "secret_unreadable", "no_room"), 0)
        # the secret we MAC under; a back-off like the writes' paces re-reads of a bad file
        self._keys = SecretKeeper(self.path, self.modes, name, backoff=self._backoff.like(),
                                  count=self._count)
        try:
            make_dir(self.path, self.modes)
            check_root(self.path, self.modes)
            self._keys.start()
        except OSError as exc:
            logger.warning("span store %r at %s is not used: %s", self.name, self.path,
                           exc.strerror or exc)
        if self._secret is not None:  # a start corrects the folder's ledger (a crash's debris)
            self.rescan(sample=header_sample, correct=True)

    # -- public API --------------------------------------------------------------------------

    @property
    def usable(self) -> bool:
        """False when the store's secret could not be read or created: no reads, no writes."""
        return self._secret is not None

    @property
    def writes_enabled(self) -> bool:
        """Whether a write may be tried now (not paused after a fault, see ``backoff``; the
        secret file reads good, see ``secret``)."""
        return self._keys.writable and self._backoff.allowed()

    @property
    def _secret(self) -> bytes | None:
        """The secret entries are MAC-ed and verified under (the last good one)."""
        return self._keys.secret

    def entry_path(self, key: str) -> Path:
        check_key(key)
        return self.path / key[:2] / f"{key}{SUFFIX}"

    def has(self, key: str) -> bool:
        """Whether an entry is under ``key``'s name: from memory (``dir_index``), else one
        ``lstat`` on the probe thread within a deadline and a time budget (``probe``), so an
        entry another replica wrote a moment ago is found and a slow or hung mount never stalls
        the caller. Not verified: ``get`` may still miss."""
        check_key(key)
        if self._secret is None:
            return False
        self._idx.start_refresher(self.refresh_s)
        return key in self._idx or self._probe.is_file(self.entry_path(key))

    def bound_entries(self, payload_bytes: int) -> None:
        """This engine's entries carry ``payload_bytes`` of KV: refuse, unread, any file larger
        than such an entry (a planted sparse file would otherwise be read whole before its
        MAC check), and write none larger."""
        entry = HEADER.size + len(self._fp) + META_ALLOWANCE + int(payload_bytes)
        self.max_entry_bytes = min(self.capacity_bytes, entry)

    def get(self, key: str) -> Entry | None:
        """Read and verify the entry; None on any miss, fault or failed verification."""
        path = self.entry_path(key)
        self._check_secret()
        if self._secret is None:
            self._miss(key, forget=False)
            return None
        try:
            fd, st = open_entry(path.parent, path.name, self.max_entry_bytes)
            try:
                result = self._read_verified(key, fd, st)
                if (result == "other_key" and self._check_secret(force=True)
                        and self._secret is not None):
                    os.lseek(fd, 0, os.SEEK_SET)  # the secret was rotated: read it under the new
                    result = self._read_verified(key, fd, st)
            finally:
                os.close(fd)
        except FileNotFoundError:
            self._miss(key, forget=True)
            return None
        except NotAnEntry:
            self._count("corrupt_removed")
            self._log_once("special", logging.WARNING,
                           "span store %r: %s is %s; treated as a miss and removed",
                           self.name, path, REMOVED_REASONS["special"])
            remove_entry_name(path.parent, path.name)
            self._miss(key, forget=True)
            return None
        except OSError as exc:
            self._count("read_errors")
            self._log_once(f"read-{exc.errno}", logging.WARNING,
                           "span store %r: reading %s failed (%s); treated as a miss",
                           self.name, path, exc.strerror or exc)
            self._miss(key, forget=False)
            return None
        if isinstance(result, str):
            self._reject(key, path, st, result)
            return None
        now = time.time_ns()
        if self.writes_enabled:
            with contextlib.suppress(OSError):  # LRU recency is best effort (read-only mounts)
                os.utime(path, ns=(now, now), follow_symlinks=False)
        self._count("hits")
        self._idx.touch(key, st.st_size, now)
        return result

    def put(self, key: str, entry: Entry) -> bool:
        """Write the entry atomically; True if it is on disk afterwards (written now or already
        there — an existing entry is never overwritten, except one MAC-ed under a secret the
        store no longer has), False when writes are off, the entry is larger than
        ``max_entry_bytes``, the folder has no room for it, or the write failed."""
        path = self.entry_path(key)
        self._check_secret()
        if not self.writes_enabled:
            self._count("skipped_writes_off")
            return False
        try:
            st = os.lstat(path)
        except OSError:
            st = None
        replace = False
        if st is not None:
            if self._under_old_secret(path):
                # it may be another replica's, under a secret adopted since our last look at
                # the file: read the file now, and replace only what is under neither
                self._check_secret(force=True, read=True)
                if not self.writes_enabled:
                    self._count("skipped_writes_off")
                    return False
                replace = self._under_old_secret(path)
            if not replace:
                self._note_present(key, st)
                return True
            # keys do not name the secret: after a rotation this name holds an entry no process
            # can read any more; ours replaces it, or the block stays a miss until LRU evicts it
        parts = self._encode(key, entry)
        size = sum(len(p) for p in parts)
        if size > self.max_entry_bytes:
            self._count("too_large")
            return False
        if time.monotonic() - self._idx.last_scan > self.rescan_interval_s:
            self.rescan()
        secret = self._secret
        token = self._reserve(key, size, path)
        if token is None:
            return False
        if self._secret != secret:  # the store came back with a new secret: MAC under it
            parts = self._encode(key, entry)
        mtime: int | None = None
        exists = False
        try:
            mtime = self._write_file(key, path, parts, entry, replace)
            exists = mtime is None
        except _DirectoryVanished as exc:
            self._pause_writes(exc, "the store directory vanished and cannot be recreated")
        except OSError as exc:
            self._on_write_error(exc, path)
        else:
            if self._backoff.succeeded():
                self._count("writes_resumed")
                logger.warning("span store %r at %s: a write succeeded again; writes resumed",
                               self.name, self.path)
        finally:
            replaced = st.st_size if replace and st is not None else 0
            self._idx.settle(token, key, size, mtime, replaced)
            if mtime is not None:
                self._count("writes")
        if exists:  # another writer published this key first: its entry stands
            with contextlib.suppress(OSError):
                self._note_present(key, os.lstat(path))
            return True
        return mtime is not None

    def delete(self, key: str) -> None:
        path = self.entry_path(key)
        remove_entry_name(path.parent, path.name)
        self._forget(key)

    def keys(self) -> Iterator[str]:
        """Keys of the entry files in the directory now (any writer's; temp files excluded;
        not verified)."""
        return self._idx.keys()

    def rescan(self, sample: int = 0, correct: bool = False) -> None:
        """Re-read the directory: sizes and recency of every entry (other writers' included),
        stray temp files removed, the folder's ledger corrected if ``correct`` or due
        (``folder_usage``); ``sample`` headers read to say once if another configuration's
        entries are here. Runs at startup and every ``rescan_interval_s`` of puts."""
        try:
            correct = correct or self._usage.correction_due(self.rescan_interval_s)
        except OSError:
            correct = False
        found = self._idx.rescan(correct)
        if not (sample and found):
            return
        hits, read, prints = foreign_sample(self.path, found, sample, self._fp,
                                            self.max_entry_bytes)
        if hits:
            self._logged.add("foreign")  # the startup line says it; get() need not repeat it
            logger.warning(
                "span store %r at %s: %d of %d sampled entries were written by another model or "
                "config (fingerprint %s; ours %s); they are never read and age out by LRU",
                self.name, self.path, hits, read, ", ".join(sorted(prints)),
                self.fingerprint[:48])

    def stats(self) -> dict:
        """Counters; ``entries`` / ``bytes``: what this process knows of (``dir_index``),
        ``folder_bytes``: the whole folder's, entries and writes in flight (``folder_usage``)."""
        with self._lock:
            return {"name": self.name, "path": str(self.path), "entries": len(self._idx),
                    "bytes": self._idx.bytes, "folder_bytes": self._usage.total,
                    "capacity_bytes": self.capacity_bytes,
                    "max_entry_bytes": self.max_entry_bytes,
                    "usable": self._secret is not None, "writes_enabled": self.writes_enabled,
                    "writes_paused": self._backoff.paused, **self._c,
                    **self._probe.counts}

    # -- reading -----------------------------------------------------------------------------

    def _read_verified(self, key: str, fd: int, st: os.stat_result) -> Entry | str:
        """The verified entry, or the reason it is not one (a key of the *_REASONS tables)."""
        assert self._secret is not None
        return read_entry(partial(read_exactly, fd), st.st_size, key, self._fp, self._secret)

    def _reject(self, key: str, path: Path, st: os.stat_result, reason: str) -> None:
        if reason in KEPT_REASONS:
            self._count("other_key_skipped" if reason == "other_key" else "foreign_skipped")
            self._log_once(reason, logging.WARNING,
                           "span store %r: entry %s is %s; treated as a miss and left in place "
                           "(whoever wrote it into %s may still use it; LRU ages it out)",
                           self.name, key, KEPT_REASONS[reason], self.path)
            self._miss(key, forget=False)
            return
        self._count("corrupt_removed")
        self._log_once(reason, logging.WARNING,
                       "span store %r: entry %s is %s; treated as a miss and removed",
                       self.name, key, REMOVED_REASONS[reason])
        with contextlib.suppress(OSError):
            now = os.lstat(path)
            if (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):  # still the file we read
                os.unlink(path)
        self._miss(key, forget=True)

    def _miss(self, key: str, forget: bool) -> None:
        self._count("misses")
        if forget:
            self._forget(key)

    def _forget(self, key: str) -> None:
        self._idx.forget(key)

    def _note_present(self, key: str, st: os.stat_result) -> None:
        self._count("already_present")
        self._idx.touch(key, st.st_size, st.st_mtime_ns, only_new=True)

    # -- writing -----------------------------------------------------------------------------

    def _encode(self, key: str, entry: Entry) -> list[bytes]:
        assert self._secret is not None
        return encode_entry(key, entry, self._fp, self._secret)

    def _write_file(self, key: str, path: Path, parts: list[bytes], entry: Entry,
                    replace: bool = False) -> int | None:
        """Write ``parts`` (``entry`` encoded) to a temp file, fsync, publish under ``path``.
        The mtime written, or None if another writer published ``key`` first (our copy is
        discarded)."""
        shard = path.parent
        tmp = shard / f"{TEMP_PREFIX}{_HOST_ID}.{os.getpid()}.{secrets.token_hex(4)}.{key}"
        try:  # the tier's mode and group, in a shard opened without following a symlink
            fd = create_file(shard, tmp.name, self.modes)
        except (FileNotFoundError, NotADirectoryError):
            secret = self._secret
            self._recreate(shard)
            if self._secret != secret:  # the store came back with a new secret: MAC under it
                parts = self._encode(key, entry)
            fd = create_file(shard, tmp.name, self.modes)
        try:
            with contextlib.suppress(OSError):  # marks the temp file live for other cleaners
                fcntl.flock(fd, fcntl.LOCK_EX)
            _write_all(fd, parts)
            now = time.time_ns()
            os.utime(fd, ns=(now, now))
            if self.fsync:
                os.fsync(fd)
            if replace:
                os.replace(tmp, path)  # atomic: readers see the old entry or ours
                self._count("old_secret_replaced")
                published = True
            else:
                published = _publish(tmp, path)
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if not published:
            return None
        if self.fsync:
            _fsync_dir(shard)
        return now

    def _recreate(self, shard: Path) -> None:
        """The shard folder is missing: recreate it, and the root if the whole store was
        deleted (then everything we indexed is gone too). If the root is gone and cannot be
        recreated, raise ``_DirectoryVanished``; any other failure is an ordinary write error."""
        root_gone = not self.path.is_dir()
        try:
            make_dir(shard, self.modes)
        except OSError as exc:
            if root_gone:
                raise _DirectoryVanished(exc.errno, exc.strerror) from exc
            raise
        if root_gone:
            logger.warning("span store %r: directory %s vanished; recreated it (its entries "
                           "are gone)", self.name, self.path)
            # the secret went with it: deleting the secret rotates it (module docstring), so a
            # new one, or the one another process created first -- never the old one back
            try:
                check_root(self.path, self.modes)
                self._keys.reload()
            except OSError as exc:
                raise _DirectoryVanished(exc.errno, exc.strerror) from exc
            self._idx.clear()

    def _under_old_secret(self, path: Path) -> bool:
        """Whether the entry file at ``path`` names another key id than our secret's (read from
        its header, not verified: a forged header gains nothing, ours replaces it)."""
        try:
            fd, _st = open_entry(path.parent, path.name, self.capacity_bytes)
        except OSError:
            return False
        try:
            head = read_exactly(fd, HEADER.size)
        except OSError:
            return False
        finally:
            os.close(fd)
        header = unpack_header(head)
        ours = self._keys.key_id
        return (ours is not None and not isinstance(header, str)
                and header.version == FORMAT_VERSION and header.key_id != ours)

    def _check_secret(self, force: bool = False, read: bool = False) -> bool:
        """Adopt the secret the file holds now if it changed (``SecretKeeper.check``: at most
        once per ``KEY_CHECK_INTERVAL_S`` unless ``force``). True when our secret changed."""
        return self._keys.check(force, KEY_CHECK_INTERVAL_S, read)

    def _reserve(self, key: str, size: int, path: Path) -> str | None:
        """Room in the folder for ``size`` bytes (``folder_usage``): the ledger's token, or None
        (counted, or writes paused) when the free-space floor or the bound leaves none."""
        room = free_space_floor(self.path, self.min_free_bytes)
        if room is not None and room[0] - size < room[1]:
            short = OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} for the store: "
                                          f"{room[0]} B free, the floor is {room[1]} B")
            self._pause_writes(short, "the disk's free space would fall below the floor")
            return None
        try:
            try:
                token = self._idx.reserve(key, size, self.capacity_bytes, self.rescan_interval_s)
            except (FileNotFoundError, NotADirectoryError):  # the whole store was deleted
                self._recreate(path.parent)
                token = self._idx.reserve(key, size, self.capacity_bytes, self.rescan_interval_s)
        except _DirectoryVanished as exc:
            self._pause_writes(exc, "the store directory vanished and cannot be recreated")
            return None
        except OSError as exc:
            self._on_write_error(exc, self.path / USAGE_NAME)
            return None
        if token is None:
            self._count("no_room")
        return token

    def _on_write_error(self, exc: OSError, path: Path) -> None:
        if exc.errno in _WRITES_OFF_ERRNOS:
            self._pause_writes(exc, f"writing {path} failed")
            return
        self._count("write_errors")
        self._log_once(f"write-{exc.errno}", logging.WARNING,
                       "span store %r: writing %s failed (%s); this entry is not stored",
                       self.name, path, exc.strerror or exc)

    def _pause_writes(self, exc: OSError, what: str) -> None:
        pause = self._backoff.failed()
        with self._lock:
            self._c["write_errors"] += 1
            self._c["write_pauses"] += 1
        logger.warning("span store %r at %s: %s (%s); writes paused for %.0f s, then retried "
                       "(reads continue)", self.name, self.path, what,
                       exc.strerror or errno.errorcode.get(exc.errno or 0, exc), pause)

    # -- helpers -----------------------------------------------------------------------------

    def _count(self, name: str) -> None:
        with self._lock:
            self._c[name] += 1

    def _log_once(self, reason: str, level: int, msg: str, *args: Any) -> None:
        with self._lock:
            first = reason not in self._logged
            self._logged.add(reason)
        logger.log(level if first else logging.DEBUG, msg, *args)
