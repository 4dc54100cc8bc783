"""What a store folder holds, for every process writing into it: the folder-wide byte ledger that
makes the size bound hold per folder, and the free-space floor.

**Why a ledger.** Tensor-parallel ranks, replicas and ``minipic index`` each run their own
``DirTier`` on one folder. Bounding what each instance knows of (its scan, its own writes) lets
the folder reach instances x bound. Re-deriving the folder's true usage on every write costs a
stat per entry (a scan). So every process keeps one small shared file, ``<root>/.store-usage``,
and changes it only under an exclusive ``flock`` (a few syscalls per write):

* ``entries``: bytes of the published entries;
* ``reserved``: one record per write in flight (token -> bytes, host, pid, key, time).

A write *reserves* its bytes before it creates its temp file -- evicting least recently used
entries first, under the same lock, until ``entries + reserved + size <= capacity`` -- and
*settles* afterwards: its reservation becomes entry bytes if it published, else is dropped. An
eviction subtracts only what its own ``unlink`` removed, so two processes evicting one entry
subtract it once. Every file a writer creates is thus counted before it exists: the folder's
entry and temp bytes never exceed the capacity of the instance with the smallest bound, with no
slack for writes in flight.

**Crash safety and drift.** A killed writer's reservation stays counted (an over-count, which
costs capacity, never the bound). Removals outside the lock (a damaged entry a reader removes,
an operator's ``rm``) also only over-count. A *correction* recounts: a scan of the folder without
the lock (``DirIndex.rescan``) sums the entries and the temp files no live reservation covers;
the ledger then becomes that sum plus what was published while the scan ran (``added`` is a
running total, so the difference is exact; an entry the scan saw and that was also published
meanwhile counts twice, once more an over-count). Reservations of dead writers (pid gone on this
host, or older than ``stale_s`` from another host) are dropped then: their temp files were
removed by that scan, or are counted by it. Every tier corrects at its start (its start-up scan
costs the same either way; a machine that crashed restarts its processes, so a ledger update
lost with the page cache is recounted), and after that once per folder per
``rescan_interval_s`` (``checked`` says when the last was), whichever process's write finds it
due. The ledger is not fsynced: between a power loss and the restart nothing writes.

Where ``flock`` is unavailable (some network mounts) updates are not serialised: concurrent
writers may lose each other's changes, so the bound is approximate there until the next
correction (logged once).

**Free-space floor.** A bound says how much the store may use, not how much the disk has left
for everyone else. Before each write the tier checks ``statvfs`` of the folder: a write that
would leave less than the floor free is not made and writes pause like any write fault
(``backoff``: the next write after the pause is a probe); reads go on. The default floor is 5%
of the filesystem, at most 1 GiB: on a large disk the bound, not the floor, governs, and a small
one (a 4 MiB tmpfs) keeps its last 5%.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from minipic.engine_ext.span_store.tiers.base import logger
from minipic.engine_ext.span_store.tiers.files import Modes, create_file, open_folder

USAGE_NAME = ".store-usage"
LEDGER_VERSION = 1
_MAX_LEDGER_BYTES = 1 << 20
_OPEN_LEDGER = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# the default free-space floor: this fraction of the filesystem, at most FLOOR_MAX_BYTES
FLOOR_MAX_BYTES = 1 << 30
FLOOR_FRACTION = 0.05

Reservation = tuple[str, str, int, str]  # (token, host id, pid, key)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def free_space_floor(path: Path, floor_bytes: int | None) -> tuple[int, int] | None:
    """``(free bytes, floor)`` of the filesystem holding ``path`` (the default floor when
    ``floor_bytes`` is None), or None when it cannot be asked."""
    try:
        vfs = os.statvfs(path)
    except OSError:
        return None
    free = vfs.f_bavail * vfs.f_frsize
    if floor_bytes is None:
        floor_bytes = min(FLOOR_MAX_BYTES, int(vfs.f_blocks * vfs.f_frsize * FLOOR_FRACTION))
    return free, floor_bytes


class FolderUsage:
    """The ledger of one store folder (module docstring). Methods raise ``OSError`` when the
    ledger cannot be opened (the folder is gone, no permission): the caller treats it as a
    write fault."""

    def __init__(self, root: Path, modes: Modes, host: str, stale_s: float) -> None:
        self.root = root
        self.modes = modes
        self.host = host
        self.stale_s = stale_s
        self.total = 0  # entries + reserved, as last seen (stats; no I/O to report it)
        self._warned = False
        self._mutex = threading.Lock()  # one ledger transaction per process at a time

    # -- transactions ------------------------------------------------------------------------

    def reserve(self, key: str, size: int, capacity: int,
                evict: Callable[[int], int]) -> str | None:
        """Reserve ``size`` bytes for writing ``key``, evicting (``evict(bytes needed)`` returns
        the bytes its unlinks freed) until they fit. The token to settle with, or None when
        they cannot fit (nothing left this process knows to evict) or the ledger holds no count
        yet (a correction must run first: ``counted``)."""
        with self._locked() as state:
            if state.get("entries") is None:
                return None
            need = self._sum(state) + size - capacity
            if need > 0:
                state["entries"] = max(0, state["entries"] - evict(need))
                state["dirty"] = True
            if self._sum(state) + size > capacity:
                return None
            token = secrets.token_hex(6)
            state["reserved"][token] = [size, self.host, os.getpid(), key, time.time()]
            state["dirty"] = True
            return token

    def settle(self, token: str, size: int, published: bool, replaced: int = 0) -> None:
        """The write of ``token`` is over: its bytes are an entry's now (``published``; an
        entry of ``replaced`` bytes it replaced is gone) or nobody's."""
        with self._locked() as state:
            state["reserved"].pop(token, None)
            if published and state.get("entries") is not None:
                state["entries"] = max(0, state["entries"] + size - replaced)
                state["added"] += size
            state["dirty"] = True

    def counted(self) -> bool:
        """Whether the ledger holds a count (False: missing or unreadable: correct it)."""
        with self._locked() as state:
            return state.get("entries") is not None

    def correction_due(self, interval_s: float) -> bool:
        with self._locked() as state:
            return state.get("entries") is None or time.time() - state["checked"] >= interval_s

    def added(self) -> int:
        """The running total of published bytes (taken before a correction's scan)."""
        with self._locked() as state:
            return int(state["added"])

    def correct(self, entry_bytes: int, temps: list[tuple[str, int, str, int]],
                added_before: int) -> None:
        """Recount after a scan: ``entry_bytes`` of entries and ``temps`` (host id, pid, key,
        bytes) found; ``added_before`` was ``added()`` when the scan began."""
        now = time.time()
        with self._locked() as state:
            kept = {token: r for token, r in state["reserved"].items() if self._live(r, now)}
            covered = {(r[1], r[2], r[3]) for r in kept.values()}
            loose = sum(size for host, pid, key, size in temps
                        if (host, pid, key) not in covered)
            published = max(0, int(state["added"]) - added_before)
            state.update(entries=entry_bytes + loose + published, reserved=kept, checked=now,
                         dirty=True)

    # -- the file ----------------------------------------------------------------------------

    def _live(self, record: list[Any], now: float) -> bool:
        _size, host, pid, _key, since = record
        if now - since > self.stale_s:
            return False
        return host != self.host or pid_alive(int(pid))

    @staticmethod
    def _sum(state: dict[str, Any]) -> int:
        return int(state["entries"]) + sum(int(r[0]) for r in state["reserved"].values())

    def _open(self) -> int:
        dir_fd = open_folder(self.root)
        try:
            try:
                fd = os.open(USAGE_NAME, _OPEN_LEDGER, dir_fd=dir_fd)
            except FileNotFoundError:
                try:
                    os.close(create_file(self.root, USAGE_NAME, self.modes))
                except FileExistsError:
                    pass  # another process created it first
                fd = os.open(USAGE_NAME, _OPEN_LEDGER, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, f"{self.root / USAGE_NAME} is not a regular file")
        return fd

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        """The ledger's state, read under its ``flock`` and written back when marked dirty."""
        with self._mutex:
            fd = self._open()
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                except OSError as exc:
                    if not self._warned:
                        self._warned = True
                        logger.warning("span store at %s: no flock on this mount (%s); the "
                                       "folder-wide size bound is approximate until each "
                                       "rescan", self.root, exc.strerror or exc)
                state = self._parse(os.pread(fd, _MAX_LEDGER_BYTES, 0))
                yield state
                if state.pop("dirty", False):
                    data = json.dumps(state, separators=(",", ":")).encode()
                    os.pwrite(fd, data, 0)
                    os.ftruncate(fd, len(data))
                if state.get("entries") is not None:
                    self.total = self._sum(state)
            finally:
                os.close(fd)  # releases the flock

    @staticmethod
    def _parse(raw: bytes) -> dict[str, Any]:
        """The ledger's fields; ``entries`` None when there is no count to trust (a new file,
        or one damaged or rewritten by hand)."""
        fresh: dict[str, Any] = {"v": LEDGER_VERSION, "entries": None, "added": 0,
                                 "checked": 0.0, "reserved": {}}
        try:
            # raw_decode: trailing bytes of a longer earlier state are not part of this one
            state, _end = json.JSONDecoder().raw_decode(raw.decode())
            if (not isinstance(state, dict) or state.get("v") != LEDGER_VERSION
                    or not isinstance(state.get("entries"), int)
                    or not isinstance(state.get("added"), int)
                    or not isinstance(state.get("checked"), int | float)
                    or not isinstance(state.get("reserved"), dict)
                    or not all(isinstance(r, list) and len(r) == 5
                               for r in state["reserved"].values())):
                return fresh
        except (UnicodeDecodeError, ValueError):
            return fresh
        return state
