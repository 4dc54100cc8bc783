"""Group mode and the filesystem hardening of the span store (issue 54, items 5 and 9), on real
files, real uids and real processes:

* replicas running as *different users* of one group share a store: each writes into the other's
  shard folders and reads the other's entries; every file and folder carries the store's group
  (not the creator's primary group) with 0660 / 2770; users outside the group -- the creator's
  primary group included -- read neither the secret nor an entry;
* a store root others could write into (or, in group mode, enter) is refused with the reason;
* folders and files are created through descriptors: a name swapped for a symlink between a
  check and its use is never followed (``make_dir``, the entry's temp file);
* ``format.payload_length`` and the span index manifest refuse a symlink or FIFO at their
  names without blocking;
* the manifest is bounded and holds no plain hash of a tenant's salt.

The uid tests need root (CI's tests run as root): forked children switch to unprivileged uids
2001.., sharing the supplementary group 3054, which is nobody's primary group.
"""

from __future__ import annotations

import errno
import os
import pickle
import random
import shutil
import signal
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.store_tiers import key_for

from minipic.engine_ext.span_store.tiers import DirTier, Entry
from minipic.engine_ext.span_store.tiers import files as files_mod
from minipic.engine_ext.span_store.tiers.files import SECRET_NAME, Modes, make_dir
from minipic.engine_ext.span_store.tiers.format import SUFFIX, payload_length
from minipic.orchestrator import span_index
from minipic.orchestrator.span_index import (
    MANIFEST_NAME,
    ManifestRecord,
    append_records,
    read_manifest,
    salt_digest,
    stored_warm_keys,
)

pytestmark = pytest.mark.fast

INDEX_KEY_NAME = getattr(span_index, "INDEX_KEY_NAME", ".index-key")

FP = "group|model=tiny|dtype=float32|bs=16"
GROUP = 3054  # the replicas' shared group: nobody's primary group
A, B = (2001, 2001), (2002, 2002)  # (uid, primary gid) of two replicas
SAME_PRIMARY_AS_A = (2003, 2001)  # shares A's primary group, not the store's
STRANGER = (2004, 2004)
GUARD_S = 20.0  # how long a call that must not block may take before the test calls it hung


def entry_for(rng: random.Random) -> Entry:
    return Entry(rng.randbytes(rng.randrange(1000, 6000)), {"home": rng.randrange(4096)})


def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to run children as other uids")


def as_user(who: tuple[int, int], groups: list[int], fn: Callable[[], Any]) -> Any:
    """``fn()`` in a forked child running as ``who`` (uid, gid) with supplementary ``groups``
    and umask 077 (the modes must be the tier's, not the umask's); its result or its error."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(read_end)
            signal.alarm(60)  # a hung child fails the test instead of hanging it
            os.setgroups(groups)
            os.setgid(who[1])
            os.setuid(who[0])
            os.umask(0o077)
            try:
                payload = pickle.dumps(("ok", fn()))
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                payload = pickle.dumps(("error", f"{type(exc).__name__}: {exc}"))
            with os.fdopen(write_end, "wb") as fh:
                fh.write(payload)
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as fh:
        data = fh.read()
    _, status = os.waitpid(pid, 0)
    assert status == 0 and data, f"child as {who} died (status {status})"
    outcome, value = pickle.loads(data)
    assert outcome == "ok", f"as {who}: {value}"
    return value


@pytest.fixture
def shared_home() -> Iterator[Path]:
    """A folder replica A owns, which every user may traverse but not list (0711 under a 0711
    folder of root's in /tmp): the store root is created inside it by A."""
    base = Path(tempfile.mkdtemp(prefix="minipic-group-", dir="/tmp"))
    base.chmod(0o711)
    home = base / "home"
    home.mkdir(mode=0o711)
    os.chown(home, *A)
    yield home
    shutil.rmtree(base, ignore_errors=True)


def tier_of(root: Path) -> DirTier:
    return DirTier(root, 64 << 20, FP, group_access=True, group=GROUP)


def test_replicas_running_as_different_users_share_a_group_store(shared_home, rng):
    needs_root()
    root = shared_home / "store"
    a_entries = {key_for(rng): entry_for(rng) for _ in range(6)}
    a_shards = {k[:2] for k in a_entries}
    fresh = [p for p in (f"{i:02x}" for i in range(256)) if p not in a_shards]
    b_entries = {key_for(rng, rng.choice(fresh)): entry_for(rng) for _ in range(3)}
    b_entries[key_for(rng, next(iter(a_shards)))] = entry_for(rng)  # into a shard of A's too

    def replica_a() -> tuple[bool, list[bool]]:
        tier = tier_of(root)
        return tier.usable, [tier.put(k, e) for k, e in a_entries.items()]

    def replica_b() -> tuple[bool, list[bool], list[bool]]:
        tier = tier_of(root)
        reads = [tier.get(k) == e for k, e in a_entries.items()]
        return tier.usable, reads, [tier.put(k, e) for k, e in b_entries.items()]

    def replica_a_again() -> list[bool]:
        tier = tier_of(root)
        return [tier.get(k) == e for k, e in {**a_entries, **b_entries}.items()]

    usable, puts = as_user(A, [GROUP], replica_a)
    assert usable and all(puts)
    usable, reads, puts = as_user(B, [GROUP], replica_b)
    assert usable, "B (another user of the group) refused the store A created"
    assert all(reads), "B could not read A's entries"
    assert all(puts), "B could not write into new or A's shard folders"
    assert all(as_user(A, [GROUP], replica_a_again)), "A could not read B's entries"

    # the group on everything, never a creator's primary group; modes whatever the umask
    for folder, dirs, names in os.walk(root):
        st = os.lstat(folder)
        assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (GROUP, 0o2770), folder
        assert not dirs or folder == str(root)
        for name in names:
            st = os.lstat(Path(folder) / name)
            assert not name.startswith(".tmp."), name
            assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (GROUP, 0o660), (folder, name)

    paths = [root / SECRET_NAME] + [root / k[:2] / f"{k}{SUFFIX}"
                                    for k in [*a_entries, *b_entries]]

    def outsider() -> list[str]:
        opened = []
        for path in paths:
            try:
                with open(path, "rb") as fh:
                    fh.read(1)
                opened.append(str(path))
            except PermissionError:
                pass
        try:
            os.listdir(root)
            opened.append(f"listed {root}")
        except PermissionError:
            pass
        return opened

    for who in (SAME_PRIMARY_AS_A, STRANGER):
        assert as_user(who, [who[1]], outsider) == [], f"{who} read the store"


@pytest.mark.parametrize(("group_access", "root_mode", "refused"), [
    (False, 0o777, "every local user could plant files"),
    (False, 0o1777, "every local user could plant files"),
    (False, 0o770, "members of group"),
    (False, 0o755, None),  # listable, but every file and folder in it is private
    (True, 0o2777, "every local user could plant files"),
    (True, 0o2775, "every local user could list"),
    (True, 0o2770, None),
])
def test_a_root_others_could_write_into_is_refused(tmp_path, rng, caplog, group_access,
                                                   root_mode, refused):
    root = tmp_path / "store"
    root.mkdir()
    os.chmod(root, root_mode)
    with caplog.at_level("WARNING", logger="vllm.minipic.span_store"):
        tier = DirTier(root, 64 << 20, FP, group_access=group_access, group=os.getegid())
    key, entry = key_for(rng), entry_for(rng)
    if refused is None:
        assert tier.usable and tier.put(key, entry) and tier.get(key) == entry
        return
    assert not tier.usable and not tier.put(key, entry)
    assert any(refused in r.getMessage() and f"mode {root_mode:o}" in r.getMessage()
               for r in caplog.records), caplog.text
    assert not (root / SECRET_NAME).exists()


def test_a_group_root_of_another_group_is_refused(tmp_path, caplog):
    needs_root()
    root = tmp_path / "store"
    root.mkdir(mode=0o750)
    os.chown(root, -1, 2001)  # ours, but another group could list it; the store's is GROUP
    with caplog.at_level("WARNING", logger="vllm.minipic.span_store"):
        assert not tier_of(root).usable
    assert "belongs to group 2001" in caplog.text, caplog.text


def _swap_for_link(path: Path, target: Path) -> None:
    os.rename(path, path.with_name(path.name + "-moved"))
    os.symlink(target, path)


def test_make_dir_never_follows_a_folder_swapped_for_a_symlink(tmp_path, monkeypatch):
    """Between ``mkdir`` and the mode change an attacker swaps the new folder for a link to a
    folder of someone else's: a path-based chmod would give that folder the tier's mode."""
    victim = tmp_path / "victim"
    victim.mkdir()
    os.chmod(victim, 0o755)
    real_mkdir = os.mkdir
    target = tmp_path / "made" / "store"

    def mkdir_then_swap(path: Any, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        real_mkdir(path, mode, dir_fd=dir_fd)
        full = Path(os.readlink(f"/proc/self/fd/{dir_fd}")) / path if dir_fd else Path(path)
        if full == target:
            _swap_for_link(full, victim)

    monkeypatch.setattr(os, "mkdir", mkdir_then_swap)
    with pytest.raises(OSError) as raised:
        make_dir(target, Modes.for_access(False))
    monkeypatch.undo()
    assert raised.value.errno == errno.ELOOP, raised.value
    assert stat.S_IMODE(os.stat(victim).st_mode) == 0o755, "the symlink's target was chmod-ed"
    assert stat.S_IMODE(os.stat(tmp_path / "made").st_mode) == 0o700


def test_an_entry_is_never_written_through_a_shard_swapped_for_a_symlink(tmp_path, rng,
                                                                          monkeypatch):
    """The shard is swapped for a link to an outside folder right before the temp file is
    created: the entry's bytes must not land outside the store."""
    tier = DirTier(tmp_path / "store", 64 << 20, FP)
    first = key_for(rng)
    assert tier.put(first, entry_for(rng))
    shard = tier.entry_path(first).parent
    outside = tmp_path / "outside"
    outside.mkdir()
    real_open = os.open
    swapped: list[bool] = []

    def open_after_swap(path: Any, flags: int, mode: int = 0o777, *,
                        dir_fd: int | None = None) -> int:
        if ".tmp." in os.fspath(path) and not swapped:
            swapped.append(True)
            _swap_for_link(shard, outside)
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", open_after_swap)
    tier.put(key_for(rng, first[:2]), entry_for(rng))
    monkeypatch.undo()
    assert swapped, "the put never created its temp file"
    assert os.listdir(outside) == [], "the entry was written through the symlink"


def _no_block(fn: Callable[[], Any], unblock: Callable[[], None]) -> Any:
    """``fn()`` on a thread; a call still running after ``GUARD_S`` fails the test (and
    ``unblock`` lets the thread finish) instead of hanging the suite."""
    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    worker.start()
    worker.join(GUARD_S)
    if worker.is_alive():
        unblock()
        worker.join(GUARD_S)
        pytest.fail(f"{fn} blocked on a FIFO")
    return result[0] if result else None


def _open_writer(fifo: Path) -> Callable[[], None]:
    def unblock() -> None:
        try:
            fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
        except OSError:
            return
        os.close(fd)
    return unblock


@pytest.mark.parametrize("planted", ["symlink", "fifo"])
def test_payload_length_refuses_symlinks_and_fifos(tmp_path, rng, planted):
    tier = DirTier(tmp_path / "store", 64 << 20, FP)
    key, entry = key_for(rng), entry_for(rng)
    assert tier.put(key, entry)
    real = tier.entry_path(key)
    assert payload_length(real) == len(entry.payload)
    name = real.with_name(f"{key_for(rng)}{SUFFIX}")
    if planted == "symlink":
        os.symlink(real, name)
        assert payload_length(name) is None, "followed a symlink"
    else:
        os.mkfifo(name)
        assert _no_block(lambda: payload_length(name), _open_writer(name)) is None


def _record(rng: random.Random, doc: str | None = None, salt: str | None = None
            ) -> ManifestRecord:
    return ManifestRecord(doc=doc or rng.randbytes(16).hex(), fingerprint="fp-a",
                          mode="block_attention", salt=salt_digest(salt),
                          prefill_keys=(rng.randbytes(32).hex(),), tokens=64, blocks=2)


def test_the_manifest_is_never_read_or_appended_through_a_symlink(tmp_path, rng):
    elsewhere = tmp_path / "elsewhere"
    append_records(elsewhere, [_record(rng), _record(rng)])
    store = tmp_path / "store"
    store.mkdir()
    os.symlink(elsewhere / MANIFEST_NAME, store / MANIFEST_NAME)
    assert list(read_manifest(store)) == [], "read a manifest through a symlink"
    before = (elsewhere / MANIFEST_NAME).read_bytes()
    with pytest.raises(OSError):
        append_records(store, [_record(rng)])
    assert (elsewhere / MANIFEST_NAME).read_bytes() == before, "appended through a symlink"


@pytest.mark.parametrize("use", ["read", "append"])
def test_a_fifo_at_the_manifest_is_refused_without_blocking(tmp_path, rng, use):
    manifest = tmp_path / MANIFEST_NAME
    os.mkfifo(manifest)

    def call() -> str:
        try:
            if use == "read":
                return f"read {len(list(read_manifest(tmp_path)))}"
            append_records(tmp_path, [_record(rng)])
        except OSError as exc:
            return f"refused: {exc}"
        return "appended"

    outcome = _no_block(call, _open_writer(manifest))
    assert outcome == ("read 0" if use == "read" else outcome) and outcome != "appended"
    assert stat.S_ISFIFO(os.lstat(manifest).st_mode)


def test_the_manifest_is_bounded_and_keeps_the_newest_records(tmp_path, rng, monkeypatch):
    monkeypatch.setattr(span_index, "MAX_MANIFEST_BYTES", 24_000, raising=False)
    docs = [rng.randbytes(16).hex() for _ in range(40)]
    written: list[ManifestRecord] = []
    for _ in range(60):  # batches; documents come back (a --force re-index)
        batch = [_record(rng, rng.choice(docs), rng.choice([None, "acme", "globex"]))
                 for _ in range(rng.randrange(1, 8))]
        append_records(tmp_path, batch)
        written.extend(batch)
    size = (tmp_path / MANIFEST_NAME).stat().st_size
    assert size <= 24_000, f"the manifest grew to {size} bytes"
    kept = list(read_manifest(tmp_path))
    assert kept and kept[-1] == written[-1].model_copy(update={"v": kept[-1].v})
    newest: dict[tuple, ManifestRecord] = {}
    for record in written:
        newest[record.resume_key()] = record
    last_kept = {r.resume_key(): r for r in kept}
    for key, record in last_kept.items():  # a document's last record is its newest
        assert newest[key].prefill_keys == record.prefill_keys
    assert len(kept) < len(written) and len(last_kept) < len(newest), "nothing was dropped"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".index")] == [
        INDEX_KEY_NAME], "a rewrite left its temp file"


def test_the_manifest_holds_no_plain_hash_of_a_salt(tmp_path, rng):
    salt = f"tenant-{rng.randrange(10**6)}"
    salted, plain = _record(rng, salt=salt), _record(rng)
    append_records(tmp_path, [salted, plain])
    text = (tmp_path / MANIFEST_NAME).read_text()
    assert salt not in text and salt_digest(salt) not in text, "a salt's plain hash is stored"
    assert stored_warm_keys([tmp_path], "fp-a") == {
        (salt_digest(salt), salted.prefill_keys[0]), (None, plain.prefill_keys[0])}
    # without the store's index key the salted record says nothing: not learned
    (tmp_path / INDEX_KEY_NAME).unlink()
    assert stored_warm_keys([tmp_path], "fp-a") == {(None, plain.prefill_keys[0])}


def test_files_module_exports_apply_owner() -> None:
    """The secret's creator gives it the tier's mode and group through this one helper."""
    assert callable(getattr(files_mod, "apply_owner", None))
