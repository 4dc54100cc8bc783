"""The persistent tier: one file per entry in a directory, bounded, LRU-evicting and crash-safe.

It is the embedded default (a local disk) and also the shared tier for several replicas or
nodes (the same directory on a shared mount). The bytes of an entry file are ``format``'s; how
the tier touches the filesystem without trusting it (secret, modes, no-follow opens) is
``files``'; when writes resume after a fault is ``backoff``'s.

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

**Shared-directory semantics.** Every process sharing a directory scans it at startup and
bounds the bytes it knows of: entries found by the scan, its own writes, and others' entries it
reads; a rescan every ``rescan_interval_s`` (done on the write path, off the caller's thread
under ``TieredStore``) picks up the rest. LRU order is the file mtime (set with
nanosecond precision on write and on every hit, so recency is shared between processes); an
eviction candidate another process touched since we last saw it gets a second chance. Removing
a file another process is reading is safe on POSIX (its open file stays readable); on NFS that
reader may get ``ESTALE``, which is a miss.

An entry whose fingerprint is not the tier's (another model or config sharing the directory —
keys normally already differ, so this is rare) is a miss and is **left in place**: it is valid
data of someone else, deleting it would make two configurations on one directory destroy each
other's stores. It ages out through LRU like anything nobody reads (until then that key
stays a miss for us: ``put`` never overwrites an existing file). A newer format version
(a newer minipic sharing the directory) is kept for the same reason. Corrupt, truncated or
foreign-format files are removed. Each reason is logged once per tier (logger
``vllm.minipic.span_store``), and the startup scan samples headers and says once if the
directory holds another configuration's entries.

**The secret can change under a running process.** Deleting ``.store-key`` (alone, or with the
whole store folder) rotates it: the first process that needs a secret afterwards creates a new
random one, and every process sharing the folder adopts whatever secret the file holds -- each
re-checks the file at most once a second on reads and writes, and at once when it meets an
entry under a key id it does not know. Adopting a new secret is logged and counted
(``key_changes``; ``minipic:span_store_key_changes`` on ``/metrics``). Entries under the old
secret become misses left in place (``other_key``): a rotation costs recomputation, never
another replica's valid entries. The first ``put`` of a block whose name holds an entry under
the old secret replaces it (the one overwrite ``put`` does): keys do not name the secret, so
the old entry would otherwise keep that block a miss until LRU evicted it. Replacing the file
by another 32-byte secret (mode and owner as the tier's) has the same outcome. A rotation is how to
revoke whoever learned the old secret (``docs/span_store.md``).

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
import hashlib
import logging
import os
import secrets
import socket
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from minipic.engine_ext.span_store.tiers.backoff import WriteBackoff
from minipic.engine_ext.span_store.tiers.base import (
    KEPT_REASONS,
    KEY_RE,
    RAM_SOURCE,
    REMOVED_REASONS,
    Entry,
    check_key,
    logger,
)
from minipic.engine_ext.span_store.tiers.files import (
    Modes,
    NotAnEntry,
    check_root,
    key_id,
    load_secret,
    make_dir,
    open_entry,
    read_exactly,
    remove_entry_name,
    secret_stamp,
)
from minipic.engine_ext.span_store.tiers.format import (
    FORMAT_VERSION,
    HEADER,
    SUFFIX,
    TEMP_PREFIX,
    encode_entry,
    read_entry,
    read_fingerprint,
    unpack_header,
)

# Write errors that mean "this disk takes no more writes": writes go off, reads continue.
_WRITES_OFF_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, getattr(errno, "EDQUOT", errno.ENOSPC)}
)
# link() errors meaning "this filesystem has no hard links" (fall back to rename).
_NO_LINK_ERRNOS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK,
                             errno.ENOSYS})
_HOST_ID = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
# how often reads and writes look at the secret file for a rotation (one lstat)
KEY_CHECK_INTERVAL_S = 1.0


class _DirectoryVanished(OSError):
    """The store directory is gone and cannot be recreated."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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

    ``has`` is one ``lstat``; ``get`` reads and verifies the whole file; ``put`` writes
    atomically and returns False when writes are paused or failed. No method raises for an I/O
    fault; an invalid key is a ``ValueError`` (a caller bug). A tier whose secret cannot be read
    (``files``) is *unusable*: every lookup misses and nothing is written.
    """

    def __init__(self, path: str | Path, capacity_bytes: int, fingerprint: str,
                 name: str = "disk", *, fsync: bool = True, stale_temp_s: float = 300.0,
                 rescan_interval_s: float = 300.0, header_sample: int = 64,
                 group_access: bool = False, group: int | str | None = None,
                 backoff: WriteBackoff | None = None) -> None:
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
        self._index: OrderedDict[str, tuple[int, int]] = OrderedDict()  # key -> (size, mtime_ns)
        self._bytes = 0  # sum of indexed sizes
        self._reserved = 0  # bytes of writes in flight
        self.modes = Modes.for_access(group_access, group)
        self._backoff = backoff or WriteBackoff()
        self._logged: set[str] = set()
        self._c = dict.fromkeys(
            ("hits", "misses", "corrupt_removed", "foreign_skipped", "read_errors", "writes",
             "already_present", "write_errors", "skipped_writes_off", "too_large", "evictions",
             "temps_removed", "write_pauses", "writes_resumed", "other_key_skipped",
             "key_changes", "old_secret_replaced"), 0)
        self._last_scan = 0.0
        self._secret: bytes | None = None
        self._secret_stamp: tuple[int, int, int, int] | None = None
        self._secret_checked = 0.0
        try:
            make_dir(self.path, self.modes)
            check_root(self.path, self.modes)
            self._secret = load_secret(self.path, self.modes)
            self._secret_stamp = secret_stamp(self.path)
            self._secret_checked = time.monotonic()
        except OSError as exc:
            logger.warning("span store %r at %s is not used: %s", self.name, self.path,
                           exc.strerror or exc)
        found = self._scan(sample=header_sample) if self._secret is not None else []
        with self._lock:
            self._install_index(found, since_ns=None)

    # -- public API --------------------------------------------------------------------------

    @property
    def usable(self) -> bool:
        """False when the store's secret could not be read or created: no reads, no writes."""
        return self._secret is not None

    @property
    def writes_enabled(self) -> bool:
        """Whether a write may be tried now (not paused after a fault; see ``backoff``)."""
        return self._secret is not None and self._backoff.allowed()

    def entry_path(self, key: str) -> Path:
        check_key(key)
        return self.path / key[:2] / f"{key}{SUFFIX}"

    def has(self, key: str) -> bool:
        """Whether a regular file is under ``key``'s name (one ``lstat``; not verified: ``get``
        may still miss if the file turns out damaged or foreign)."""
        if self._secret is None:
            return False
        try:
            return stat.S_ISREG(os.lstat(self.entry_path(key)).st_mode)
        except OSError:
            return False

    def get(self, key: str) -> Entry | None:
        """Read and verify the entry; None on any miss, fault or failed verification."""
        path = self.entry_path(key)
        self._check_secret()
        if self._secret is None:
            self._miss(key, forget=False)
            return None
        try:
            fd, st = open_entry(path.parent, path.name, self.capacity_bytes)
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
        with self._lock:
            self._c["hits"] += 1
            old = self._index.pop(key, None)
            if old is not None:
                self._bytes -= old[0]
            self._index[key] = (st.st_size, now)
            self._bytes += st.st_size
        return result

    def put(self, key: str, entry: Entry) -> bool:
        """Write the entry atomically; True if it is on disk afterwards (written now or already
        there — an existing entry is never overwritten, except one MAC-ed under a secret the
        store no longer has), False when writes are off, the entry is larger than the capacity,
        or the write failed."""
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
            if not self._under_old_secret(path):
                self._note_present(key, st)
                return True
            # keys do not name the secret, so after a rotation this name holds an entry no
            # process can read any more (all adopt the file's secret within a second): ours
            # replaces it, or the block would stay a miss until LRU evicted the old one
            replace = True
        parts = self._encode(key, entry)
        size = sum(len(p) for p in parts)
        if size > self.capacity_bytes:
            self._count("too_large")
            return False
        if time.monotonic() - self._last_scan > self.rescan_interval_s:
            self.rescan()
        with self._lock:
            self._evict_to_fit(size)
            self._reserved += size
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
            with self._lock:
                self._reserved -= size
                if mtime is not None:
                    self._c["writes"] += 1
                    old = self._index.pop(key, None)
                    if old is not None:
                        self._bytes -= old[0]
                    self._index[key] = (size, mtime)
                    self._bytes += size
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
        for shard in self._listdir(self.path):
            if shard.name.startswith(".") or not shard.is_dir(follow_symlinks=False):
                continue
            for item in self._listdir(Path(shard.path)):
                key = self._key_of(shard.name, item.name)
                if key is not None:
                    yield key

    def rescan(self) -> None:
        """Re-read the directory: sizes and recency of every entry (other writers' included),
        and stray temp files removed. Runs at startup and every ``rescan_interval_s`` of puts."""
        started = time.time_ns()
        found = self._scan(sample=0)
        with self._lock:
            self._install_index(found, since_ns=started)

    def stats(self) -> dict:
        with self._lock:
            return {"name": self.name, "path": str(self.path), "entries": len(self._index),
                    "bytes": self._bytes, "capacity_bytes": self.capacity_bytes,
                    "usable": self._secret is not None, "writes_enabled": self.writes_enabled,
                    "writes_paused": self._backoff.paused, **self._c}

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
        with self._lock:
            old = self._index.pop(key, None)
            if old is not None:
                self._bytes -= old[0]

    def _note_present(self, key: str, st: os.stat_result) -> None:
        with self._lock:
            self._c["already_present"] += 1
            if key not in self._index:
                self._index[key] = (st.st_size, st.st_mtime_ns)
                self._bytes += st.st_size

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
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            if os.path.islink(shard):  # never write through a planted symlink
                raise OSError(errno.ELOOP, f"shard folder {shard} is a symlink")
            fd = os.open(tmp, flags, self.modes.file)
        except (FileNotFoundError, NotADirectoryError):
            secret = self._secret
            self._recreate(shard)
            if self._secret != secret:  # the store came back with a new secret: MAC under it
                parts = self._encode(key, entry)
            fd = os.open(tmp, flags, self.modes.file)
        try:
            os.fchmod(fd, self.modes.file)  # the tier's mode, not the umask's
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
                self._adopt_secret(load_secret(self.path, self.modes))
            except OSError as exc:
                raise _DirectoryVanished(exc.errno, exc.strerror) from exc
            with self._lock:
                self._index.clear()
                self._bytes = 0

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
        return (self._secret is not None and not isinstance(header, str)
                and header.version == FORMAT_VERSION and header.key_id != key_id(self._secret))

    def _check_secret(self, force: bool = False) -> bool:
        """Adopt the secret the file holds now if it changed since we read it (at most once per
        ``KEY_CHECK_INTERVAL_S`` unless ``force``). A missing secret file in an existing folder
        is a rotation by deletion: a new secret is created (or another process's taken). True
        when the secret we use changed."""
        if self._secret is None:
            return False
        now = time.monotonic()
        if not force and now - self._secret_checked < KEY_CHECK_INTERVAL_S:
            return False
        self._secret_checked = now
        stamp = secret_stamp(self.path)
        if stamp is not None and stamp == self._secret_stamp:
            return False
        if stamp is None and not self.path.is_dir():
            return False  # the whole store is gone: the next write recreates it (_recreate)
        try:
            return self._adopt_secret(load_secret(self.path, self.modes))
        except OSError as exc:
            logger.warning("span store %r at %s is no longer used: its secret changed and "
                           "cannot be read (%s)", self.name, self.path, exc.strerror or exc)
            self._secret = None
            return True

    def _adopt_secret(self, secret: bytes) -> bool:
        """Use ``secret`` from now on; log and count it when it differs from ours."""
        self._secret_stamp = secret_stamp(self.path)
        if secret == self._secret:
            return False
        old, self._secret = self._secret, secret
        if old is not None:
            self._count("key_changes")
            logger.warning("span store %r at %s: the store secret was rotated; entries "
                           "written under the old one are misses, left in place until LRU "
                           "evicts them", self.name, self.path)
        return True

    def _evict_to_fit(self, size: int) -> None:
        """Under the lock: delete least recently used entries until ``size`` more bytes fit.
        A candidate touched by another process since we saw it gets one second chance."""
        second_chance: set[str] = set()
        while self._index and self._bytes + self._reserved + size > self.capacity_bytes:
            key, (old_size, mtime) = self._index.popitem(last=False)
            self._bytes -= old_size
            path = self.path / key[:2] / f"{key}{SUFFIX}"
            try:
                st = os.lstat(path)
            except OSError:
                continue  # already gone
            if st.st_mtime_ns > mtime and key not in second_chance:
                second_chance.add(key)
                self._index[key] = (st.st_size, st.st_mtime_ns)
                self._bytes += st.st_size
                continue
            with contextlib.suppress(OSError):
                os.unlink(path)
                self._c["evictions"] += 1

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

    # -- scanning ----------------------------------------------------------------------------

    @staticmethod
    def _listdir(path: Path) -> list[os.DirEntry]:
        try:
            with os.scandir(path) as it:
                return list(it)
        except OSError:
            return []

    @staticmethod
    def _key_of(shard: str, name: str) -> str | None:
        if not name.endswith(SUFFIX):
            return None
        key = name[:-len(SUFFIX)]
        if key[:2] != shard or not KEY_RE.fullmatch(key):
            return None
        return key

    def _scan(self, sample: int) -> list[tuple[int, str, int]]:
        """``(mtime_ns, key, size)`` of every entry file; stray temp files removed; up to
        ``sample`` headers read to report another configuration's entries once."""
        found: list[tuple[int, str, int]] = []
        now = time.time()
        for shard in self._listdir(self.path):
            if shard.name.startswith(".") or not shard.is_dir(follow_symlinks=False):
                continue
            for item in self._listdir(Path(shard.path)):
                if item.name.startswith(TEMP_PREFIX):
                    if self._remove_if_stale(Path(item.path), item.name, now):
                        self._count("temps_removed")
                    continue
                key = self._key_of(shard.name, item.name)
                if key is None:
                    continue
                try:
                    st = item.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    found.append((st.st_mtime_ns, key, st.st_size))
        self._last_scan = time.monotonic()
        if sample and found:
            self._report_foreign(found, sample)
        return found

    def _install_index(self, found: list[tuple[int, str, int]], since_ns: int | None) -> None:
        """Under the lock: the scan becomes the index (LRU order = mtime), keeping entries we
        indexed while the scan ran (``since_ns``) that it missed."""
        index: OrderedDict[str, tuple[int, int]] = OrderedDict(
            (key, (size, mtime)) for mtime, key, size in sorted(found))
        if since_ns is not None:
            for key, (size, mtime) in self._index.items():
                if key not in index and mtime >= since_ns:
                    index[key] = (size, mtime)
        self._index = index
        self._bytes = sum(size for size, _ in index.values())

    def _remove_if_stale(self, path: Path, name: str, now: float) -> bool:
        """Remove a temp file no live writer can own (see the module docstring)."""
        parts = name.split(".", 5)  # '', 'tmp', host id, pid, random, key
        safe = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            fd = os.open(path, os.O_RDWR | safe)
        except PermissionError:  # another user's temp file: read-only is enough for flock
            try:
                fd = os.open(path, os.O_RDONLY | safe)
            except OSError:
                return False
        except OSError:
            return False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked_by_us = True
            except BlockingIOError:
                return False  # a live writer holds it
            except OSError:
                locked_by_us = False  # no flock on this mount: the age rule alone decides
            st = os.fstat(fd)
            dead_here = (locked_by_us and len(parts) == 6 and parts[2] == _HOST_ID
                         and parts[3].isdigit() and not _pid_alive(int(parts[3])))
            if dead_here or now - st.st_mtime > self.stale_temp_s:
                os.unlink(path)
                return True
            return False
        except OSError:
            return False
        finally:
            os.close(fd)

    def _report_foreign(self, found: list[tuple[int, str, int]], sample: int) -> None:
        step = max(1, len(found) // sample)
        picked = found[::step][:sample]
        foreign: set[str] = set()
        hits = 0
        for _, key, _ in picked:
            try:
                fd, _st = open_entry(self.path / key[:2], f"{key}{SUFFIX}", self.capacity_bytes)
            except OSError:
                continue
            try:
                fp = read_fingerprint(partial(read_exactly, fd))
            except OSError:
                continue
            finally:
                os.close(fd)
            if fp is None:
                continue
            if fp != self._fp:
                hits += 1
                foreign.add(fp.decode(errors="replace")[:48])
        if hits:
            self._logged.add("foreign")  # the startup line says it; get() need not repeat it
            logger.warning(
                "span store %r at %s: %d of %d sampled entries were written by another model or "
                "config (fingerprint %s; ours %s); they are never read and age out by LRU",
                self.name, self.path, hits, len(picked), ", ".join(sorted(foreign)),
                self.fingerprint[:48])

    # -- helpers -----------------------------------------------------------------------------

    def _count(self, name: str) -> None:
        with self._lock:
            self._c[name] += 1

    def _log_once(self, reason: str, level: int, msg: str, *args: Any) -> None:
        with self._lock:
            first = reason not in self._logged
            self._logged.add(reason)
        logger.log(level if first else logging.DEBUG, msg, *args)
