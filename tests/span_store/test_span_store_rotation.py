"""Rotating the span store's secret under running tiers (``engine_ext/span_store/tiers/secret.py``)
on real files, with several ``DirTier`` instances on one folder as replicas have:

* a replica that has not yet adopted a rotated secret, writing first, replaces no entry another
  replica wrote under the new one (it reads the secret file before any replacing write);
* a rotation landing between the read of the secret and its stamp is still adopted (the stamp
  is the read descriptor's);
* a secret file that reads bad for a while (a non-atomic rotation caught at 0644, a truncated
  file) keeps the last good secret: reads hit throughout, writes pause and resume after;
* a crashed secret creation's leftover name for the old secret does not survive a rotation.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from support.store_tiers import key_for

import minipic.engine_ext.span_store.tiers.directory as directory
from minipic.engine_ext.span_store.tiers import DirTier, Entry
from minipic.engine_ext.span_store.tiers.backoff import WriteBackoff
from minipic.engine_ext.span_store.tiers.files import SECRET_NAME

pytestmark = pytest.mark.fast

FP = "rotation|model=tiny|dtype=float32|bs=16"


def entry_for(rng: random.Random) -> Entry:
    return Entry(rng.randbytes(rng.randrange(1000, 9000)), {"home": rng.randrange(4096)})


class Clock:
    """A clock the test advances: the tier's back-offs made deterministic."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def write_secret(root: Path, secret: bytes, mode: int = 0o600) -> None:
    """Replace the secret file atomically by one holding ``secret`` (a new inode)."""
    tmp = root / "replacement"
    tmp.write_bytes(secret)
    tmp.chmod(mode)
    os.replace(tmp, root / SECRET_NAME)


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("rotation", ["replace", "delete"])
def test_a_stale_writer_replaces_no_entry_written_under_the_new_secret(tmp_path, rng, monkeypatch,
                                                                       rotation):
    """Two replicas on one folder; the secret is rotated; the one that has not looked at the file
    since writes first, over names the other just filled under the new secret: nothing of the
    other's is replaced, both read it, and the stale one adopts the new secret."""
    monkeypatch.setattr(directory, "KEY_CHECK_INTERVAL_S", 1e9)  # no periodic look: stale
    root = tmp_path / "store"
    stale = DirTier(root, 64 << 20, FP)
    before = {key_for(rng): entry_for(rng) for _ in range(3)}
    for k, e in before.items():
        assert stale.put(k, e)
    if rotation == "replace":
        write_secret(root, os.urandom(32))
    else:
        (root / SECRET_NAME).unlink()
    fresh = DirTier(root, 64 << 20, FP)  # starts after the rotation: the new secret
    recomputed = next(iter(before))
    new = {key_for(rng): entry_for(rng) for _ in range(3)} | {recomputed: entry_for(rng)}
    for k, e in new.items():
        assert fresh.put(k, e)
    assert fresh.stats()["old_secret_replaced"] == 1  # its own replace of an old entry
    for k in new:  # the stale replica recomputed the same blocks: its writes come first
        assert stale.put(k, entry_for(rng))
    for k, e in new.items():
        assert fresh.get(k) == e and stale.get(k) == e
    st = stale.stats()
    assert st["old_secret_replaced"] == 0 and st["key_changes"] == 1 and st["writes"] == 3
    assert st["already_present"] == len(new)
    # from now on both write under the one secret
    k1, e1, k2, e2 = key_for(rng), entry_for(rng), key_for(rng), entry_for(rng)
    assert stale.put(k1, e1) and fresh.put(k2, e2)
    assert fresh.get(k1) == e1 and stale.get(k2) == e2
    assert DirTier(root, 64 << 20, FP).get(k1) == e1


@pytest.mark.parametrize("when", ["start", "check"])
def test_a_rotation_between_reading_the_secret_and_its_stamp_is_adopted(tmp_path, rng,
                                                                       monkeypatch, when):
    """The secret file is replaced right after a tier read its bytes (a forced interleaving:
    ``os.read`` of the secret replaces the file before returning). The tier's next look at the
    file must see a change and adopt the new secret, not keep the bytes it read forever."""
    root = tmp_path / "store"
    first = DirTier(root, 64 << 20, FP)
    secret_path = os.path.realpath(root / SECRET_NAME)
    real_read = os.read
    armed: list[bytes] = []

    def read_then_rotate(fd: int, n: int) -> bytes:
        data = real_read(fd, n)
        if armed and os.readlink(f"/proc/self/fd/{fd}") == secret_path:
            write_secret(root, armed.pop())
        return data

    monkeypatch.setattr(os, "read", read_then_rotate)
    later = os.urandom(32)
    if when == "start":
        armed.append(later)
        tier = DirTier(root, 64 << 20, FP)  # reads the first secret while it is replaced
    else:
        tier = DirTier(root, 64 << 20, FP)
        monkeypatch.setattr(directory, "KEY_CHECK_INTERVAL_S", 0.0)
        write_secret(root, os.urandom(32))  # a rotation the tier's next check reads...
        armed.append(later)  # ...and another landing right after that read
        assert tier.get(key_for(rng)) is None
    assert not armed and (root / SECRET_NAME).read_bytes() == later
    monkeypatch.setattr(os, "read", real_read)
    monkeypatch.setattr(directory, "KEY_CHECK_INTERVAL_S", 0.0)
    key, entry = key_for(rng), entry_for(rng)
    assert tier.put(key, entry)  # looks at the file first: a change since what it read
    assert DirTier(root, 64 << 20, FP).get(key) == entry  # written under the file's secret
    assert tier.get(key) == entry
    assert tier.stats()["key_changes"] == (1 if when == "start" else 2)
    del first


@pytest.mark.parametrize("fault", ["world-readable copy", "truncated", "non-atomic rotation"])
def test_a_transiently_bad_secret_keeps_reads_and_pauses_writes(tmp_path, rng, monkeypatch, logs,
                                                                fault):
    """The secret file reads bad for a while: a copy of it put back at 0644 before its chmod,
    the file truncated in place, or a new secret written at 0644 and only then made 0600. The
    tier keeps the last good secret: every read hits during and after, writes pause while the
    file is bad (said once) and resume when it reads good; only a valid new secret is adopted."""
    monkeypatch.setattr(directory, "KEY_CHECK_INTERVAL_S", 0.0)
    clock = Clock()
    root = tmp_path / "store"
    tier = DirTier(root, 64 << 20, FP, backoff=WriteBackoff(clock=clock))
    stored = {key_for(rng): entry_for(rng) for _ in range(4)}
    for k, e in stored.items():
        assert tier.put(k, e)
    good = (root / SECRET_NAME).read_bytes()
    new = os.urandom(32)
    if fault == "world-readable copy":
        write_secret(root, good, mode=0o644)
    elif fault == "truncated":
        with open(root / SECRET_NAME, "r+b") as fh:
            fh.truncate(rng.randrange(0, 32))
    else:
        write_secret(root, new, mode=0o644)
    for _ in range(3):  # during: reads hit, writes are refused, the back-off retries the file
        for k, e in stored.items():
            assert tier.has(k) and tier.get(k) == e
        assert not tier.writes_enabled and not tier.put(key_for(rng), entry_for(rng))
        clock.now += 400
    assert tier.usable and tier.stats()["secret_unreadable"] == 1
    assert len(logs.warnings("secret cannot be used now")) == 1, logs.warnings("")
    # fixed: the next look after the back-off reads it good, and writing resumes
    if fault == "truncated":
        with open(root / SECRET_NAME, "r+b") as fh:
            fh.write(good)
    else:
        (root / SECRET_NAME).chmod(0o600)
    clock.now += 400
    assert tier.writes_enabled  # a look is due: a write is offered, and its check is the probe
    after = {key_for(rng): entry_for(rng) for _ in range(2)}
    for k, e in after.items():
        assert tier.put(k, e)
    assert tier.writes_enabled and len(logs.warnings("good again; writes resume")) == 1
    reader = DirTier(root, 64 << 20, FP)  # a process starting now verifies what was written
    for k, e in after.items():
        assert tier.get(k) == e and reader.get(k) == e
    rotated = fault == "non-atomic rotation"
    assert tier.stats()["key_changes"] == int(rotated)
    for k, e in stored.items():  # the old secret's entries: hits unless it was rotated away
        assert tier.get(k) == (None if rotated else e) and tier.entry_path(k).is_file()


def _host_id() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


@pytest.mark.parametrize("rotation", ["delete", "replace"])
def test_a_crashed_creation_leaves_no_name_for_the_old_secret(tmp_path, rng, monkeypatch,
                                                              rotation):
    """A creator killed between linking its temp file to ``.store-key`` and unlinking the temp
    leaves a second name for the secret. After a rotation no file in the store may still hold
    the old secret's bytes: whoever can read the folder could otherwise forge entries a replica
    still verifies... or restore it. A temp a live creator holds is left alone."""
    monkeypatch.setattr(directory, "KEY_CHECK_INTERVAL_S", 0.0)
    root = tmp_path / "store"
    tier = DirTier(root, 64 << 20, FP)
    old = (root / SECRET_NAME).read_bytes()
    pid = dead_pid()
    for name in (f".store-key.tmp.{pid}.{rng.randbytes(4).hex()}",  # as older versions named it
                 f".store-key.tmp.{_host_id()}.{pid}.{rng.randbytes(4).hex()}"):
        os.link(root / SECRET_NAME, root / name)
    live = root / f".store-key.tmp.{_host_id()}.{os.getpid()}.{rng.randbytes(4).hex()}"
    live.write_bytes(os.urandom(32))
    with open(live, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # its creator (this process) is still writing it
        if rotation == "delete":
            (root / SECRET_NAME).unlink()
        else:
            write_secret(root, os.urandom(32))
        key, entry = key_for(rng), entry_for(rng)
        assert tier.put(key, entry)  # adopts the new secret (creating it after a deletion)
        assert tier.stats()["key_changes"] == 1
        assert live.exists()
    holding = [p for p in root.rglob("*") if p.is_file() and p.read_bytes() == old]
    assert holding == [], holding
    assert DirTier(root, 64 << 20, FP).get(key) == entry


@pytest.mark.parametrize("unnamed", [True, False])
def test_secret_creation_leaves_no_temp_either_way(tmp_path, monkeypatch, unnamed):
    """Created from an unnamed ``O_TMPFILE`` file or, where there is none, a named locked temp:
    either way one 32-byte 0600 secret, with one name, and no temp of it in the folder."""
    import minipic.engine_ext.span_store.tiers.secret as secret

    monkeypatch.setattr(secret, "USE_TMPFILE", unnamed and secret.USE_TMPFILE)
    root = tmp_path / "store"
    DirTier(root, 64 << 20, FP)
    assert [p.name for p in root.iterdir() if p.name.startswith(SECRET_NAME)] == [SECRET_NAME]
    st = os.lstat(root / SECRET_NAME)
    assert st.st_size == 32 and st.st_mode & 0o777 == 0o600 and st.st_nlink == 1
