"""What a directory tier knows of its folder without asking the filesystem: the in-memory index
that answers ``has`` and orders eviction, the scans that fill it, and eviction itself.

**``has`` asks the index first.** The scheduler asks, on its own thread, whether each span block
of a prompt is in the store: 512 lookups for a cold 8k-token prompt, per tier, per tensor-parallel
rank. An ``lstat`` each stalls every running decode on a slow network mount and hangs the engine
on a hung one. So ``has`` answers from memory first (an index miss is probed off the scheduler's
thread within a deadline and a budget: ``probe``): the keys the last scan or listing found, plus
this process's own writes and hits, less what it removed or found missing. The answer is
unverified either way (``get`` may still miss). What it cannot know until the next listing: an
entry another process wrote since when the probe cannot answer in time (a miss: the block is
computed, and ``put`` then finds the entry and keeps it), and an entry another process removed
since (a "present" whose ``get``
misses). Listings run on a background thread started by the first ``has`` (so only a process
that asks -- the scheduler -- pays for them), every ``refresh_s``: names only, one ``readdir`` per
shard folder and no ``stat``, off the scheduler's thread.

**Rescans** (at start-up and every ``rescan_interval_s`` on the write path, off the engine's
thread under ``TieredStore``) stat every entry: sizes and mtimes give the LRU order; stray temp
files no live writer can own are removed; and, when the folder's ledger is due, it is corrected
from what the scan counted (``folder_usage``).

**Eviction** runs under the folder ledger's lock when a write needs room: least recently used
first among the entries this process knows (its last rescan, its writes and its hits; mtime is
the recency every process shares, set on write and on every hit), a candidate another process
touched since we saw it getting one second chance. Any process may evict any entry; the ledger
is charged only for what this process's own ``unlink`` removed. When nothing known is left to
evict, the writer rescans (the folder's other entries become known) and tries once more.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import socket
import stat
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

from minipic.engine_ext.span_store.tiers.base import KEY_RE, logger
from minipic.engine_ext.span_store.tiers.files import open_entry, read_exactly
from minipic.engine_ext.span_store.tiers.folder_usage import FolderUsage, pid_alive
from minipic.engine_ext.span_store.tiers.format import SUFFIX, TEMP_PREFIX, read_fingerprint

HOST_ID = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]

Found = list[tuple[int, str, int]]  # (mtime_ns, key, size) of every entry file
Temps = list[tuple[str, int, str, int]]  # (host id, pid, key, size) of every temp file kept


def listdir(path: Path | str) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []


def key_of(shard: str, name: str) -> str | None:
    """The key an entry file's name stands for, or None (a temp file, a stranger's file)."""
    if not name.endswith(SUFFIX):
        return None
    key = name[:-len(SUFFIX)]
    if key[:2] != shard or not KEY_RE.fullmatch(key):
        return None
    return key


class DirIndex:
    """The index of one tier instance (module docstring). Thread-safe."""

    def __init__(self, root: Path, usage: FolderUsage, stale_temp_s: float,
                 count: Callable[[str], None]) -> None:
        self.root = root
        self.usage = usage
        self.stale_temp_s = stale_temp_s
        self._count = count
        self._lock = threading.Lock()
        self._scan_lock = threading.Lock()  # one scan or listing at a time
        # key -> (size, mtime_ns), least recently used first: what eviction may pick
        self._lru: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._listed: set[str] = set()  # names the last listing found (has() only)
        self._recent: set[str] | None = None  # keys we indexed while a scan runs
        self.bytes = 0  # sum of the sizes in _lru
        self.last_scan = 0.0
        self._refresher: threading.Thread | None = None

    def __contains__(self, key: str) -> bool:
        return key in self._lru or key in self._listed

    def __len__(self) -> int:
        return len(self._lru)

    # -- what this process did or saw --------------------------------------------------------

    def touch(self, key: str, size: int, mtime_ns: int, *, only_new: bool = False) -> None:
        """``key`` is on disk: most recently used now (unless ``only_new`` and already known)."""
        with self._lock:
            if only_new and key in self._lru:
                return
            old = self._lru.pop(key, None)
            if old is not None:
                self.bytes -= old[0]
            self._lru[key] = (size, mtime_ns)
            self.bytes += size
            if self._recent is not None:
                self._recent.add(key)

    def forget(self, key: str) -> None:
        with self._lock:
            old = self._lru.pop(key, None)
            if old is not None:
                self.bytes -= old[0]
            self._listed.discard(key)

    def clear(self) -> None:
        with self._lock:
            self._lru.clear()
            self._listed.clear()
            self.bytes = 0

    # -- room --------------------------------------------------------------------------------

    def reserve(self, key: str, size: int, capacity: int, interval_s: float) -> str | None:
        """The ledger's token for writing ``size`` bytes of ``key`` (``FolderUsage.reserve``),
        after a rescan if the first try found nothing known left to evict or no count; None if
        they still do not fit. ``OSError`` when the ledger cannot be used."""
        token = self.usage.reserve(key, size, capacity, self.evict)
        if token is None:
            counted = self.usage.counted()
            self.rescan(correct=not counted or self.usage.correction_due(interval_s))
            token = self.usage.reserve(key, size, capacity, self.evict)
        return token

    def settle(self, token: str, key: str, size: int, mtime_ns: int | None,
               replaced: int = 0) -> None:
        """The write of ``token`` is over (``mtime_ns`` None: nothing of ours was published)."""
        try:
            self.usage.settle(token, size, mtime_ns is not None, replaced)
        except OSError:
            pass  # the reservation stays counted until a correction drops it (an over-count)
        if mtime_ns is not None:
            self.touch(key, size, mtime_ns)

    def evict(self, need: int) -> int:
        """Delete least recently used entries until ``need`` bytes are freed or nothing known
        is left; the bytes this process's unlinks freed. Runs under the ledger's lock."""
        freed = 0
        second_chance: set[str] = set()
        while freed < need:
            with self._lock:
                if not self._lru:
                    break
                key, (size, mtime) = self._lru.popitem(last=False)
                self.bytes -= size
                self._listed.discard(key)
            path = self.root / key[:2] / f"{key}{SUFFIX}"
            try:
                st = os.lstat(path)
            except OSError:
                continue  # already gone: whoever removed it was charged for it
            if st.st_mtime_ns > mtime and key not in second_chance:
                second_chance.add(key)  # another process read or wrote it since we looked
                self.touch(key, st.st_size, st.st_mtime_ns, only_new=True)
                continue
            try:
                os.unlink(path)
            except OSError:
                continue
            freed += st.st_size
            self._count("evictions")
        return freed

    # -- scans -------------------------------------------------------------------------------

    def keys(self) -> Iterator[str]:
        """Keys of the entry files in the folder now (any writer's; names only)."""
        for shard in listdir(self.root):
            if shard.name.startswith(".") or not shard.is_dir(follow_symlinks=False):
                continue
            for item in listdir(shard.path):
                key = key_of(shard.name, item.name)
                if key is not None:
                    yield key

    def rescan(self, correct: bool) -> Found:
        """Stat every entry (the index becomes what the folder holds, LRU by mtime), remove
        stray temp files, and correct the folder's ledger if ``correct``. The entries found."""
        with self._scan_lock:
            added = None
            if correct:
                with contextlib.suppress(OSError):
                    added = self.usage.added()
            with self._lock:
                self._recent = set()
            found, temps = self._scan()
            with self._lock:
                index = OrderedDict((key, (size, mtime)) for mtime, key, size in sorted(found))
                for key in self._recent or ():  # indexed while we scanned: newer than the scan
                    if key in self._lru:
                        index.pop(key, None)
                        index[key] = self._lru[key]
                self._lru, self._listed, self._recent = index, set(), None
                self.bytes = sum(size for size, _ in index.values())
            if added is not None:
                with contextlib.suppress(OSError):
                    self.usage.correct(sum(size for _, _, size in found), temps, added)
        return found

    def refresh(self) -> None:
        """Names only (no stat): what ``has`` answers from, for entries other processes wrote
        or removed since. Skipped while a rescan runs (it does the same and more)."""
        if not self._scan_lock.acquire(blocking=False):
            return
        try:
            with self._lock:
                self._recent = set()
            names = set(self.keys())
            with self._lock:
                recent, self._recent = self._recent or set(), None
                for key in [k for k in self._lru if k not in names and k not in recent]:
                    self.bytes -= self._lru.pop(key)[0]  # removed by someone else
                self._listed = names
        finally:
            self._scan_lock.release()

    def start_refresher(self, interval_s: float) -> None:
        """Refresh every ``interval_s`` on a daemon thread (once; it ends with the index)."""
        if self._refresher is not None or interval_s <= 0:
            return
        with self._lock:
            if self._refresher is not None:
                return
            self._refresher = threading.Thread(
                target=_refresh_loop, args=(weakref.ref(self), interval_s), daemon=True,
                name=f"span-store-refresh-{self.root.name}")
        self._refresher.start()

    def _scan(self) -> tuple[Found, Temps]:
        found: Found = []
        temps: Temps = []
        now = time.time()
        for shard in listdir(self.root):
            if shard.name.startswith(".") or not shard.is_dir(follow_symlinks=False):
                continue
            for item in listdir(shard.path):
                if item.name.startswith(TEMP_PREFIX):
                    if self._remove_if_stale(Path(item.path), item.name, now):
                        self._count("temps_removed")
                    else:
                        temps.append(self._temp_of(item))
                    continue
                key = key_of(shard.name, item.name)
                if key is None:
                    continue
                try:
                    st = item.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    found.append((st.st_mtime_ns, key, st.st_size))
        self.last_scan = time.monotonic()
        return found, temps

    @staticmethod
    def _temp_of(item: os.DirEntry) -> tuple[str, int, str, int]:
        parts = item.name.split(".", 5)  # '', 'tmp', host id, pid, random, key
        try:
            size = item.stat(follow_symlinks=False).st_size
        except OSError:
            size = 0
        if len(parts) != 6 or not parts[3].isdigit():
            return ("", 0, "", size)
        return (parts[2], int(parts[3]), parts[5], size)

    def _remove_if_stale(self, path: Path, name: str, now: float) -> bool:
        """Remove a temp file no live writer can own: not ``flock``-ed by anyone and either its
        writer's pid is dead on this host or it is older than ``stale_temp_s`` (a writer on
        another node whose lock this mount does not show is still protected by the age rule)."""
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
            dead_here = (locked_by_us and len(parts) == 6 and parts[2] == HOST_ID
                         and parts[3].isdigit() and not pid_alive(int(parts[3])))
            if dead_here or now - st.st_mtime > self.stale_temp_s:
                os.unlink(path)
                return True
            return False
        except OSError:
            return False
        finally:
            os.close(fd)


def _refresh_loop(ref: weakref.ref[DirIndex], interval_s: float) -> None:
    while True:
        time.sleep(interval_s)
        index = ref()
        if index is None:
            return
        try:
            index.refresh()
        except Exception:  # noqa: BLE001 (a listing that failed is retried next time)
            logger.debug("span store: listing %s failed", index.root, exc_info=True)
        del index


def foreign_sample(root: Path, found: Found, sample: int, fingerprint: bytes,
                   max_bytes: int) -> tuple[int, int, set[str]]:
    """Read up to ``sample`` entry headers spread over ``found``: ``(entries of another
    configuration, headers read, their fingerprints (shortened))``."""
    step = max(1, len(found) // sample)
    picked = found[::step][:sample]
    foreign: set[str] = set()
    hits = 0
    for _, key, _ in picked:
        try:
            fd, _st = open_entry(root / key[:2], f"{key}{SUFFIX}", max_bytes)
        except OSError:
            continue
        try:
            fp = read_fingerprint(partial(read_exactly, fd))
        except OSError:
            continue
        finally:
            os.close(fd)
        if fp is not None and fp != fingerprint:
            hits += 1
            foreign.add(fp.decode(errors="replace")[:48])
    return hits, len(picked), foreign
