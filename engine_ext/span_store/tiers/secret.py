"""The store's secret: created once, read together with its stamp, re-checked for rotations, and
kept through a bad look at the file.

Every entry of a directory tier is MAC-ed under 32 random bytes in ``<root>/.store-key``
(``files`` says why, and who may own the file). This module creates and reads that file, and
:class:`SecretKeeper` holds what one tier uses: the secret, the stamp of the file it came from,
when it was last checked, and whether the file reads good now.

**Creating it leaves no second name.** The secret is written to an unnamed file (``O_TMPFILE``)
and linked into place (``linkat`` through ``/proc/self/fd``): whoever links first wins, everyone
reads the one published. A named temp file linked to ``.store-key`` and then unlinked (the only
way where ``O_TMPFILE`` is missing) leaves, if its creator dies between the two, a second hard
link to the secret that survives a rotation by deletion and so defeats "a rotation revokes".
Such temps are named ``.store-key.tmp.<host>.<pid>.<rand>`` and ``flock``-ed by their creator;
one no live creator holds (not locked, and its pid dead on this host or older than
``STALE_TEMP_S``) is removed whenever a tier reads a secret it did not have.

**The stamp is the file the bytes came from.** (device, inode, mtime, ctime, size) is taken with
``fstat`` on the descriptor the secret is read from. A stamp taken by a separate ``lstat`` after
the read would, when a rotation lands between the two, pair the old bytes with the new file's
stamp: the tier would stay on the old secret until restart, and every fresh entry would look
like one under a revoked secret to it.

**Rotation.** Deleting ``.store-key`` (alone, or with the whole store folder) rotates the secret:
the first process that needs one afterwards creates a new one, and every process sharing the
folder adopts whatever the file holds. A tier compares the file's stamp with its own at most once
per ``KEY_CHECK_INTERVAL_S`` (``directory``) on reads and writes, at once when it meets an entry
under a key id it does not know, and reads the file itself before any write that would replace
an entry (``DirTier.put``): the entry under a key id it does not know may be another replica's,
written under a secret adopted since our last look. Adopting a new secret is logged and counted
(``key_changes``); entries under the old one become misses left in place. Replacing the file by
another 32-byte secret (mode and owner as the tier's) has the same outcome.

**A bad look is not a rotation.** A secret that cannot be read, or is not private, or is not 32
bytes (a non-atomic rotation caught half-way at 0644 or short, a read-only or full disk when a
deleted secret must be created anew, a transient NFS error) keeps the last good secret: reads
go on under it (it was private and ours when read), writes pause -- an entry written under a
secret the file no longer holds is one no other process can read, and a write could replace
their entries -- and the file is read again after 1 s, 2 s, 4 s ... (``backoff``), logged once
per episode. Only a secret that reads good replaces the one in use. A tier that finds no usable
secret when it starts has none to keep and is not used (``DirTier``).
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
from collections.abc import Callable
from pathlib import Path

from minipic.engine_ext.span_store.tiers.backoff import WriteBackoff
from minipic.engine_ext.span_store.tiers.base import logger
from minipic.engine_ext.span_store.tiers.files import (
    Modes,
    StoreUnusable,
    apply_owner,
    check_owner,
    key_id,
)

SECRET_NAME = ".store-key"
SECRET_BYTES = 32
TEMP_PREFIX = f"{SECRET_NAME}.tmp."
STALE_TEMP_S = 300.0  # a named temp this old is no live creator's, whatever its host
_HOST_ID = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
USE_TMPFILE = hasattr(os, "O_TMPFILE")  # Linux; elsewhere (and when it fails) a named temp
# open(O_TMPFILE) errors meaning "no unnamed files here" (fall back to a named temp)
_NO_TMPFILE = frozenset({errno.EOPNOTSUPP, errno.ENOTSUP, errno.EISDIR, errno.EINVAL,
                         errno.ENOENT})

Stamp = tuple[int, int, int, int, int]


def _stamp(st: os.stat_result) -> Stamp:
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)


def secret_stamp(root: Path) -> Stamp | None:
    """The stamp of the secret file now (one ``lstat``), None when it cannot be had: equal to
    a secret's own stamp (``load_secret``) means the file is still the one it was read from."""
    try:
        return _stamp(os.lstat(root / SECRET_NAME))
    except OSError:
        return None


def load_secret(root: Path, modes: Modes, proposed: bytes | None = None) -> tuple[bytes, Stamp]:
    """The store's MAC secret and the stamp of the file it was read from, created at first use
    (from ``proposed``, else at random). Whoever publishes first wins; everyone reads the
    published one. Raises ``StoreUnusable`` when it cannot be read or created or is readable or
    writable beyond the tier's own mode (another user could forge)."""
    path = root / SECRET_NAME
    try:
        return _read_secret(path, modes)
    except FileNotFoundError:
        pass
    try:
        _publish_secret(root, modes, proposed or secrets.token_bytes(SECRET_BYTES))
    except OSError as exc:
        raise StoreUnusable(exc.errno, f"cannot create the store secret {path}: "
                                       f"{exc.strerror or exc}") from exc
    return _read_secret(path, modes)


def _read_secret(path: Path, modes: Modes) -> tuple[bytes, Stamp]:
    try:
        fd = os.open(path, _OPEN_FILE)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise StoreUnusable(exc.errno, f"cannot open the store secret {path}: "
                                       f"{exc.strerror or exc}") from exc
    try:
        st = os.fstat(fd)  # the stamp of what we read, whatever lands at the name meanwhile
        if not stat.S_ISREG(st.st_mode) or st.st_size != SECRET_BYTES:
            raise StoreUnusable(errno.EINVAL, f"the store secret {path} is not a "
                                              f"{SECRET_BYTES}-byte regular file")
        if st.st_mode & modes.forbidden:
            raise StoreUnusable(errno.EPERM, f"the store secret {path} has mode "
                                             f"{stat.S_IMODE(st.st_mode):o}: others could "
                                             f"forge entries (expected {modes.file:o})")
        check_owner(st, path, modes, "the store secret")
        data = os.read(fd, SECRET_BYTES + 1)
    except StoreUnusable:
        raise
    except OSError as exc:
        raise StoreUnusable(exc.errno, f"cannot read the store secret {path}: "
                                       f"{exc.strerror or exc}") from exc
    finally:
        os.close(fd)
    if len(data) != SECRET_BYTES:
        raise StoreUnusable(errno.EIO, f"the store secret {path} changed while read")
    return data, _stamp(st)


def _publish_secret(root: Path, modes: Modes, secret: bytes) -> None:
    """Write ``secret`` and link it to ``SECRET_NAME`` unless a secret is there already (then
    that one stands). An unnamed file where the filesystem has them, else a locked named temp."""
    dir_fd = os.open(root, _OPEN_DIR)
    try:
        if not (USE_TMPFILE and _publish_unnamed(dir_fd, modes, secret)):
            _publish_named(dir_fd, modes, secret)
    finally:
        os.close(dir_fd)


def _publish_unnamed(dir_fd: int, modes: Modes, secret: bytes) -> bool:
    """Publish from an ``O_TMPFILE`` file; False when this filesystem or /proc offers none."""
    try:
        fd = os.open(".", os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, modes.file, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in _NO_TMPFILE:
            return False
        raise
    try:
        _fill(fd, modes, secret)
        with contextlib.suppress(FileExistsError):  # published first: theirs stands
            os.link(f"/proc/self/fd/{fd}", SECRET_NAME, dst_dir_fd=dir_fd)
        return True
    except OSError:
        return False  # no /proc, or no linking through it: a named temp (its error is the one)
    finally:
        os.close(fd)


def _publish_named(dir_fd: int, modes: Modes, secret: bytes) -> None:
    name = f"{TEMP_PREFIX}{_HOST_ID}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 modes.file, dir_fd=dir_fd)
    try:
        with contextlib.suppress(OSError):  # held until the name is gone: "a live creator's"
            fcntl.flock(fd, fcntl.LOCK_EX)
        _fill(fd, modes, secret)
        with contextlib.suppress(FileExistsError):
            os.link(name, SECRET_NAME, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dir_fd)
        os.close(fd)


def _fill(fd: int, modes: Modes, secret: bytes) -> None:
    apply_owner(fd, modes)  # the tier's mode (not the umask's) and group
    if os.write(fd, secret) != len(secret):
        raise OSError(errno.EIO, "short write of the store secret")
    os.fsync(fd)


def remove_stale_temps(root: Path, now: float | None = None) -> int:
    """Remove ``.store-key.tmp.*`` files no live creator can own (module docstring): each may be
    a second link to a secret that a rotation must revoke. Returns how many were removed."""
    now = time.time() if now is None else now
    try:
        dir_fd = os.open(root, _OPEN_DIR)
    except OSError:
        return 0
    removed = 0
    try:
        for name in os.listdir(dir_fd):
            if name.startswith(TEMP_PREFIX) and _remove_if_stale(dir_fd, name, now):
                removed += 1
    except OSError:
        pass
    finally:
        os.close(dir_fd)
    return removed


def _remove_if_stale(dir_fd: int, name: str, now: float) -> bool:
    try:
        fd = os.open(name, _OPEN_FILE, dir_fd=dir_fd)
    except OSError:
        return False  # gone, or not a file we would have made: not ours to remove
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its creator is alive and holds it
        except OSError:
            pass  # no flock on this mount: the pid and age rules alone decide
        parts = name[len(TEMP_PREFIX):].split(".")
        host, pid = (parts[0], parts[1]) if len(parts) == 3 else (_HOST_ID, parts[0])
        dead_here = host == _HOST_ID and pid.isdigit() and not _pid_alive(int(pid))
        if not dead_here and now - st.st_mtime <= STALE_TEMP_S:
            return False
        if _stamp(os.stat(name, dir_fd=dir_fd, follow_symlinks=False)) != _stamp(st):
            return False  # the name changed hands since we opened it
        os.unlink(name, dir_fd=dir_fd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SecretKeeper:
    """The secret one tier MACs under, and what it knows of the file (module docstring).

    ``secret`` is None only when no usable secret was ever read (``start`` raised): the tier is
    not used. Otherwise it is the last secret that read good, and ``writable`` says whether the
    file reads good now. Thread-safe: the tier's readers and its writer thread all check.
    """

    def __init__(self, root: Path, modes: Modes, name: str, *,
                 backoff: WriteBackoff | None = None,
                 count: Callable[[str], None] = lambda _counter: None) -> None:
        self.root = root
        self.modes = modes
        self.name = name
        self.secret: bytes | None = None
        self.stamp: Stamp | None = None
        self.checked = 0.0  # time.monotonic() of the last look at the file
        self._backoff = backoff or WriteBackoff()
        self._count = count
        self._failing = False
        self._lock = threading.RLock()

    @property
    def key_id(self) -> bytes | None:
        secret = self.secret
        return None if secret is None else key_id(secret)

    @property
    def writable(self) -> bool:
        """Whether a write may be tried: a secret, and the file read good at the last look or
        is due for another (the write's own check is the probe, as for the write back-off)."""
        return self.secret is not None and (not self._failing or self._backoff.allowed())

    def start(self) -> None:
        """Read (or create) the secret at the tier's start; ``StoreUnusable`` (an ``OSError``)
        when there is none to use."""
        with self._lock:
            self.adopt(*load_secret(self.root, self.modes))
            self.checked = time.monotonic()

    def reload(self) -> bool:
        """Read the secret now and use it (raises ``OSError`` when it cannot be had): after the
        whole store folder was recreated. True when the secret changed."""
        with self._lock:
            secret, stamp = load_secret(self.root, self.modes)
            self._read_good()
            return self.adopt(secret, stamp)

    def check(self, force: bool = False, interval_s: float = 1.0, read: bool = False) -> bool:
        """Adopt the secret the file holds now if the file changed since we read it: at most once
        per ``interval_s`` unless ``force``; ``read`` reads the file even if its stamp is ours.
        While the file reads bad, only when the back-off allows. True when the secret changed."""
        with self._lock:
            if self.secret is None:
                return False
            now = time.monotonic()
            if self._failing:
                if not self._backoff.allowed():
                    return False
            elif not force and now - self.checked < interval_s:
                return False
            self.checked = now
            if not read and not self._failing:
                stamp = secret_stamp(self.root)
                if stamp is not None and stamp == self.stamp:
                    return False
            try:
                secret, stamp = load_secret(self.root, self.modes)
            except OSError as exc:
                if not self.root.is_dir():
                    # the whole store is gone: not a bad secret; the next write recreates the
                    # folder and a new secret with it (DirTier._recreate)
                    self._read_good(quiet=True)
                    return False
                self._read_bad(exc)
                return False
            self._read_good()
            return self.adopt(secret, stamp)

    def adopt(self, secret: bytes, stamp: Stamp) -> bool:
        """Use ``secret`` (read from the file ``stamp`` names) from now on; log and count it
        when it differs from ours. True when it does."""
        with self._lock:
            self.stamp = stamp
            if secret == self.secret:
                return False
            old, self.secret = self.secret, secret
            # a crashed creator's leftover name for the old secret would outlive the rotation
            remove_stale_temps(self.root)
            if old is not None:
                self._count("key_changes")
                logger.warning("span store %r at %s: the store secret was rotated; entries "
                               "written under the old one are misses, left in place until LRU "
                               "evicts them", self.name, self.root)
            return True

    def _read_bad(self, exc: OSError) -> None:
        pause = self._backoff.failed()
        first, self._failing = not self._failing, True
        if first:
            self._count("secret_unreadable")
        logger.log(logging.WARNING if first else logging.DEBUG,
                   "span store %r at %s: its secret cannot be used now (%s); reads go on under "
                   "the last good secret, writes pause until the file reads good again (next "
                   "look in %.0f s)", self.name, self.root, exc.strerror or exc, pause)

    def _read_good(self, quiet: bool = False) -> None:
        if not self._failing:
            return
        self._failing = False
        self._backoff.succeeded()
        if not quiet:
            logger.warning("span store %r at %s: its secret reads good again; writes resume",
                           self.name, self.root)
