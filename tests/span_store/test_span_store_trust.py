"""The span store's directory tier trusts no other local writer or reader
(``engine_ext/span_store/tiers/files.py``), on real files, modes and processes:

* entries and folders are private (0600 / 0700) whatever the umask; group access is explicit;
* another user (``nobody``, a real second process) reads neither entries nor the secret;
* entries forged without the store's secret, or copied from another store, are misses;
* symlinks, FIFOs, folders and oversized files at an entry name are refused without blocking;
* a secret others could read or replace means no store at all;
* replicas started together agree on one secret;
* deleting or replacing the secret between two replicas' starts deletes no valid entry, and
  both adopt the new secret;
* a secret or store folder another user owns means no store (mode bits are not enough);
* fault injection (``benchmarks/store_faults.py``): every kind, only misses, 0 loaded.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.store_tiers import key_for

from minipic.engine_ext.span_store.tiers import DirTier, Entry, TieredStore
from minipic.engine_ext.span_store.tiers.files import SECRET_NAME

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parents[2]
FP = "trust|model=tiny|dtype=float32|bs=16"


def entry_for(rng: random.Random, size: int = 4000) -> Entry:
    return Entry(rng.randbytes(size), {"home": rng.randrange(4096)})


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@contextlib.contextmanager
def umask(value: int) -> Iterator[None]:
    old = os.umask(value)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A folder every user can traverse (``tmp_path`` sits under a 0700 folder of root's, which
    would keep another user out whatever the store does)."""
    path = Path(tempfile.mkdtemp(prefix="minipic-trust-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize(("group_access", "files", "folders", "mask"),
                         [(False, 0o600, 0o700, 0o000), (True, 0o660, 0o2770, 0o077)])
def test_modes_are_the_tiers_whatever_the_umask(tmp_path, rng, group_access, files, folders,
                                                mask):
    root = tmp_path / "a" / "store"
    with umask(mask):
        tier = DirTier(root, 64 << 20, FP, group_access=group_access)
        keys = [key_for(rng) for _ in range(5)]
        for k in keys:
            assert tier.put(k, entry_for(rng))
    assert mode(root) == folders and mode(root.parent) == folders
    assert mode(root / SECRET_NAME) == files
    for k in keys:
        assert mode(tier.entry_path(k)) == files and mode(tier.entry_path(k).parent) == folders


def _as_nobody(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                           sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=30)


def test_another_user_reads_no_entry_and_no_secret(open_dir, rng):
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run a second user")
    tier = DirTier(open_dir / "store", 64 << 20, FP)
    key = key_for(rng)
    assert tier.put(key, entry_for(rng))
    entry, secret = tier.entry_path(key), open_dir / "store" / SECRET_NAME
    reads = "import sys\nfor p in sys.argv[1:]:\n    print(open(p, 'rb').read(1) and 'READ')"

    def nobody_reads(*paths: Path) -> subprocess.CompletedProcess:
        return _as_nobody(reads.replace("sys.argv[1:]", repr([str(p) for p in paths])))

    # as created, the store folder alone keeps others out
    assert "PermissionError" in nobody_reads(entry).stderr
    # a looser folder (a shared parent made 0755 by hand) still leaves files and secret private
    for folder in (open_dir / "store", entry.parent):
        folder.chmod(0o755)
    for path in (entry, secret):
        res = nobody_reads(path)
        assert res.returncode != 0 and "PermissionError" in res.stderr, res
    # the check can fail: a file of the default 0644 in the same folder is readable to nobody
    leaked = entry.parent / "leaked"
    leaked.write_bytes(b"x")
    leaked.chmod(0o644)
    assert nobody_reads(leaked).stdout.strip() == "READ"


def test_entries_forged_are_removed_and_another_stores_are_kept_misses(tmp_path, rng):
    """A forger can claim our key id (every header shows it) but not make the MAC: removed.
    A valid entry under another secret (another store's, or ours before a rotation) is nobody's
    damage: a miss that stays."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from store_faults import _forge

    from minipic.engine_ext.span_store.tiers.files import key_id

    tier = DirTier(tmp_path / "store", 64 << 20, FP)
    other = DirTier(tmp_path / "other", 64 << 20, FP)
    store = TieredStore(None, [tier])
    ours = key_id((tmp_path / "store" / SECRET_NAME).read_bytes())
    for forged in ("unkeyed", "other secret", "other store"):
        key, entry = key_for(rng), entry_for(rng)
        path = tier.entry_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        if forged == "other store":
            assert other.put(key, entry)
            shutil.copyfile(other.entry_path(key), path)
        else:
            path.write_bytes(_forge(key, entry, None if forged == "unkeyed" else os.urandom(32),
                                    FP, claimed_key_id=ours))
        tier.rescan()  # has() answers from what the tier knows (dir_index): now the name
        assert tier.has(key)  # a name is there...
        assert store.get(key) is None, forged  # ...but never our KV
        assert path.exists() == (forged == "other store"), forged
    stats = tier.stats()
    assert (stats["corrupt_removed"], stats["other_key_skipped"], stats["hits"]) == (2, 1, 0)
    # the secret is what makes the difference: with it, the same bytes verify
    key, entry = key_for(rng), entry_for(rng)
    secret = (tmp_path / "store" / SECRET_NAME).read_bytes()
    tier.entry_path(key).parent.mkdir(parents=True, exist_ok=True)
    tier.entry_path(key).write_bytes(_forge(key, entry, secret, FP))
    assert tier.get(key) == entry


def test_symlinks_fifos_folders_and_oversized_files_are_refused(tmp_path, rng):
    tier = DirTier(tmp_path / "store", 1 << 20, FP)
    store = TieredStore(None, [tier])
    outside = tmp_path / "outside"
    outside.mkdir()
    cases = {}
    for kind in ("symlink", "fifo", "folder", "oversized", "dev_null"):
        key, entry = key_for(rng), entry_for(rng)
        assert tier.put(key, entry)
        path = tier.entry_path(key)
        valid = path.read_bytes()
        path.unlink()
        if kind == "symlink":  # this very entry, valid, kept outside: following it would load
            (outside / path.name).write_bytes(valid)
            path.symlink_to(outside / path.name)
        elif kind == "fifo":
            os.mkfifo(path, 0o600)
        elif kind == "folder":
            path.mkdir()
        elif kind == "oversized":
            with path.open("wb") as fh:
                fh.truncate((1 << 20) + 1)
        else:
            path.symlink_to("/dev/null")
        cases[kind] = key
    for kind, key in cases.items():
        got: list[object] = []
        reader = threading.Thread(target=lambda k=key, out=got: out.append(store.get(k)),
                                  daemon=True)
        reader.start()
        reader.join(10)
        assert not reader.is_alive(), f"a {kind} at an entry name blocked the read"
        assert got == [None], kind
        if kind != "folder":
            assert not os.path.lexists(tier.entry_path(key)), f"the {kind} was left in place"
    assert (outside / tier.entry_path(cases["symlink"]).name).exists()  # target untouched
    # a shard folder replaced by a symlink to a folder of valid entries: neither read nor written
    key, entry = key_for(rng), entry_for(rng)
    assert tier.put(key, entry)
    shard = tier.entry_path(key).parent
    shutil.move(shard, outside / "shard")
    shard.symlink_to(outside / "shard")
    assert tier.get(key) is None
    other = key[:2] + key_for(rng)[2:]
    assert not tier.put(other, entry) and not (outside / "shard" / f"{other}.kvb").exists()
    assert tier.writes_enabled  # one refused write, not a full disk: writing goes on


@pytest.mark.parametrize("problem", ["world readable", "group writable", "wrong size",
                                     "symlink", "unreadable folder"])
def test_a_secret_others_could_know_means_no_store(tmp_path, rng, problem):
    root = tmp_path / "store"
    first = DirTier(root, 64 << 20, FP)
    key, entry = key_for(rng), entry_for(rng)
    assert first.put(key, entry)
    secret = root / SECRET_NAME
    if problem == "world readable":
        secret.chmod(0o644)
    elif problem == "group writable":
        secret.chmod(0o620)
    elif problem == "wrong size":
        secret.write_bytes(secret.read_bytes() + b"!")
    elif problem == "symlink":
        (tmp_path / "elsewhere").write_bytes(secret.read_bytes())
        secret.unlink()
        secret.symlink_to(tmp_path / "elsewhere")
    else:
        secret.unlink()
        secret.mkdir()
    again = DirTier(root, 64 << 20, FP)
    assert not again.usable and again.get(key) is None and not again.has(key)
    assert not again.put(key_for(rng), entry) and again.stats()["usable"] is False


def test_replicas_started_together_agree_on_one_secret(tmp_path, seed):
    """Eight processes open a fresh store at once; each writes an entry; each reads all."""
    code = (
        "import sys, time, random\n"
        "from engine_ext.span_store.tiers import DirTier, Entry\n"
        "root, me, start = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])\n"
        "while time.time() < start: pass\n"
        "tier = DirTier(root, 1 << 26, 'fp', refresh_s=0.05)  # has() learns of others' writes\n"
        f"key = lambda i: random.Random({seed} + i).randbytes(32).hex()\n"
        "assert tier.put(key(me), Entry(b'%d' % me * 100, {'me': me}))\n"
        "deadline = time.time() + 20\n"
        "while not all(tier.has(key(i)) for i in range(8)) and time.time() < deadline:\n"
        "    time.sleep(0.01)\n"
        "print(sum(tier.get(key(i)) is not None for i in range(8)))\n")
    import time

    start = time.time() + 3
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "s"), str(i),
                               str(start)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for i in range(8)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-500:] for o in outs]
    assert [o[0].strip() for o in outs] == ["8"] * 8
    assert not list((tmp_path / "s").glob(".store-key.tmp*"))


def test_fault_injection_gives_only_misses(tmp_path, seed):
    """A slice of ``benchmarks/store_faults.py`` (the closing note's 10,000 cases)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from store_faults import KINDS, run

    result = run(cases=40 * len(KINDS), seed=seed, work=tmp_path, progress=False)
    assert result["loaded"] == 0 and result["valid_deleted"] == 0, result
    for kind in KINDS:
        row = result["kinds"][kind]
        misses = 0 if kind == "secret_other_owner" and os.geteuid() != 0 else 40
        assert row["cases"] == 40 and row["misses"] == misses and row["loaded"] == 0, (kind, row)
        assert row["valid_deleted"] == 0, (kind, row)
    assert result["tier"]["hits"] == result["cases"]  # the control entry, after every case


def test_two_replicas_across_a_key_deletion_delete_no_valid_entry(tmp_path, rng, caplog):
    """The key is deleted between two replicas' starts: the second creates a new secret. The
    first adopts it (told by an entry under an unknown key id, or by its periodic check),
    neither deletes the other's entries, and both go on reading and writing."""
    root = tmp_path / "store"
    first = DirTier(root, 64 << 20, FP)
    old = {key_for(rng): entry_for(rng) for _ in range(4)}
    for k, e in old.items():
        assert first.put(k, e)
    (root / SECRET_NAME).unlink()
    second = DirTier(root, 64 << 20, FP)  # starts after the deletion: a new secret
    new = {key_for(rng): entry_for(rng) for _ in range(4)}
    for k, e in new.items():
        assert second.put(k, e)
    with caplog.at_level("WARNING", logger="vllm.minipic.span_store"):
        # the first replica meets an entry under the new key id: it re-reads the secret
        assert all(first.get(k) == e for k, e in new.items())
        # entries under the old secret are misses for both, and stay on disk
        for k in old:
            assert first.get(k) is None and second.get(k) is None
            assert first.entry_path(k).is_file()
    assert first.stats()["key_changes"] == 1 and second.stats()["key_changes"] == 0
    assert sum("the store secret was rotated;" in r.getMessage() for r in caplog.records) == 1
    for tier in (first, second):
        assert tier.stats()["corrupt_removed"] == 0
        assert tier.stats()["other_key_skipped"] == len(old)
    # both write under the one secret now: each reads the other's new entries
    k1, e1, k2, e2 = key_for(rng), entry_for(rng), key_for(rng), entry_for(rng)
    assert first.put(k1, e1) and second.put(k2, e2)
    assert second.get(k1) == e1 and first.get(k2) == e2
    assert len(list(first.keys())) == len(old) + len(new) + 2
    # a block recomputed after the rotation replaces its unreadable old entry (keys do not
    # name the secret): the next read hits, and nothing else was touched
    again, fresh = next(iter(old)), entry_for(rng)
    assert second.put(again, fresh) and first.get(again) == fresh
    assert second.stats()["old_secret_replaced"] == 1
    assert first.put(again, entry_for(rng)) and first.get(again) == fresh  # now ours: kept
    assert len(list(first.keys())) == len(old) + len(new) + 2


def test_a_replaced_secret_is_adopted_by_the_periodic_check(tmp_path, rng, monkeypatch):
    """Rotation by replacing the file: a running tier notices on its next read or write once
    the check interval passed, and writes under the new secret."""
    import minipic.engine_ext.span_store.tiers.directory as directory
    root = tmp_path / "store"
    tier = DirTier(root, 64 << 20, FP)
    key, entry = key_for(rng), entry_for(rng)
    assert tier.put(key, entry)
    replacement = root / "replacement"
    replacement.write_bytes(os.urandom(32))
    replacement.chmod(0o600)
    os.replace(replacement, root / SECRET_NAME)
    assert tier.get(key) == entry  # within the interval: the secret we read still holds
    monkeypatch.setattr(directory, "KEY_CHECK_INTERVAL_S", 0.0)
    assert tier.get(key) is None and tier.entry_path(key).is_file()  # old key: kept miss
    assert tier.stats()["key_changes"] == 1
    other = key_for(rng)
    assert tier.put(other, entry)
    assert DirTier(root, 64 << 20, FP).get(other) == entry  # a fresh process verifies it


@pytest.mark.parametrize("owned", ["secret", "folder"])
def test_a_secret_or_folder_of_another_user_means_no_store(tmp_path, rng, caplog, owned):
    """Another user created the folder or its 0600 secret first (a server running as root in a
    container would read it): they could forge entries, so the tier refuses and says why."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file to another user")
    root = tmp_path / "store"
    writer = DirTier(root, 64 << 20, FP)
    key, entry = key_for(rng), entry_for(rng)
    assert writer.put(key, entry)
    target = root / SECRET_NAME if owned == "secret" else root
    os.chown(target, 65534, 65534)
    with caplog.at_level("WARNING", logger="vllm.minipic.span_store"):
        again = DirTier(root, 64 << 20, FP)
    assert not again.usable and again.get(key) is None
    assert any("belongs to user 65534" in r.getMessage() and "not to this server" in
               r.getMessage() for r in caplog.records), caplog.text
    # group mode trusts the configured group, and only it
    assert not DirTier(root, 64 << 20, FP, group_access=True).usable
    os.chmod(root / SECRET_NAME, 0o640)
    for path in (root, root / SECRET_NAME):  # both must carry the store's group
        os.chown(path, -1, 65534)
    grouped = DirTier(root, 64 << 20, FP, group_access=True, group=65534)
    assert grouped.usable and grouped.get(key) == entry
