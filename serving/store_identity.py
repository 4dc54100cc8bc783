"""Whether a cluster's replicas really share one span store, and how the span router routes then.

Why it is checked and not assumed: ``minipic serve --replicas N`` makes the store directory the
replicas' shared tier, and a path names a directory only on one machine. Replicas on several
nodes, each with that path on its own local disk (the default, ``<minipic cache>/span-store``),
have one store each; routing them as if they shared one (``max_imbalance`` 1: a miss is only a
load from the store) spreads a question's spans over replicas that each compute them again.

So each replica reports the store's **identity** (``store_id`` in its routing stats): a random
id kept in ``<root>/.store-id``, created once by whichever process gets there first (``O_EXCL``
and ``link``, as the store's secret is created) and read back by every other, joined with the
file's inode number. Replicas reaching one directory, on one node or through a shared mount (NFS,
CephFS, Lustre report the server's inode to every client), read the same file and report the
same identity; replicas with a directory each create an id each. A store copied to another
node (``minipic index`` once, then rsync) copies the id but not the inode: two stores, as it
should. The router (``decide``) takes the shared-store routing only when every replica reports
one identity; a replica reporting none (no shared tier, an unusable one, not reported yet) makes
it route as for per-replica stores, which costs at worst some load balance, never recomputation.

The id file sits in the store root beside ``.store-key``; the tier's scans skip dot-files.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ID_NAME = ".store-id"
ID_HEX = 32
STAT_KEY = "store_id"  # the replica's routing stats entry
# The span router's max_imbalance: how many requests in flight a replica holding a request's
# spans may have above the least loaded one and still get it. Alone, a replica's pool is the only
# place its spans are, and a miss recomputes them: affinity is worth a queue. With a shared span
# store, a replica that misses loads the spans other replicas stored instead, so affinity is only
# a tie-break between replicas within one request of the least loaded (measured,
# benchmarks/cluster_routing.py: with the store, 4 piled load on the replica that computed the
# spans and ran at 0.85x round robin's samples/s).
MAX_IMBALANCE = 4
MAX_IMBALANCE_SHARED_STORE = 1
_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# a child of Ray Serve's logger: Serve's handlers on it (propagation to the root is off) put the
# router's decisions in the ingress replica's log
log = logging.getLogger("ray.serve.minipic")


def _read_id(path: Path) -> str | None:
    """The id in ``path`` joined with the file's inode; None when missing or not an id (being
    written by a process without hard links, or not ours)."""
    try:
        fd = os.open(path, _OPEN_READ)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        raw = os.read(fd, ID_HEX + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    text = raw.decode("ascii", errors="replace")
    if len(text) != ID_HEX or any(c not in "0123456789abcdef" for c in text):
        return None
    return f"{text}:{st.st_ino}"


def _create_id(root: Path, file_mode: int) -> None:
    """Publish a new id unless one is there: written whole to a temp file, then linked to its
    name (``link`` fails if the name exists: the first process wins, the others read its id)."""
    value = secrets.token_hex(ID_HEX // 2).encode()
    final = root / ID_NAME
    tmp = root / f"{ID_NAME}.tmp.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, file_mode)
    try:
        try:
            os.fchmod(fd, file_mode)
            os.write(fd, value)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, final)
        except FileExistsError:
            return
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            # no hard links on this filesystem: O_EXCL on the name itself (readers retry the
            # moment between its creation and its one write)
            with contextlib.suppress(FileExistsError):
                direct = os.open(final, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                                 file_mode)
                try:
                    os.write(direct, value)
                finally:
                    os.close(direct)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def store_identity(root: str | Path, *, group_access: bool = False,
                   group: int | str | None = None, attempts: int = 5) -> str | None:
    """The identity of the store at ``root`` (see the module docstring), created if it has none;
    None when the folder cannot hold one or is not trusted as a store (another user's: the tier
    would not use it either, ``engine_ext.span_store.tiers.files``)."""
    from minipic.engine_ext.span_store.tiers.files import Modes, check_root, make_dir

    path = Path(root)
    try:
        modes = Modes.for_access(group_access, group)
        make_dir(path, modes)
        check_root(path, modes)
    except (OSError, ValueError) as exc:
        log.warning("span store at %s: no store identity (%s); the router treats this replica's "
                    "store as its own", path, getattr(exc, "strerror", None) or exc)
        return None
    for attempt in range(attempts):
        found = _read_id(path / ID_NAME)
        if found is not None:
            return found
        try:
            _create_id(path, modes.file)
        except OSError as exc:
            log.warning("span store at %s: cannot create %s (%s); the router treats this "
                        "replica's store as its own", path, ID_NAME, exc.strerror or exc)
            return None
        found = _read_id(path / ID_NAME)
        if found is not None:
            return found
        time.sleep(0.05 * (attempt + 1))  # an unreadable id file: another writer's moment
    return None


class ReplicaStore:
    """A replica's store identity, as its routing stats report it: read once, and again when
    the id file changed (the store folder deleted and recreated is another store). A store that
    has none (unusable folder) is tried again every ``retry_s``, not at every report."""

    def __init__(self, root: str | Path | None, *, group_access: bool = False,
                 group: int | str | None = None, retry_s: float = 60.0) -> None:
        self.root = None if root is None else Path(root)
        self.group_access = group_access
        self.group = group
        self.retry_s = retry_s
        self._stamp: tuple[int, int] | None = None
        self._identity: str | None = None
        self._retry_at = 0.0

    @classmethod
    def of_settings(cls, settings: object) -> ReplicaStore:
        """The store every replica of ``settings`` is pointed at (the shared tier; none when the
        plugin or the store is off)."""
        store = getattr(settings, "span_store", None)
        if not getattr(settings, "pic", False) or store is None:
            return cls(None)
        return cls(store.shared_dir, group_access=store.group_access,
                   group=getattr(store, "group", None))

    def _stamp_now(self) -> tuple[int, int] | None:
        assert self.root is not None
        try:
            st = os.lstat(self.root / ID_NAME)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns)

    def identity(self) -> str | None:
        if self.root is None:
            return None
        stamp = self._stamp_now()
        if self._identity is not None and stamp is not None and stamp == self._stamp:
            return self._identity
        if self._identity is None and time.monotonic() < self._retry_at:
            return None
        self._identity = store_identity(self.root, group_access=self.group_access,
                                        group=self.group)
        self._stamp = self._stamp_now()
        if self._identity is None:
            self._retry_at = time.monotonic() + self.retry_s
        return self._identity


@dataclass(frozen=True)
class StoreDecision:
    """How the span router treats the replicas' stores, and why (logged, and in its state).

    ``kind``: ``shared`` (one identity from every replica), ``several`` (every replica reports
    one, not all the same: a directory per node), ``partial`` (some report none yet, or have no
    usable store), ``none`` (no replica reports a shared store)."""

    shared: bool
    kind: str
    why: str
    max_imbalance: int


def decide(identities: Iterable[str | None]) -> StoreDecision:
    """Shared-store routing only when every replica reports the same store identity."""
    ids = list(identities)
    known = {i for i in ids if i}
    if ids and all(ids) and len(known) == 1:
        return StoreDecision(True, "shared", f"{len(ids)} replica(s) report one span store",
                             MAX_IMBALANCE_SHARED_STORE)
    if not known:
        return StoreDecision(False, "none", "no replica reports a shared span store",
                             MAX_IMBALANCE)
    if all(ids):
        return StoreDecision(False, "several", f"the {len(ids)} replicas report {len(known)} "
                             f"different span stores (the store directory is not one shared "
                             f"folder: e.g. a local disk on each node)", MAX_IMBALANCE)
    missing = sum(1 for i in ids if not i)
    return StoreDecision(False, "partial", f"{missing} of {len(ids)} replicas report no span "
                         f"store (not yet, or theirs is unusable)", MAX_IMBALANCE)


def log_decision(decision: StoreDecision) -> None:
    """Said once per change: a store the operator meant to share that is not shared is a
    warning (spans are computed once per store), the rest is information."""
    level = logging.WARNING if decision.kind == "several" else logging.INFO
    log.log(level, "minipic span router: %s; routing as for %s (max_imbalance %d)",
            decision.why, "one shared store" if decision.shared else "a store per replica",
            decision.max_imbalance)
