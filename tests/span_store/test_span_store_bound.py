"""The directory tier's bounds, on real files and real processes (issue 54, items 6-8).

* The size bound holds for the *folder*, whatever the number of tier instances writing into it
  (TP ranks, replicas: threads and child processes here), with no allowance for writes in
  flight: every write reserves its bytes in the folder's ledger before its temp file exists
  (``tiers/folder_usage.py``). A killed writer's reservation is dropped by the next correction.
* A free-space floor pauses writes (reads continue) before the disk fills.
* ``has`` makes no filesystem call (``tiers/dir_index.py``); an entry another instance wrote is
  known after a rescan or a listing.
* A read refuses, before reading a byte, a file larger than this engine's entries: a planted
  sparse file with a well-formed header is never read whole.
"""

from __future__ import annotations

import fcntl
import os
import random
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.store_tiers import key_for

from minipic.engine_ext.span_store.tiers import HEADER, DirTier, Entry, TieredStore
from minipic.engine_ext.span_store.tiers.backoff import WriteBackoff
from minipic.engine_ext.span_store.tiers.format import SUFFIX, hashed_header
from minipic.engine_ext.span_store.tiers.probe import MetadataProbe

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parents[2]
FP = "model=tiny-llama|dtype=float32|bs=16|span=v3|layout=2"
LEDGER = ".store-usage"


def entry_for(rng: random.Random, size: int) -> Entry:
    return Entry(rng.randbytes(size), {"tokens": rng.randrange(10**5, 10**6)})


def file_size(entry: Entry) -> int:
    return HEADER.size + len(FP.encode()) + len(entry.meta_json) + len(entry.payload)


def folder_bytes(root: Path) -> int:
    """Bytes of every file in the shard folders (entries and temp files), each inode once (a
    temp file and the entry it was linked to are one file)."""
    seen: dict[tuple[int, int], int] = {}
    for shard in os.scandir(root):
        if shard.name.startswith(".") or not shard.is_dir(follow_symlinks=False):
            continue
        for item in os.scandir(shard.path):
            try:
                st = item.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def locked_folder_bytes(root: Path) -> int:
    """``folder_bytes`` while holding the folder ledger's lock: no write can reserve and no
    eviction run meanwhile, so files only shrink or grow within what was reserved, and the sum
    is at most what the ledger allowed (without a ledger -- before issue 54 -- it is a plain
    sample)."""
    fd = os.open(root / LEDGER, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return folder_bytes(root)
    finally:
        os.close(fd)


def py_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}


# -- item 6: the bound holds per folder -----------------------------------------------------

WRITER = r"""
import random, sys
from minipic.engine_ext.span_store.tiers import DirTier, Entry
root, cap, seed, count, lo, hi, fp = sys.argv[1:8]
rng = random.Random(int(seed))
tier = DirTier(root, int(cap), fp, fsync=False)
ok = 0
for i in range(int(count)):
    entry = Entry(rng.randbytes(rng.randrange(int(lo), int(hi))), {"tokens": 123456})
    ok += tier.put(rng.randbytes(32).hex(), entry)
    if i % 3 == 0:
        tier.get(rng.randbytes(32).hex())
print(ok)
"""


def test_the_bound_holds_for_the_folder_whatever_the_number_of_writers(tmp_path, rng):
    """Three tier instances in threads and two in child processes, each with capacity C, write
    random entries into one folder: the folder's bytes on disk (entries and temp files) never
    exceed C. The allowance for writes in flight is 0: a write's bytes are reserved before its
    temp file exists. One instance rescans (and corrects the ledger) before every write, so
    corrections race the writes too."""
    lo, hi = 20_000, 60_000
    cap = 10 * hi
    count = 60
    root = tmp_path / "store"
    DirTier(root, cap, FP, fsync=False)  # the folder, its secret and ledger exist before anyone
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(cap),
                               str(rng.randrange(2**31)), str(count), str(lo), str(hi), FP],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=py_env(), cwd=REPO) for _ in range(2)]
    tiers = [DirTier(root, cap, FP, fsync=False, rescan_interval_s=0.0 if i == 0 else 300.0)
             for i in range(3)]
    written = [0] * len(tiers)

    def write(i: int, seed: int) -> None:
        local = random.Random(seed)
        for _ in range(count):
            written[i] += tiers[i].put(key_for(local), entry_for(local, local.randrange(lo, hi)))

    threads = [threading.Thread(target=write, args=(i, rng.randrange(2**31)))
               for i in range(len(tiers))]
    for t in threads:
        t.start()
    samples = []
    while any(t.is_alive() for t in threads) or any(p.poll() is None for p in procs):
        samples.append(locked_folder_bytes(root))
    for t in threads:
        t.join()
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    samples.append(folder_bytes(root))
    print(f"{len(samples)} samples, max {max(samples)} B of a {cap} B bound, "
          f"writes {written} + {[o[0].strip() for o in outs]}")
    assert max(samples) <= cap, (max(samples) / cap, samples[-10:])
    total = sum(written) + sum(int(o[0]) for o in outs)
    assert total >= 5 * count * 3 // 4, total  # the writers did write (no vacuous bound)
    # the ledger never under-counts: what it says the folder holds is at least what is there
    tiers[1].rescan()
    assert tiers[1].stats()["folder_bytes"] >= folder_bytes(root)


def test_a_killed_writers_bytes_are_counted_until_a_correction_then_freed(tmp_path, seed):
    """SIGKILL a writer process mid-stream: its reservation and temp file outlive it, counted
    (never an under-count); the next correction drops them and the ledger equals the folder."""
    rng = random.Random(seed)
    root = tmp_path / "store"
    cap = 1 << 30
    DirTier(root, cap, FP)
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(cap), str(seed),
                             "100000", "1000000", "4000000", FP], env=py_env(), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    shard_files = 0
    while shard_files < 3 and proc.poll() is None:  # a few entries in, probably mid-write
        shard_files = sum(1 for p in root.glob("*/*") if p.is_file())
        time.sleep(0.001)
    time.sleep(rng.random() * 0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    tier = DirTier(root, cap, FP, rescan_interval_s=0.0)  # a correction is due at once
    assert tier.stats()["folder_bytes"] == folder_bytes(root)
    assert not list(root.glob("*/.tmp.*"))  # the dead writer's temp file went with the scan
    k, e = key_for(rng), entry_for(rng, 10_000)
    assert tier.put(k, e) and tier.stats()["folder_bytes"] == folder_bytes(root)


def test_a_free_space_floor_pauses_writes_and_reads_continue(tmp_path, rng):
    """A floor above the disk's real free space: writes pause like any write fault (the next
    write after the pause is a probe), reads go on; lowered, the probe writes again."""
    root = tmp_path / "store"
    writer = DirTier(root, 64 << 20, FP)
    k0, e0 = key_for(rng), entry_for(rng, 50_000)
    assert writer.put(k0, e0)
    free = os.statvfs(root).f_bavail * os.statvfs(root).f_frsize
    now = [1000.0]
    tier = DirTier(root, 64 << 20, FP, min_free_bytes=free + (1 << 40),
                   backoff=WriteBackoff(clock=lambda: now[0]))
    k1, e1 = key_for(rng), entry_for(rng, 50_000)
    assert not tier.put(k1, e1) and not tier.writes_enabled
    st = tier.stats()
    assert st["write_pauses"] == 1 and st["writes_paused"] and st["writes"] == 0
    assert not tier.entry_path(k1).exists() and not list(root.glob("*/.tmp.*"))
    assert tier.get(k0) == e0  # reads continue
    store = TieredStore(None, [tier])
    store.put(k1, e1)  # the store skips a paused tier, never blocks
    store.flush(5)
    assert store.stats()["skipped_writes_off"] == 1
    now[0] += 1.5
    assert tier.writes_enabled and not tier.put(k1, e1)  # the probe finds the floor still short
    assert tier.stats()["write_pauses"] == 2
    tier.min_free_bytes = 0
    now[0] += 2.5
    assert tier.put(k1, e1) and tier.get(k1) == e1 and tier.stats()["writes_resumed"] == 1
    store.close()


# -- item 7: has() off the filesystem ---------------------------------------------------------

METADATA_CALLS = ("lstat", "stat", "scandir", "listdir", "open", "access", "statvfs")


def test_has_makes_no_filesystem_call(tmp_path, rng, monkeypatch):
    """512 lookups (a cold 8k-token prompt's span blocks): zero metadata calls on the caller's
    thread, and the right answers for entries written, not written and deleted."""
    tier = DirTier(tmp_path / "store", 64 << 20, FP)
    present = [key_for(rng) for _ in range(64)]
    for k in present:
        assert tier.put(k, entry_for(rng, rng.randrange(100, 2000)))
    gone = present.pop()
    tier.delete(gone)
    absent = [key_for(rng) for _ in range(512 - len(present) - 1)]
    me = threading.get_ident()
    calls: dict[str, int] = dict.fromkeys(METADATA_CALLS, 0)
    for name in METADATA_CALLS:
        real = getattr(os, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            if threading.get_ident() == me:
                calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(os, name, counted)
    answers = [tier.has(k) for k in [*present, gone, *absent]]
    monkeypatch.undo()
    assert calls == dict.fromkeys(METADATA_CALLS, 0), calls
    assert answers == [True] * len(present) + [False] * (1 + len(absent))


def test_has_learns_of_another_instances_writes_by_rescan_or_listing(tmp_path, rng):
    """With probing off (the index alone), an entry another instance (a replica, another rank)
    wrote is a miss for ``has`` until a rescan or a listing; one it removed is a "present" until
    then (``get`` misses). The background listing the first ``has`` starts does the same on its
    own."""
    root = tmp_path / "store"
    a = DirTier(root, 64 << 20, FP, probe=MetadataProbe(budget_s=0))
    b = DirTier(root, 64 << 20, FP)
    k1, k2, k3 = (key_for(rng) for _ in range(3))
    assert b.put(k1, entry_for(rng, 1000)) and b.put(k2, entry_for(rng, 1000))
    assert not a.has(k1)  # written since a's last scan: not known yet (documented)
    a.rescan()
    assert a.has(k1) and a.has(k2)
    b.delete(k2)
    assert b.put(k3, entry_for(rng, 1000))
    assert a.has(k2) and not a.has(k3)
    a._idx.refresh()  # a listing: names only
    assert not a.has(k2) and a.has(k3)
    # the background listing, started by the first has() of a tier
    c = DirTier(root, 64 << 20, FP, refresh_s=0.02, probe=MetadataProbe(budget_s=0))
    k4 = key_for(rng)
    assert not c.has(k4)
    assert b.put(k4, entry_for(rng, 1000))
    deadline = time.monotonic() + 30
    while not c.has(k4) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert c.has(k4)



def test_an_index_miss_is_probed_off_the_callers_thread_within_a_deadline(tmp_path, rng,
                                                                          monkeypatch):
    """An entry another replica wrote a moment ago is found at once (one ``lstat`` on the probe
    thread), none on the caller's thread; a probe that hangs (a dead mount) costs the caller
    the deadline once, then lookups answer from the index until it returns; a spent budget
    stops probing for the rest of its window."""
    root = tmp_path / "store"
    a = DirTier(root, 64 << 20, FP, probe=MetadataProbe(deadline_s=0.5, budget_s=60))
    b = DirTier(root, 64 << 20, FP)
    fresh = key_for(rng)
    assert b.put(fresh, entry_for(rng, 1000))
    me = threading.get_ident()
    mine = []
    real_lstat = os.lstat
    release = threading.Event()

    asking = threading.Event()  # set while the caller is inside has()

    def lstat(path, *args, **kwargs):
        if threading.get_ident() == me:
            if asking.is_set():
                mine.append(path)
        elif str(path).endswith(f"{hung}{SUFFIX}"):  # the probe thread, on the dead mount
            release.wait(30)
        return real_lstat(path, *args, **kwargs)

    def has(tier: DirTier, key: str) -> bool:
        asking.set()
        try:
            return tier.has(key)
        finally:
            asking.clear()

    hung = key_for(rng)
    monkeypatch.setattr(os, "lstat", lstat)
    assert has(a, fresh) and a.get(fresh) is not None and not mine
    assert b.put(hung, entry_for(rng, 1000))
    assert not has(a, hung)  # past the deadline: unknown, a miss
    assert a.stats()["probe_timeouts"] == 1
    other = key_for(rng)
    assert b.put(other, entry_for(rng, 1000))
    skipped = a.stats()["probes_skipped"]
    assert not has(a, other)  # the hung probe is still out: the index alone answers
    assert a.stats()["probes_skipped"] == skipped + 1
    release.set()
    deadline = time.monotonic() + 30
    while not has(a, other):  # the hung probe returned: probing resumes
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not mine
    clock = [0.0]
    spent = DirTier(root, 64 << 20, FP, probe=MetadataProbe(budget_s=1.0, clock=lambda: clock[0]))
    late = key_for(rng)
    assert b.put(late, entry_for(rng, 1000))
    clock[0] = 0.5
    spent._probe._spent = 1.0  # the window's budget is gone
    assert not spent.has(late)
    clock[0] = 1.5  # a new window
    assert spent.has(late)

# -- item 8: a read is bounded by the entry size --------------------------------------------

def _plant_sparse(tier: DirTier, key: str, size: int, kid: bytes) -> Path:
    """A sparse file at ``key``'s name with a well-formed header naming our key id (public: any
    entry header carries it) whose lengths add up to ``size``: without an entry-size bound it
    is read whole before its MAC fails."""
    fp, meta = FP.encode(), b"{}"
    payload = size - HEADER.size - len(fp) - len(meta)
    path = tier.entry_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as fh:
        fh.write(hashed_header(fp, meta, payload, kid) + bytes(32) + fp + meta)
        fh.truncate(size)
    return path


def _bytes_read(monkeypatch, fn):
    got = [0]
    real = os.read

    def counted(fd, n):
        data = real(fd, n)
        got[0] += len(data)
        return data

    monkeypatch.setattr(os, "read", counted)
    try:
        return fn(), got[0]
    finally:
        monkeypatch.setattr(os, "read", real)


@pytest.mark.parametrize("bound", ["engine", "default"])
def test_a_sparse_file_larger_than_an_entry_is_refused_unread(tmp_path, rng, monkeypatch,
                                                              bound):
    """Capacity 1 GiB; the planted file is larger than an entry (the engine's, told by
    ``bound_entries``, or the default bound when none was told) and smaller than the capacity:
    a miss, 0 bytes read, removed. A real entry of the engine's size still loads."""
    tier = DirTier(tmp_path / "store", 1 << 30, FP)
    payload = 100_000
    if bound == "engine":
        tier.bound_entries(payload)
        planted = 8 << 20
    else:
        planted = 80 << 20
    k0, e0 = key_for(rng), entry_for(rng, payload)
    assert tier.put(k0, e0)
    kid = tier.entry_path(k0).read_bytes()[24:32]
    key = key_for(rng)
    path = _plant_sparse(tier, key, planted, kid)
    assert os.stat(path).st_size == planted < tier.capacity_bytes
    got, read = _bytes_read(monkeypatch, lambda: tier.get(key))
    assert got is None and read == 0, read
    assert not path.exists() and tier.stats()["corrupt_removed"] == 1
    got, read = _bytes_read(monkeypatch, lambda: tier.get(k0))
    assert got == e0 and read == file_size(e0)
    assert not tier.put(key_for(rng), entry_for(rng, tier.max_entry_bytes))  # none written
    assert tier.stats()["too_large"] == 1


def test_the_worker_tells_its_tiers_the_entry_size(tmp_path):
    """``PageCopier.register`` (the worker, which knows its pages) bounds every tier's entries
    to one block of every layer plus the header."""
    torch = pytest.importorskip("torch")
    from minipic.engine_ext.span_store.worker_side import PageCopier

    tier = DirTier(tmp_path / "store", 1 << 30, FP)
    copier = PageCopier(TieredStore(None, [tier]), Entry)
    caches = {f"model.layers.{i}.attn": torch.zeros(4, 2, 16, 8) for i in range(3)}
    copier.register(caches)
    payload = 3 * 2 * 16 * 8 * 4
    assert payload < tier.max_entry_bytes <= HEADER.size + len(FP) + 4096 + payload
    copier.store.close()
