"""Storage tiers of the span store (``engine_ext/span_store/tiers/``), on real files.

Every test writes real files under ``tmp_path`` with fresh random payloads (seed printed;
``MINIPIC_TEST_SEED`` replays one). Faults are real where the machine allows: a SIGKILLed
writer process, two writer processes racing on the same keys, a store directory deleted or
replaced under a running tier, and a full / read-only disk on a small tmpfs mounted in a user
namespace (``unshare -rm``). Only the per-errno write-fault matrix monkeypatches ``os.open`` /
``os.fsync`` (for the store's own paths only), because EDQUOT and friends cannot be produced
otherwise; its docstring says so.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import hmac
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.store_tiers import key_for

from minipic.engine_ext.span_store import tiers
from minipic.engine_ext.span_store.tiers import (
    HEADER,
    MAGIC,
    SUFFIX,
    TEMP_PREFIX,
    DirTier,
    Entry,
    RamTier,
    TieredStore,
    directory,
)
from minipic.engine_ext.span_store.tiers.backoff import WriteBackoff

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parents[2]
FP = "model=tiny-llama|dtype=float32|bs=16|span=v3|layout=2"


# -- helpers ------------------------------------------------------------------------------------

def entry_for(rng: random.Random, size: int | None = None) -> Entry:
    size = rng.randrange(1, 300_000) if size is None else size
    # fixed-width metadata: every entry of one payload size has the same file size
    return Entry(rng.randbytes(size), {"tokens": rng.randrange(10**5, 10**6), "src": "test"})


def file_size(entry: Entry, fp: str = FP) -> int:
    return HEADER.size + len(fp.encode()) + len(entry.meta_json) + len(entry.payload)


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob(f"{TEMP_PREFIX}*")]


def py_env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


class Clock:
    """A clock the test advances: write back-off (``tiers/backoff.py``) made deterministic."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class GatedTier(DirTier):
    """A real DirTier whose writes wait for ``gate`` (a slow disk, made deterministic)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def put(self, key: str, entry: Entry) -> bool:
        self.entered.set()
        assert self.gate.wait(20), "test never opened the gate"
        return super().put(key, entry)


# -- Entry and RamTier --------------------------------------------------------------------------

def test_entry_normalises_meta_and_freezes_payload(rng):
    buf = bytearray(rng.randbytes(64))
    entry = Entry(buf, {"b": (1, 2), "a": None})
    buf[0] ^= 0xFF
    assert entry.payload != bytes(buf) and isinstance(entry.payload, bytes)
    assert entry.meta == {"a": None, "b": [1, 2]}  # exactly what a disk round trip gives
    assert entry.nbytes == 64 + len(b'{"a":null,"b":[1,2]}')
    with pytest.raises(TypeError):
        Entry(b"x", {"bad": object()})
    with pytest.raises(TypeError):
        Entry("text", {})  # type: ignore[arg-type]


def test_ram_lru_order_capacity_and_stats(rng):
    entries = {key_for(rng): entry_for(rng, 1000) for _ in range(4)}
    keys = list(entries)
    size = entries[keys[0]].nbytes
    assert all(e.nbytes == size for e in entries.values())
    ram = RamTier(3 * size)
    for k in keys[:3]:
        ram.put(k, entries[k])
    assert ram.get(keys[0]) is entries[keys[0]]  # keys[0] is now most recent
    assert keys[1] in ram and ram.keys() == [keys[1], keys[2], keys[0]]  # `in` keeps order
    ram.put(keys[3], entries[keys[3]])
    assert keys[1] not in ram and ram.keys() == [keys[2], keys[0], keys[3]]
    assert ram.get(keys[1]) is None
    st = ram.stats()
    assert st == {"entries": 3, "bytes": 3 * size, "capacity_bytes": 3 * size, "hits": 1,
                  "misses": 1, "evictions": 1, "too_large": 0}


def test_ram_too_large_replace_and_zero_capacity(rng):
    k = key_for(rng)
    small, big = entry_for(rng, 100), entry_for(rng, 5000)
    ram = RamTier(1000)
    ram.put(k, small)
    ram.put(k, big)  # larger than the whole tier: not stored, and the old value is dropped
    assert k not in ram and ram.stats()["bytes"] == 0 and ram.stats()["too_large"] == 1
    ram.put(k, small)
    ram.put(k, entry_for(rng, 200))
    assert len(ram) == 1 and ram.stats()["bytes"] == ram.get(k).nbytes
    off = RamTier(0)
    off.put(k, small)
    assert off.get(k) is None and len(off) == 0
    with pytest.raises(ValueError):
        RamTier(-1)


def test_ram_is_thread_safe(rng):
    pool = [(key_for(rng), entry_for(rng, rng.randrange(10, 2000))) for _ in range(200)]
    ram = RamTier(40_000)
    errors: list[BaseException] = []

    def work(worker: int) -> None:
        local = random.Random(worker)
        try:
            for _ in range(3000):
                k, e = local.choice(pool)
                if local.random() < 0.5:
                    ram.put(k, e)
                else:
                    got = ram.get(k)
                    assert got is None or got is e
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    st = ram.stats()
    assert st["bytes"] <= 40_000
    assert st["bytes"] == sum(ram.get(k).nbytes for k in ram.keys())


# -- DirTier: format and basics -----------------------------------------------------------------

def test_dir_round_trip_format_and_sharding(tmp_path, rng):
    tier = DirTier(tmp_path / "store", 64 << 20, FP)
    items = {key_for(rng): entry_for(rng) for _ in range(12)}
    for k, e in items.items():
        assert not tier.has(k) and tier.get(k) is None
        assert tier.put(k, e)
    for k, e in items.items():
        assert tier.has(k)
        got = tier.get(k)
        assert got == e and got.meta == e.meta
        path = tmp_path / "store" / k[:2] / f"{k}{SUFFIX}"
        assert tier.entry_path(k) == path and path.is_file()
        raw = path.read_bytes()
        magic, version, fp_len, meta_len, payload_len, kid, digest = HEADER.unpack(
            raw[:HEADER.size])
        assert (magic, version) == (MAGIC, tiers.FORMAT_VERSION)
        assert raw[HEADER.size:HEADER.size + fp_len] == FP.encode()
        meta = raw[HEADER.size + fp_len:HEADER.size + fp_len + meta_len]
        assert json.loads(meta) == e.meta and raw[-payload_len:] == e.payload
        key_b = k.encode()
        secret = (tmp_path / "store" / ".store-key").read_bytes()
        expect = hmac.new(secret, raw[:32] + struct.pack("<H", len(key_b)) + key_b
                          + raw[HEADER.size:], hashlib.sha256).digest()
        # HMAC over header fields (the key id among them), key, fingerprint, meta, payload
        # under the store's secret; the key id names the secret without revealing it
        assert digest == expect
        assert kid == hashlib.sha256(b"minipic-store-key-id\0" + secret).digest()[:8]
    assert sorted(tier.keys()) == sorted(items)
    assert not temp_files(tmp_path)
    gone = next(iter(items))
    tier.delete(gone)
    assert not tier.has(gone) and tier.get(gone) is None
    tier.delete(gone)  # deleting a missing key is fine
    st = tier.stats()
    assert st["entries"] == 11 and st["writes"] == 12 and st["hits"] == 12
    assert st["bytes"] == sum(file_size(e) for k, e in items.items() if k != gone)
    for bad in ("", "A" * 64, "../etc", ".tmp.x", "k" * 201, "ab/cd"):
        with pytest.raises(ValueError):
            tier.get(bad)
        with pytest.raises(ValueError):
            tier.put(bad, items[next(iter(items))])


def test_dir_existing_entry_is_never_overwritten(tmp_path, rng):
    tier = DirTier(tmp_path, 64 << 20, FP)
    k, first, second = key_for(rng), entry_for(rng), entry_for(rng)
    assert tier.put(k, first)
    before = os.stat(tier.entry_path(k))
    assert tier.put(k, second)  # already there: a no-op that reports "on disk"
    after = os.stat(tier.entry_path(k))
    assert (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)
    assert tier.get(k) == first
    assert tier.stats()["writes"] == 1 and tier.stats()["already_present"] == 1


# -- DirTier: verification ----------------------------------------------------------------------

def _damage(kind: str, path: Path, rng: random.Random, tier: DirTier, other_key: str) -> None:
    raw = bytearray(path.read_bytes())
    fp_len = HEADER.unpack(bytes(raw[:HEADER.size]))[2]
    if kind == "magic":
        raw[0:8] = b"NOTSPANS"
    elif kind == "empty":
        raw = bytearray()
    elif kind == "old_version":
        raw[8:10] = struct.pack("<H", 0)
    elif kind == "truncated":
        raw = raw[:rng.randrange(HEADER.size, len(raw))]
    elif kind == "short_header":
        raw = raw[:rng.randrange(8, HEADER.size)]
    elif kind == "extended":
        raw += rng.randbytes(rng.randrange(1, 100))
    elif kind == "payload_bit":
        pos = rng.randrange(len(raw) - 1000, len(raw))
        raw[pos] ^= 1 << rng.randrange(8)
    elif kind == "meta_bit":
        raw[HEADER.size + fp_len] ^= 0x01
    elif kind == "length_field":  # payload shorter by one, meta longer by one: same file size
        _, v, fl, ml, pl, kid, d = HEADER.unpack(bytes(raw[:HEADER.size]))
        raw[:HEADER.size] = HEADER.pack(MAGIC, v, fl, ml + 1, pl - 1, kid, d)
    elif kind == "renamed":  # a complete, valid file of another key under this name
        raw = bytearray(tier.entry_path(other_key).read_bytes())
    path.write_bytes(bytes(raw))


DAMAGE = {  # kind -> the reason it must be reported as
    "magic": "format", "empty": "format", "old_version": "version", "truncated": "length",
    "short_header": "length", "extended": "length", "payload_bit": "checksum",
    "meta_bit": "checksum", "length_field": "checksum", "renamed": "checksum",
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_dir_damaged_entry_is_a_logged_removed_miss(tmp_path, rng, logs, kind):
    tier = DirTier(tmp_path, 64 << 20, FP)
    items = {key_for(rng): entry_for(rng, rng.randrange(2000, 200_000)) for _ in range(4)}
    for k, e in items.items():
        tier.put(k, e)
    keys = list(items)
    for victim in keys[:2]:  # two damaged entries of the same kind: logged once
        _damage(kind, tier.entry_path(victim), rng, tier, other_key=keys[3])
        assert tier.has(victim)  # has() is a stat: it cannot know
        assert tier.get(victim) is None
        assert not tier.entry_path(victim).exists()
        assert tier.get(victim) is None and not tier.has(victim)
    expected = tiers.REMOVED_REASONS[DAMAGE[kind]]
    assert len(logs.warnings(expected)) == 1, logs.warnings()
    assert "removed" in logs.warnings(expected)[0]
    assert tier.get(keys[2]) == items[keys[2]] and tier.get(keys[3]) == items[keys[3]]
    st = tier.stats()
    assert st["corrupt_removed"] == 2 and st["entries"] == 2
    assert st["bytes"] == file_size(items[keys[2]]) + file_size(items[keys[3]])
    assert tier.put(keys[0], items[keys[0]]) and tier.get(keys[0]) == items[keys[0]]


def test_dir_foreign_config_and_newer_format_are_kept_misses(tmp_path, rng, logs):
    """Another model's entries in a shared directory are never read and never deleted; the
    startup scan says so once; a newer format version is treated the same way."""
    other = DirTier(tmp_path, 64 << 20, "model=other|dtype=bfloat16")
    theirs = {key_for(rng): entry_for(rng) for _ in range(5)}
    for k, e in theirs.items():
        assert other.put(k, e)
    ours = DirTier(tmp_path, 64 << 20, FP)
    startup = logs.warnings("another model or config")
    assert len(startup) == 1 and "5 of 5 sampled" in startup[0], logs.warnings()
    for k in theirs:
        assert ours.get(k) is None and ours.entry_path(k).exists()
        assert other.get(k) == theirs[k]  # still intact for its owner
    assert len(logs.warnings("another model or config")) == 1  # not repeated per get
    assert ours.stats()["foreign_skipped"] == 5 and ours.stats()["corrupt_removed"] == 0
    # a newer format version (a newer minipic sharing the directory): kept, logged once
    newer = key_for(rng)
    ours.put(newer, entry_for(rng))
    path = ours.entry_path(newer)
    raw = bytearray(path.read_bytes())
    raw[8:10] = struct.pack("<H", tiers.FORMAT_VERSION + 1)
    path.write_bytes(bytes(raw))
    assert ours.get(newer) is None and ours.get(newer) is None and path.exists()
    assert len(logs.warnings(tiers.KEPT_REASONS["newer"])) == 1


# -- DirTier: capacity and LRU ------------------------------------------------------------------

def test_dir_capacity_evicts_least_recently_used_and_survives_restart(tmp_path, rng):
    items = {key_for(rng): entry_for(rng, 50_000) for _ in range(5)}
    a, b, c, d, e = items
    size = file_size(items[a])
    cap = 3 * size + size // 2
    tier = DirTier(tmp_path, cap, FP)
    for k in (a, b, c):
        assert tier.put(k, items[k])
    assert tier.get(a) == items[a]  # a is now more recent than b and c
    assert tier.put(d, items[d])
    assert set(tier.keys()) == {a, c, d}  # b was least recently used
    st = tier.stats()
    assert st["bytes"] == 3 * size <= cap and st["evictions"] == 1
    # a new process over the same directory: byte count and recency come from the scan
    again = DirTier(tmp_path, cap, FP)
    assert again.stats()["bytes"] == 3 * size and again.stats()["entries"] == 3
    assert again.put(e, items[e])
    assert set(again.keys()) == {a, d, e}  # c was oldest (a was touched after c was written)
    too_big = entry_for(rng, cap + 1)
    assert not again.put(key_for(rng), too_big) and again.stats()["too_large"] == 1


def test_dir_shared_recency_gives_second_chance_and_rescan_counts_others(tmp_path, rng):
    """Two processes on one directory (two replicas): a hit in one protects the entry from
    eviction by the other; the bound holds for the folder (``folder_usage``); each evicts among
    what it knows of, and a rescan makes it know the other's writes."""
    items = {key_for(rng): entry_for(rng, 40_000) for _ in range(5)}
    x, y, z, w, v = items
    size = file_size(items[x])
    a = DirTier(tmp_path, 2 * size, FP)
    b = DirTier(tmp_path, 2 * size, FP)
    assert a.put(x, items[x]) and a.put(y, items[y])
    assert b.get(x) == items[x]  # replica b reads x: x is recent for everyone now
    assert a.put(z, items[z])
    assert set(a.keys()) == {x, z} and a.stats()["evictions"] == 1  # x spared, y evicted
    assert b.put(w, items[w])  # the folder is full: b evicts what it knows, x (not z, unseen)
    assert set(b.keys()) == {z, w} and b.stats()["folder_bytes"] == 2 * size
    b.rescan()
    assert b.stats()["bytes"] == 2 * size and b.stats()["entries"] == 2
    assert b.put(v, items[v])  # now b evicts the two oldest by shared recency: x, then z
    assert set(b.keys()) == {w, v} and b.stats()["bytes"] == 2 * size
    assert a.get(w) == items[w] and a.get(x) is None and a.get(z) is None


# -- DirTier: crash debris and vanished directories ---------------------------------------------

def test_dir_startup_removes_only_stray_temp_files(tmp_path, rng):
    key = key_for(rng)
    shard = tmp_path / key[:2]
    shard.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    host = directory._HOST_ID
    names = {
        "dead_here": f"{TEMP_PREFIX}{host}.{dead_pid}.00000001.{key}",
        "live_here": f"{TEMP_PREFIX}{host}.{os.getpid()}.00000002.{key}",
        "young_elsewhere": f"{TEMP_PREFIX}0badc0de.12345.00000003.{key}",
        "old_elsewhere": f"{TEMP_PREFIX}0badc0de.12346.00000004.{key}",
        "old_locked": f"{TEMP_PREFIX}{host}.{dead_pid}.00000005.{key}",
    }
    for name in names.values():
        (shard / name).write_bytes(MAGIC + rng.randbytes(rng.randrange(10, 5000)))
    old = time.time() - 3600
    for label in ("old_elsewhere", "old_locked"):
        os.utime(shard / names[label], (old, old))
    with open(shard / names["old_locked"], "r+b") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a live writer (this process) holds it
        tier = DirTier(tmp_path, 64 << 20, FP)
        left = {p.name for p in temp_files(tmp_path)}
    assert left == {names["live_here"], names["young_elsewhere"], names["old_locked"]}
    assert tier.stats()["temps_removed"] == 2
    assert list(tier.keys()) == [] and tier.get(key) is None and not tier.has(key)
    assert tier.put(key, entry_for(rng)) and list(tier.keys()) == [key]


def test_dir_deleted_under_a_running_tier_gives_misses(tmp_path, rng, logs):
    root = tmp_path / "store"
    clock = Clock()
    tier = DirTier(root, 64 << 20, FP, backoff=WriteBackoff(clock=clock))
    store = TieredStore(None, [tier])
    items = {key_for(rng): entry_for(rng) for _ in range(4)}
    for k, e in list(items.items())[:3]:
        tier.put(k, e)
    before = (root / ".store-key").read_bytes()
    shutil.rmtree(root)
    for k in items:
        assert tier.get(k) is None and not tier.has(k)
        assert store.get(k) is None and store.has(k) is None
    assert list(tier.keys()) == [] and tier.stats()["misses"] >= 3
    last = list(items)[3]
    assert tier.put(last, items[last])  # recreated
    assert tier.get(last) == items[last] and list(tier.keys()) == [last]
    # deleting the store deleted its secret: that is a rotation, never the old secret put back
    assert tier.stats()["key_changes"] == 1 and (root / ".store-key").read_bytes() != before
    assert tier.stats()["bytes"] == file_size(items[last]) and tier.writes_enabled
    assert len(logs.warnings("vanished")) == 1
    # the secret came back with the directory: a process starting now reads what it wrote
    assert DirTier(root, 64 << 20, FP).get(last) == items[last]
    # now the directory cannot come back: a plain file sits where it was
    shutil.rmtree(root)
    root.write_bytes(b"not a directory")
    for k, e in items.items():
        assert not tier.put(k, e) and tier.get(k) is None and not tier.has(k)
        store.put(k, e)
    store.flush(5)
    assert store.get(last) is None and list(tier.keys()) == []
    assert not tier.writes_enabled
    assert len(logs.warnings("writes paused for 1 s")) == 1
    # the directory can be made again: after the pause, the next write is the probe
    root.unlink()
    clock.now += 1.5
    assert tier.writes_enabled and tier.put(last, items[last]) and tier.get(last) == items[last]
    assert len(logs.warnings("writes resumed")) == 1 and tier.stats()["writes_resumed"] == 1
    store.close()
    # a tier started where no directory can be: no secret, so no store at all, said once
    shutil.rmtree(root)
    root.write_bytes(b"not a directory")
    late = DirTier(root / "sub", 64 << 20, FP)
    assert not late.usable and not late.writes_enabled and late.get(last) is None
    assert list(late.keys()) == [] and not late.has(last)
    assert not late.put(last, items[last]) and len(logs.warnings("is not used")) == 1


# -- DirTier: full and read-only disks ----------------------------------------------------------

FAULT_SCRIPT = r"""
import json, logging, os, random, subprocess, sys
from minipic.engine_ext.span_store.tiers import DirTier, Entry
from minipic.engine_ext.span_store.tiers.backoff import WriteBackoff

class Clock:
    now = 1000.0
    def __call__(self):
        return self.now
clock = Clock()

full_dir, ro_dir, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
rng = random.Random(seed)
warnings = []
class H(logging.Handler):
    def emit(self, r):
        if r.levelno >= logging.WARNING:
            warnings.append(r.getMessage())
log = logging.getLogger("vllm.minipic.span_store")
log.addHandler(H()); log.setLevel(logging.DEBUG)
out = {}

# a full disk: 4 MiB tmpfs, capacity far above it
tier = DirTier(full_dir, 1 << 30, "fp", backoff=WriteBackoff(clock=clock))
written = {}
for i in range(40):
    k, e = rng.randbytes(32).hex(), Entry(rng.randbytes(300_000), {"i": i})
    if not tier.put(k, e):
        break
    written[k] = e
out["full_written"] = len(written)
out["full_more_puts"] = [tier.put(rng.randbytes(32).hex(), Entry(b"x" * 1000, {}))
                         for _ in range(3)]
out["full_reads_ok"] = all(tier.get(k) == e for k, e in written.items())
out["full_stats"] = tier.stats()
out["full_warnings"] = list(warnings)
out["full_temps"] = [n for _, _, fs in os.walk(full_dir) for n in fs if n.startswith(".tmp.")]
# space freed by an operator: after the pause a probe write succeeds and writing resumes
for k in list(written)[:3]:
    tier.delete(k)
clock.now += 1.5
out["full_probe"] = tier.put(rng.randbytes(32).hex(), Entry(b"z" * 1000, {}))
out["full_resumed"] = tier.stats()["writes_resumed"]
out["full_resume_warnings"] = list(warnings[len(out["full_warnings"]):])
warnings.clear()

# a read-only disk: written while writable, then remounted read-only under the running tier
tier = DirTier(ro_dir, 1 << 30, "fp", backoff=WriteBackoff(clock=clock))
before = {}
for i in range(3):
    k, e = rng.randbytes(32).hex(), Entry(rng.randbytes(100_000), {"i": i})
    assert tier.put(k, e)
    before[k] = e
subprocess.run(["mount", "-o", "remount,ro", ro_dir], check=True)
out["ro_puts"] = [tier.put(rng.randbytes(32).hex(), Entry(rng.randbytes(1000), {}))
                  for _ in range(3)]
out["ro_reads_ok"] = all(tier.get(k) == e for k, e in before.items())
out["ro_stats"] = tier.stats()
out["ro_warnings"] = list(warnings)
warnings.clear()
# a restart on the read-only store still serves reads
again = DirTier(ro_dir, 1 << 30, "fp", backoff=WriteBackoff(clock=clock))
out["ro_restart_reads_ok"] = all(again.get(k) == e for k, e in before.items())
out["ro_restart_put"] = again.put(rng.randbytes(32).hex(), Entry(b"y", {}))
out["ro_restart_warnings"] = list(warnings)
subprocess.run(["mount", "-o", "remount,rw", ro_dir], check=True)
clock.now += 1.5
out["ro_probe"] = tier.put(rng.randbytes(32).hex(), Entry(b"w" * 1000, {}))
print("RESULT " + json.dumps(out))
"""


def _userns_tmpfs_available(probe: Path) -> str | None:
    probe.mkdir()
    try:
        res = subprocess.run(["unshare", "-rm", "sh", "-c",
                              f"mount -t tmpfs -o size=64k tmpfs {probe}"],
                             capture_output=True, text=True, timeout=20)
    except (FileNotFoundError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return None if res.returncode == 0 else (res.stderr.strip() or f"rc {res.returncode}")


def test_full_and_read_only_disk_pause_writes_until_a_probe_succeeds_real(tmp_path, seed):
    """Real faults: a 4 MiB tmpfs fills up (ENOSPC) and another is remounted read-only (EROFS)
    under a running tier, both inside a user+mount namespace so nothing outlives the test.
    (Tests run as root here, where chmod 0555 would not stop a single write.)"""
    print(f"seed={seed}")
    why = _userns_tmpfs_available(tmp_path / "probe")
    if why:
        pytest.skip(f"no user-namespace tmpfs mounts here ({why}); see the monkeypatched twin")
    full_dir, ro_dir = tmp_path / "full", tmp_path / "ro"
    full_dir.mkdir()
    ro_dir.mkdir()
    script = tmp_path / "faults.py"
    script.write_text(FAULT_SCRIPT)
    res = subprocess.run(
        ["unshare", "-rm", "sh", "-c",
         f"mount -t tmpfs -o size=4m,mode=0700 tmpfs {full_dir} && mount -t tmpfs -o "
         f"size=4m,mode=0700 tmpfs {ro_dir} && exec {sys.executable} {script} {full_dir} "
         f"{ro_dir} {seed}"],
        capture_output=True, text=True, timeout=60, env=py_env(), cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.split("RESULT ", 1)[1])
    print(json.dumps(out, indent=1)[:3000])
    assert 5 <= out["full_written"] < 40
    assert out["full_more_puts"] == [False] * 3 and out["full_reads_ok"]
    assert not out["full_stats"]["writes_enabled"] and out["full_stats"]["hits"] >= 5
    assert out["full_stats"]["write_pauses"] == 1
    assert len(out["full_warnings"]) == 1 and "writes paused" in out["full_warnings"][0]
    assert "No space left" in out["full_warnings"][0]
    assert out["full_temps"] == []  # the failed write cleaned up its temp file
    assert out["full_probe"] is True and out["full_resumed"] == 1
    assert len(out["full_resume_warnings"]) == 1
    assert "resumed" in out["full_resume_warnings"][0]
    assert out["ro_puts"] == [False] * 3 and out["ro_reads_ok"]
    assert len(out["ro_warnings"]) == 1 and "Read-only" in out["ro_warnings"][0]
    assert out["ro_restart_reads_ok"] and out["ro_restart_put"] is False
    assert len(out["ro_restart_warnings"]) == 1
    assert out["ro_probe"] is True  # remounted read-write: the first tier writes again


@pytest.mark.parametrize(("code", "stage"), [
    ("ENOSPC", "open"), ("EROFS", "open"), ("EACCES", "open"), ("EPERM", "open"),
    ("EDQUOT", "open"), ("ENOSPC", "fsync"), ("EDQUOT", "fsync"),
])
def test_write_fault_matrix_pauses_writes_then_a_probe_resumes(tmp_path, rng, logs, monkeypatch,
                                                                 code, stage):
    """Monkeypatched (the one place here): ``os.open`` of the store's own temp files, or
    ``os.fsync``, raises ``code`` — the errnos a quota or a permission change give, which this
    machine cannot produce for real. Every other call goes to the real function."""
    clock = Clock()
    tier = DirTier(tmp_path, 64 << 20, FP, backoff=WriteBackoff(clock=clock))
    store = TieredStore(RamTier(64 << 20), [tier])
    good = {key_for(rng): entry_for(rng) for _ in range(3)}
    for k, e in good.items():
        assert tier.put(k, e)
    err = getattr(errno, code)
    if stage == "open":
        real_open = os.open

        def fake_open(path, flags, *args, **kwargs):
            ours = str(path).startswith(str(tmp_path)) or (  # or a temp file made in a shard
                kwargs.get("dir_fd") is not None and str(path).startswith(".tmp."))
            if ours and flags & os.O_CREAT:
                raise OSError(err, os.strerror(err), str(path))
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", fake_open)
    else:
        def fake_fsync(fd):
            raise OSError(err, os.strerror(err))

        monkeypatch.setattr(os, "fsync", fake_fsync)
    fresh = [(key_for(rng), entry_for(rng)) for _ in range(4)]
    assert not tier.put(*fresh[0]) and not tier.writes_enabled
    assert not tier.put(*fresh[1])
    for k, e in fresh[2:]:
        store.put(k, e)  # RAM takes it; the disk write is skipped (writes off), never raised
        assert store.get(k) == (e, "ram")
    store.flush(5)
    assert all(tier.get(k) == e for k, e in good.items())  # reads keep working
    assert not any(tier.has(k) for k, _ in fresh)
    assert temp_files(tmp_path) == []
    warned = logs.warnings("writes paused for 1 s")
    assert len(warned) == 1 and os.strerror(err) in warned[0], logs.warnings()
    st = tier.stats()
    assert st["writes_enabled"] is False and st["write_errors"] == 1 and st["writes_paused"]
    assert store.stats()["skipped_writes_off"] == 2
    # the fault persists: the probe after the pause fails and the next pause is twice as long
    clock.now += 1.5
    assert tier.writes_enabled and not tier.put(*fresh[0]) and not tier.writes_enabled
    assert len(logs.warnings("writes paused for 2 s")) == 1
    # the fault is gone: the probe after the pause writes, and writing resumes
    monkeypatch.undo()
    clock.now += 1.5
    assert not tier.writes_enabled  # still inside the 2 s pause
    clock.now += 1.0
    assert tier.put(*fresh[0]) and tier.get(fresh[0][0]) == fresh[0][1]
    assert len(logs.warnings("writes resumed")) == 1
    st = tier.stats()
    assert st["writes_enabled"] and not st["writes_paused"] and st["writes_resumed"] == 1
    assert st["write_pauses"] == 2
    store.put(*fresh[1])
    store.flush(5)
    assert tier.get(fresh[1][0]) == fresh[1][1]
    store.close()


# -- processes: SIGKILL mid-write, two writers on one key ---------------------------------------

WRITER_SCRIPT = r"""
import hashlib, random, sys
from minipic.engine_ext.span_store.tiers import DirTier, Entry
path, seed, start = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
tier = DirTier(path, 1 << 40, "fp-kill")
for i in range(start, start + 100_000):
    rng = random.Random(seed * 1_000_003 + i)
    key = hashlib.sha256(f"{seed}-{i}".encode()).hexdigest()
    tier.put(key, Entry(rng.randbytes(rng.randrange(100_000, 2_000_000)), {"i": i}))
"""


def _expected(seed: int, i: int) -> Entry:
    rng = random.Random(seed * 1_000_003 + i)
    return Entry(rng.randbytes(rng.randrange(100_000, 2_000_000)), {"i": i})


def test_sigkill_mid_write_leaves_nothing_that_reads_as_valid(tmp_path, seed):
    print(f"seed={seed}")
    rng = random.Random(seed)
    rounds = 10  # each round's writer starts at key index round * 500 (and writes a few)
    keys = {hashlib.sha256(f"{seed}-{i}".encode()).hexdigest(): i
            for i in range(rounds * 500 + 500)}
    torn_seen = 0
    for round_ in range(rounds):
        proc = subprocess.Popen([sys.executable, "-c", WRITER_SCRIPT, str(tmp_path), str(seed),
                                 str(round_ * 500)], env=py_env(), cwd=REPO)
        target = round_ * 3 + 2
        deadline = time.monotonic() + 30
        while len(list(tmp_path.rglob(f"*{SUFFIX}"))) < target and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(rng.uniform(0, 0.03))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        torn = temp_files(tmp_path)
        torn_seen += bool(torn)
        if round_ >= 4 and torn_seen:
            break
    print(f"rounds={round_ + 1} rounds with a torn temp file={torn_seen}")
    listed = sorted(DirTier(tmp_path, 1 << 40, "fp-kill").keys())
    fresh = DirTier(tmp_path, 1 << 40, "fp-kill")
    assert temp_files(tmp_path) == []  # the killed writers' temp files are gone
    assert fresh.stats()["temps_removed"] == 0  # (the first reopen above removed them)
    assert len(listed) >= 2
    for k in listed:
        assert k in keys
        assert fresh.get(k) == _expected(seed, keys[k])  # complete and verified, or absent
    st = fresh.stats()
    assert st["corrupt_removed"] == 0 and st["hits"] == len(listed)


RACER_SCRIPT = r"""
import hashlib, json, os, random, sys, time
from minipic.engine_ext.span_store.tiers import DirTier, Entry
path, seed, variant, go = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
items = []
for i in range(30):
    rng = random.Random(f"{seed}-{variant}-{i}")
    key = hashlib.sha256(f"{seed}-{i}".encode()).hexdigest()
    items.append((key, Entry(rng.randbytes(rng.randrange(200_000, 1_000_000)),
                             {"i": i, "variant": variant})))
tier = DirTier(path, 1 << 40, "fp-race")
open(go + "." + variant, "w").close()  # ready
while not os.path.exists(go):
    time.sleep(0.001)
results = [tier.put(k, e) for k, e in items]
print("RESULT " + json.dumps({"results": results, "stats": tier.stats()}))
"""


def test_two_processes_writing_the_same_keys_leave_one_complete_entry(tmp_path, seed):
    print(f"seed={seed}")
    store, go = tmp_path / "store", tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", RACER_SCRIPT, str(store), str(seed), v,
                               str(go)], stdout=subprocess.PIPE, text=True, env=py_env(),
                              cwd=REPO) for v in ("a", "b")]
    deadline = time.monotonic() + 60
    while not all(Path(f"{go}.{v}").exists() for v in "ab") and time.monotonic() < deadline:
        time.sleep(0.005)  # both have built their payloads and wait at the barrier
    go.touch()
    outs = []
    for proc in procs:
        stdout, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        outs.append(json.loads(stdout.split("RESULT ", 1)[1]))
    for out in outs:
        assert out["results"] == [True] * 30  # each saw its entry (or the other's) on disk
    assert sum(o["stats"]["writes"] for o in outs) == 30  # exactly one publish per key
    assert sum(o["stats"]["already_present"] for o in outs) == 30
    print("writes per process:", [o["stats"]["writes"] for o in outs])
    tier = DirTier(store, 1 << 40, "fp-race")
    keys = sorted(tier.keys())
    assert len(keys) == 30 and temp_files(store) == []
    for k in keys:
        entry = tier.get(k)
        assert entry is not None and entry.meta["variant"] in ("a", "b")
        rng = random.Random(f"{seed}-{entry.meta['variant']}-{entry.meta['i']}")
        assert entry.payload == rng.randbytes(rng.randrange(200_000, 1_000_000))
    assert len(list(store.rglob(f"*{SUFFIX}"))) == 30


# -- TieredStore --------------------------------------------------------------------------------

def test_store_put_returns_at_once_and_flush_makes_it_durable(tmp_path, rng):
    tier = GatedTier(tmp_path, 64 << 20, FP)
    store = TieredStore(RamTier(0), [tier])  # no RAM room: only the pending write holds it
    k, e = key_for(rng), entry_for(rng)
    t0 = time.monotonic()
    store.put(k, e)
    took = time.monotonic() - t0
    assert took < 1.0, took  # the writer is blocked on the gate; put did not wait for it
    assert tier.entered.wait(10)
    assert store.has(k) == "ram" and store.get(k) == (e, "ram")  # pending counts as RAM
    assert not tier.has(k)
    store.flush(timeout=0.05)  # times out while the disk is stuck, without raising
    assert store.stats()["pending_writes"] == 1
    tier.gate.set()
    store.flush()
    assert store.stats()["pending_writes"] == 0
    assert tier.has(k) and store.has(k) == "disk" and store.get(k) == (e, "disk")
    store.close()
    store.close()  # idempotent
    k2 = key_for(rng)
    store.put(k2, e)  # after close: RAM only (here: nowhere), counted
    assert store.stats()["skipped_closed"] == 1 and not tier.has(k2)


def test_store_full_writer_queue_is_a_counted_skip(tmp_path, rng):
    tier = GatedTier(tmp_path, 64 << 20, FP)
    store = TieredStore(RamTier(64 << 20), [tier], queue_size=2)
    items = [(key_for(rng), entry_for(rng)) for _ in range(5)]
    store.put(*items[0])
    assert tier.entered.wait(10)  # the writer holds items[0]; the queue is empty again
    t0 = time.monotonic()
    for k, e in items[1:]:
        store.put(k, e)
    assert time.monotonic() - t0 < 1.0
    st = store.stats()
    assert st["queued"] == 3 and st["skipped_queue_full"] == 2 and st["pending_writes"] == 3
    assert all(store.has(k) == "ram" for k, _ in items)  # all in RAM regardless
    store.put(*items[1])  # already pending: not queued twice
    assert store.stats()["queued"] == 3
    tier.gate.set()
    store.flush()
    assert [tier.has(k) for k, _ in items] == [True, True, True, False, False]
    # the byte bound works the same way
    tier2 = GatedTier(tmp_path / "b", 64 << 20, FP)
    small = TieredStore(None, [tier2], max_pending_bytes=items[0][1].nbytes)
    small.put(*items[0])
    assert tier2.entered.wait(10)
    small.put(*items[1])
    big = max(items[0][1].nbytes + 1, items[1][1].nbytes)
    small.put(key_for(rng), entry_for(rng, big))
    assert small.stats()["skipped_queue_full"] >= 1
    tier2.gate.set()
    small.close()
    store.close()


def test_store_promotes_disk_hits_and_reports_sources(tmp_path, rng):
    local, shared = tmp_path / "local", tmp_path / "shared"
    items = {key_for(rng): entry_for(rng) for _ in range(6)}
    with TieredStore(RamTier(64 << 20),
                     [DirTier(local, 64 << 20, FP), DirTier(shared, 64 << 20, FP, "shared")]) as s:
        for k, e in items.items():
            s.put(k, e)
        s.flush()
        assert all(s.has(k) == "ram" for k in items)
    # a restarted process: RAM empty, both tiers on disk
    disk = DirTier(local, 64 << 20, FP)
    share = DirTier(shared, 64 << 20, FP, "shared")
    ram = RamTier(64 << 20)
    store = TieredStore(ram, [disk, share])
    keys = list(items)
    k0, k1 = keys[0], keys[1]
    assert store.has(k0) == "disk"
    assert store.get(k0) == (items[k0], "disk")
    assert k0 in ram and store.has(k0) == "ram" and store.get(k0) == (items[k0], "ram")
    disk.delete(k1)  # only the shared tier has it now
    assert store.has(k1) == "shared" and store.get(k1) == (items[k1], "shared")
    assert store.get(k1) == (items[k1], "ram")
    missing = key_for(rng)
    assert store.has(missing) is None and store.get(missing) is None
    st = store.stats()
    assert st["hits"] == {"ram": 2, "disk": 1, "shared": 1} and st["misses"] == 1
    assert st["tiers"]["disk"]["hits"] == 1 and st["ram"]["entries"] == 2
    # a RAM tier too small for an entry still serves it from disk, every time
    tiny = TieredStore(RamTier(10), [disk])
    assert tiny.get(keys[2]) == (items[keys[2]], "disk") == tiny.get(keys[2])
    with pytest.raises(ValueError):
        TieredStore(None, [disk, DirTier(tmp_path / "x", 1, FP)])  # two tiers named "disk"
    with pytest.raises(ValueError):
        store.put("Not A Key", items[k0])  # caught in the caller's thread, not the writer's
    store.close()
    tiny.close()


class FlakyTier(DirTier):
    """A real DirTier that raises unexpected exceptions while ``broken`` is set."""

    broken = True

    def get(self, key: str) -> Entry | None:
        if self.broken:
            raise RuntimeError("tier bug (get)")
        return super().get(key)

    def has(self, key: str) -> bool:
        if self.broken:
            raise RuntimeError("tier bug (has)")
        return super().has(key)

    def put(self, key: str, entry: Entry) -> bool:
        if self.broken:
            raise RuntimeError("tier bug (put)")
        return super().put(key, entry)


def test_store_turns_tier_exceptions_into_misses(tmp_path, rng, logs):
    flaky = FlakyTier(tmp_path / "flaky", 64 << 20, FP, "flaky")
    good = DirTier(tmp_path / "good", 64 << 20, FP)
    store = TieredStore(None, [flaky, good])
    k, e = key_for(rng), entry_for(rng)
    store.put(k, e)
    store.flush()
    assert store.has(k) == "disk" and store.get(k) == (e, "disk")  # past the broken tier
    st = store.stats()
    assert st["writer_errors"] == 1 and st["tier_errors"] == 2
    flaky.broken = False
    k2, e2 = key_for(rng), entry_for(rng)
    store.put(k2, e2)  # the flaky tier's writer thread survived its exception
    store.flush()
    assert flaky.has(k2) and store.get(k2) == (e2, "flaky")
    assert len([r for r in logs.records if "failed in" in r.getMessage()]) == 1
    store.close()
