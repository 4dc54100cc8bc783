"""How a directory tier touches the filesystem without trusting it: the store's secret, file
modes, no-follow opens and the keyed MAC every entry carries.

A store entry is KV that a later request will attend to as if the engine had computed it, and a
store directory outlives the process that wrote it. Anyone who can write into the directory can
otherwise put bytes there under a key computed from public tokens. So:

* **Keyed MAC.** Every entry is authenticated with HMAC-SHA256 under a per-store secret: 32
  random bytes created at first use in ``<root>/.store-key``, mode 0600 (0660 with group
  access), published with ``link`` so two replicas starting together agree on one (``secret``
  creates, reads, re-checks and keeps it; this module owns the MAC). Replicas on a
  shared mount share the secret through the mount; a process that cannot read it when it starts
  gets no store (it could neither verify nor write entries others can verify). An entry forged
  without the secret fails the MAC and is a miss.
* **Key ids, so a rotation destroys nothing.** Every entry names the secret it was MAC-ed under
  by a key id (a hash of the secret, ``key_id``). An entry under another key id was written
  before a rotation, or copied from another store: a miss left in place, aged out by LRU. Only
  a MAC failure under our own key id is damage, and removed. Without the id, two replicas on
  either side of a rotation would each delete the other's valid entries as "damaged".
* **Owned by us.** Mode bits say who else may read or write a file, not who made it: a secret
  another user created first (before this server, running as root in a container, came up)
  with mode 0600 would pass a mode check, and that user could forge entries. The secret and
  the store root must belong to the server's user, or in group mode to the tier's group; a
  root others could write into (or, in group mode, enter or list) is refused (``check_root``).
* **Private by default.** Entries are created 0600 and folders 0700: another local user can
  neither read a tenant's KV nor plant files. ``group_access`` (for replicas running as
  different users of one group on a shared mount) makes them 0660 / 2770 and gives each the
  tier's group (``Modes``), set explicitly so neither the umask nor the primary group of
  whichever replica created a file or shard folder decides who else can use it.
* **Descriptors, not paths, after a check.** Folders and files are created relative to a
  descriptor of their parent opened with ``O_NOFOLLOW`` and get their mode and group through
  their own descriptor (``make_dir``, ``create_file``): a name swapped for a symlink in between
  is refused, never followed.
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
import stat
from dataclasses import dataclass
from pathlib import Path

KEY_ID_BYTES = 8
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_ENTRY = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW


class StoreUnusable(OSError):
    """The tier's secret cannot be created or read, or is not private: no store on it."""


@dataclass(frozen=True)
class Modes:
    """Permission bits of what a tier creates, and the group trusted in group mode (None: the
    tier is private to its user).

    Group mode is for replicas running as *different users* of one group: folders are 2770
    (the group may create entries and shard folders in any of them; setgid, so even a file made
    by a tool that sets no group inherits the tier's), files 0660 and every file and folder a
    tier creates is given the tier's group explicitly (``apply_owner``), never the creator's
    primary group -- whose other members would otherwise read the secret and every tenant's
    KV. Files are group-writable: entries are never modified in place, the group holds the
    secret anyway (a member who can write a file could as well MAC a forged one), and write
    access is what one replica needs to mark another's entry recently used (a utime to now)."""

    file: int
    dir: int
    group: int | None = None

    @classmethod
    def for_access(cls, group_access: bool, group: int | str | None = None) -> Modes:
        if not group_access:
            return cls(0o600, 0o700)
        return cls(0o660, 0o2770, resolve_group(group))

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
    to the tier's group: what another user created may be theirs to forge with. In group mode a
    file of ours that grants its group anything must carry the tier's group: another group's
    members (the creator's primary group, say) would read the secret or the KV."""
    uid = os.geteuid()
    if modes.group is not None and st.st_gid != modes.group and st.st_mode & 0o070:
        raise StoreUnusable(errno.EPERM, f"{what} {path} belongs to group {st.st_gid}, not to "
                                         f"the store's group {modes.group}, and grants it "
                                         f"access (mode {stat.S_IMODE(st.st_mode):o}): members "
                                         f"of group {st.st_gid} could read the secret or the KV; "
                                         f"chgrp -R {modes.group} the store folder")
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


def check_root(root: Path, modes: Modes) -> None:
    """Refuse a store root that is not the tier's to keep, with the reason:

    * another user's (in group mode: not the tier's group's): they could replace the secret;
    * writable by others, or in private mode by its group: whoever can create a name in the root
      can plant a shard folder of their own (and read every entry written into it) or a secret
      (in a setgid root it would even get the tier's group);
    * in group mode, of another group, or open to others at all (listing or traversing it);
    * in group mode, a server that is not in the tier's group (it could not give its files the
      group: the other replicas could not read them).
    """
    try:
        st = os.lstat(root)
    except OSError as exc:
        raise StoreUnusable(exc.errno, f"cannot stat the store folder {root}: "
                                       f"{exc.strerror or exc}") from exc
    if stat.S_ISLNK(st.st_mode):
        st = os.stat(root)  # a configured path may be a link; what it points at must be ours
    check_owner(st, root, modes, "the store folder")
    mode = stat.S_IMODE(st.st_mode)
    group = modes.group
    loose = mode & (0o002 if group is not None else 0o022)
    if loose or (group is not None and mode & 0o007):
        who = "every local user" if mode & 0o007 else f"members of group {st.st_gid}"
        raise StoreUnusable(errno.EPERM, f"the store folder {root} has mode {mode:o}: {who} "
                                         f"could {'plant files in' if loose else 'list'} it "
                                         f"(a shard folder or secret of theirs would get the "
                                         f"entries or forge them); chmod "
                                         f"{modes.dir:o} {root}")
    if group is None:
        return
    if st.st_gid != group:
        raise StoreUnusable(errno.EPERM, f"the store folder {root} belongs to group {st.st_gid}, "
                                         f"not to the store's group {group}: the other replicas "
                                         f"could not use it; chgrp -R {group} {root}")
    if os.geteuid() != 0 and group != os.getegid() and group not in os.getgroups():
        raise StoreUnusable(errno.EPERM, f"this server (user {os.geteuid()}) is not a member of "
                                         f"the store's group {group}: the files it made would "
                                         f"not be the group's")


def apply_owner(fd: int, modes: Modes, mode: int | None = None) -> None:
    """Give the file or folder open at ``fd`` the tier's mode (``modes.file`` unless ``mode``)
    and, in group mode, the tier's group -- through the descriptor, so what changes is what was
    created, whatever has been swapped in at its name since. The group first: a chown may clear
    a setgid bit, and a setgid bit set after it is kept (this process is in the group)."""
    if modes.group is not None and os.fstat(fd).st_gid != modes.group:
        os.fchown(fd, -1, modes.group)
    os.fchmod(fd, modes.file if mode is None else mode)


def open_folder(path: Path | str, dir_fd: int | None = None, shown: Path | None = None) -> int:
    """A descriptor of the folder ``path`` (relative to ``dir_fd`` when given; ``shown`` names
    it in errors), never through a symlink at its last component: ``OSError(ELOOP)`` says so;
    ``FileNotFoundError`` / ``NotADirectoryError`` when it is missing or not a folder."""
    try:
        return os.open(path, _OPEN_DIR, dir_fd=dir_fd)
    except OSError as exc:
        link = exc.errno == errno.ELOOP  # Linux says ENOTDIR for a link, O_DIRECTORY first
        if exc.errno == errno.ENOTDIR:
            with contextlib.suppress(OSError):
                link = stat.S_ISLNK(os.lstat(path, dir_fd=dir_fd).st_mode)
        if link:
            raise OSError(errno.ELOOP, f"the folder {shown or path} is a symlink") from exc
        raise


def create_file(folder: Path, name: str, modes: Modes) -> int:
    """A new file ``folder/name`` open for writing, with the tier's mode and group. It is created
    relative to a descriptor of ``folder`` opened without following a symlink, so a folder
    swapped for a link after any check is never written through. Raises like ``open_folder``
    for the folder, ``FileExistsError`` when the name is taken."""
    dir_fd = open_folder(folder)
    try:
        fd = os.open(name, _CREATE, modes.file, dir_fd=dir_fd)
        try:
            apply_owner(fd, modes)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dir_fd)
            raise
    finally:
        os.close(dir_fd)
    return fd


def make_dir(path: Path, modes: Modes) -> None:
    """``mkdir -p`` with the tier's folder mode and group on every folder it creates (not the
    umask's, nor the creator's primary group; a setgid bit is kept). Each folder is made and
    opened relative to its parent's descriptor and set through its own, without following a
    symlink: one swapped in between ``mkdir`` and the mode change is refused, never followed (a
    path-based chmod would have given its target -- anything, for a server running as root --
    the tier's mode and group). The part of ``path`` that exists is taken as configured (it may
    pass through links)."""
    missing: list[str] = []
    probe = path
    while not os.path.lexists(probe):
        missing.append(probe.name)
        if probe.parent == probe:
            break
        probe = probe.parent
    if not missing:
        return
    fd = os.open(probe, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in reversed(missing):
            try:
                os.mkdir(name, modes.dir, dir_fd=fd)
                made = True
            except FileExistsError:
                made = False  # another replica made it: its mode is the same rule's
            probe = probe / name
            child = open_folder(name, fd, shown=probe)
            os.close(fd)
            fd = child
            if made:
                apply_owner(fd, modes, modes.dir)
    finally:
        os.close(fd)


def __getattr__(name: str) -> object:
    """The secret's names moved to ``secret``; ``files.SECRET_NAME`` and the like still work
    for importers of this module (read lazily: ``secret`` imports this module)."""
    if name in ("SECRET_NAME", "SECRET_BYTES", "load_secret", "secret_stamp"):
        from minipic.engine_ext.span_store.tiers import secret

        return getattr(secret, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
