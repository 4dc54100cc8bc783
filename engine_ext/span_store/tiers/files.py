"""How a directory tier touches the filesystem without trusting it: the store's secret, file
modes, no-follow opens and the keyed MAC every entry carries.

A store entry is KV that a later request will attend to as if the engine had computed it, and a
store directory outlives the process that wrote it. Anyone who can write into the directory can
otherwise put bytes there under a key computed from public tokens. So:

* **Keyed MAC.** Every entry is authenticated with HMAC-SHA256 under a per-store secret: 32
  random bytes created at first use in ``<root>/.store-key``, mode 0600 (0640 with group
  access), published with ``link`` so two replicas starting together agree on one. Replicas on a
  shared mount share the secret through the mount; a process that cannot read it gets no store
  (it could neither verify nor write entries others can verify). An entry forged without the
  secret fails the MAC and is a miss.
* **Key ids, so a rotation destroys nothing.** Every entry names the secret it was MAC-ed under
  by a key id (a hash of the secret, ``key_id``). An entry under another key id was written
  before a rotation, or copied from another store: a miss left in place, aged out by LRU. Only
  a MAC failure under our own key id is damage, and removed. Without the id, two replicas on
  either side of a rotation would each delete the other's valid entries as "damaged".
* **Owned by us.** Mode bits say who else may read or write a file, not who made it: a secret
  another user created first (before this server, running as root in a container, came up)
  with mode 0600 would pass a mode check, and that user could forge entries. The secret and
  the store root must belong to the server's user, or in group mode to the tier's group.
* **Private by default.** Entries are created 0600 and folders 0700: another local user can
  neither read a tenant's KV nor plant files. ``group_access`` (for replicas running as
  different users of one group on a shared mount) makes them 0640 / 0750, set explicitly so the
  umask of whichever replica created a shard folder cannot lock the others out.
* **No-follow, regular files only, bounded reads.** An entry is opened relative to its shard
  folder, both with ``O_NOFOLLOW`` (a symlink planted at an entry name or a shard name is never
  followed), non-blocking (a FIFO swapped in cannot hang the engine's step), and anything that is
  not a regular file of at most ``max_bytes`` is refused before a byte is read.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

SECRET_NAME = ".store-key"
SECRET_BYTES = 32
KEY_ID_BYTES = 8
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_ENTRY = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class StoreUnusable(OSError):
    """The tier's secret cannot be created or read, or is not private: no store on it."""


@dataclass(frozen=True)
class Modes:
    """Permission bits of what a tier creates, and the group trusted in group mode (None: the
    tier is private to its user)."""

    file: int
    dir: int
    group: int | None = None

    @classmethod
    def for_access(cls, group_access: bool, group: int | str | None = None) -> Modes:
        if not group_access:
            return cls(0o600, 0o700)
        return cls(0o640, 0o750, resolve_group(group))

    @property
    def forbidden(self) -> int:
        """Bits a secret must not have: more than the tier would give it itself."""
        return 0o777 & ~self.file


def resolve_group(group: int | str | None) -> int:
    """A group id from a name or id; None is the server's own effective group."""
    if group is None or group == "":
        return os.getegid()
    if isinstance(group, int) or str(group).isdigit():
        return int(group)
    import grp

    try:
        return grp.getgrnam(str(group)).gr_gid
    except KeyError:
        raise ValueError(f"no group named {group!r} on this machine") from None


def check_owner(st: os.stat_result, path: Path, modes: Modes, what: str) -> None:
    """Raise ``StoreUnusable`` unless ``path`` belongs to this process's user, or in group mode
    to the tier's group: what another user created may be theirs to forge with."""
    uid = os.geteuid()
    if st.st_uid == uid:
        return
    if modes.group is not None and st.st_gid == modes.group:
        return
    trusted = f"user {uid}" + ("" if modes.group is None else f" or group {modes.group}")
    raise StoreUnusable(errno.EPERM, f"{what} {path} belongs to user {st.st_uid} (group "
                                     f"{st.st_gid}), not to this server's {trusted}: whoever "
                                     f"created it could forge entries; remove it or start the "
                                     f"server as its owner")


def key_id(secret: bytes) -> bytes:
    """The public name of a secret (written in every entry's header): a hash that says which
    key an entry was MAC-ed under without revealing the key."""
    return hashlib.sha256(b"minipic-store-key-id\0" + secret).digest()[:KEY_ID_BYTES]


def secret_stamp(root: Path) -> tuple[int, int, int, int] | None:
    """(device, inode, mtime, size) of the secret file, None when it is missing: a change means
    the secret was rotated (replaced or deleted and created anew) since it was read."""
    try:
        st = os.lstat(root / SECRET_NAME)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


def check_root(root: Path, modes: Modes) -> None:
    """Refuse a store root another user owns (they could replace the secret in it)."""
    try:
        st = os.lstat(root)
    except OSError as exc:
        raise StoreUnusable(exc.errno, f"cannot stat the store folder {root}: "
                                       f"{exc.strerror or exc}") from exc
    if stat.S_ISLNK(st.st_mode):
        st = os.stat(root)  # a configured path may be a link; what it points at must be ours
    check_owner(st, root, modes, "the store folder")


def make_dir(path: Path, modes: Modes) -> None:
    """``mkdir -p`` with the tier's folder mode on every folder it creates (not the umask's)."""
    missing: list[Path] = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=modes.dir)
        except FileExistsError:
            continue  # another replica made it: its mode is the same rule's
        with contextlib.suppress(OSError):
            os.chmod(folder, modes.dir)


def load_secret(root: Path, modes: Modes, proposed: bytes | None = None) -> bytes:
    """The store's MAC secret, created at first use (from ``proposed``, when a tier that lost its
    directory puts its own back, else at random). Whoever publishes first wins; everyone reads
    the published one. Raises ``StoreUnusable`` when it cannot be read or is readable or writable
    beyond the tier's own mode (another user could forge)."""
    path = root / SECRET_NAME
    try:
        return _read_secret(path, modes)
    except FileNotFoundError:
        pass
    tmp = root / f".store-key.tmp.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, modes.file)
        try:
            os.fchmod(fd, modes.file)
            os.write(fd, proposed or secrets.token_bytes(SECRET_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
        with contextlib.suppress(FileExistsError):  # another process published first: theirs
            os.link(tmp, path)
    except OSError as exc:
        raise StoreUnusable(exc.errno, f"cannot create the store secret {path}: "
                                       f"{exc.strerror or exc}") from exc
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return _read_secret(path, modes)


def _read_secret(path: Path, modes: Modes) -> bytes:
    try:
        fd = os.open(path, _OPEN_ENTRY)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise StoreUnusable(exc.errno, f"cannot open the store secret {path}: "
                                       f"{exc.strerror or exc}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != SECRET_BYTES:
            raise StoreUnusable(errno.EINVAL, f"the store secret {path} is not a "
                                              f"{SECRET_BYTES}-byte regular file")
        if st.st_mode & modes.forbidden:
            raise StoreUnusable(errno.EPERM, f"the store secret {path} has mode "
                                             f"{stat.S_IMODE(st.st_mode):o}: others could "
                                             f"forge entries (expected {modes.file:o})")
        check_owner(st, path, modes, "the store secret")
        data = os.read(fd, SECRET_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) != SECRET_BYTES:
        raise StoreUnusable(errno.EIO, f"the store secret {path} changed while read")
    return data


def entry_mac(secret: bytes, fixed: bytes, key: str, fingerprint: bytes, meta_json: bytes,
              payload: bytes | memoryview) -> bytes:
    """HMAC-SHA256 over the header's fixed fields (the key id among them), the key,
    fingerprint, metadata and payload: a copy under another key, a changed length field or key
    id, or any flipped bit never verifies."""
    key_b = key.encode()
    mac = hmac.new(secret, fixed, hashlib.sha256)
    mac.update(len(key_b).to_bytes(2, "little"))
    mac.update(key_b)
    mac.update(fingerprint)
    mac.update(meta_json)
    mac.update(payload)
    return mac.digest()


class NotAnEntry(OSError):
    """An entry name holds a symlink, FIFO, device, folder or an oversized file."""


def open_entry(shard: Path, name: str, max_bytes: int) -> tuple[int, os.stat_result]:
    """An open read-only descriptor of ``shard/name`` and its stat, following no symlink and
    refusing anything but a regular file of at most ``max_bytes``. ``FileNotFoundError`` when
    absent; ``NotAnEntry`` for what must never be read as KV."""
    try:
        dir_fd = os.open(shard, _OPEN_DIR)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotAnEntry(exc.errno, f"{shard} is not a folder") from exc
        raise
    try:
        try:
            fd = os.open(name, _OPEN_ENTRY, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise NotAnEntry(exc.errno, f"{shard / name} is a symlink") from exc
            raise
    finally:
        os.close(dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotAnEntry(errno.EINVAL, f"{shard / name} is not a regular file")
        if st.st_size > max_bytes:
            raise NotAnEntry(errno.EFBIG, f"{shard / name} is larger than the tier")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_exactly(fd: int, size: int) -> bytes:
    """``size`` bytes from ``fd`` (fewer only at end of file)."""
    chunks: list[bytes] = []
    left = size
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 24))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def remove_entry_name(shard: Path, name: str) -> None:
    """Unlink ``shard/name`` itself (a symlink is removed, never its target)."""
    with contextlib.suppress(OSError):
        dir_fd = os.open(shard, _OPEN_DIR)
        try:
            os.unlink(name, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
