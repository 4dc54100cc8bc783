"""Fault injection over the span store's directory tier: every damaged, foreign, forged or special
file at an entry's name must be a miss, never loaded KV.

    .venv/bin/python benchmarks/store_faults.py                  # 10,000 cases
    .venv/bin/python benchmarks/store_faults.py --cases 500 --out /tmp/faults

Each case writes a fresh valid entry through a real ``TieredStore`` over a real ``DirTier``
(real files, a real secret), replaces what is under its name with one fault, and reads it back
through the store. Kinds:

* ``bit_flip`` (one random bit anywhere in the file), ``truncate``, ``extend``;
* ``foreign_fingerprint``: a valid entry another model/config wrote under this key;
* ``forged_unkeyed``: a well-formed entry whose digest is a plain sha256 (no secret), claiming
  this store's key id (it is public: every entry header carries it);
* ``forged_other_secret``: a well-formed entry MAC-ed under a secret that is not this store's,
  claiming this store's key id;
* ``other_store_copy`` (another key): a valid entry of the same key copied from another store
  directory, under that store's key id -- what every entry looks like after a key rotation;
* ``secret_other_owner``: another user (uid 65534) created the store folder's secret first,
  mode 0600, and planted an entry MAC-ed under it (needs root; otherwise counted as skipped);
* ``renamed``: a valid entry of another key of this store, under this key's name;
* ``symlink``: a symlink to a valid copy of this very entry kept outside the store;
* ``fifo``, ``folder``, ``oversized`` (a sparse file larger than the tier);
* ``same_stamp_weights``: an entry written under the fingerprint of weights A; the weights are
  replaced by B with the same sizes, the same safetensors header and the old mtime restored (in
  place or renamed over); the engine's weights digest is taken again and the entry read under
  that fingerprint (``same_stamp_weights``).
* ``stale_writer``: a store folder's secret is rotated; a replica started since fills this key
  under the new secret, and a replica that has not looked at the secret file since writes it
  too: the read is an entry of the old secret (a miss, kept), and the fresh entry must still
  read as written;
* ``transiently_bad_secret``: the secret file reads bad for a while (0644, truncated, too long,
  another user's) holding bytes others may know, with an entry MAC-ed under them at this key;
  the folder's control entry must load meanwhile, and writes resume once the file is good;
* ``oversized_sparse_entry``: a sparse file larger than this engine's entries (told by
  ``bound_entries``) and smaller than the tier, with a well-formed header naming the store's key
  id: refused before a byte is read (reported: the most bytes one such lookup read);
* ``several_instances``: three tier instances (threads) of capacity C each write random entries
  into one folder while its bytes are sampled under the folder ledger's lock; the case reads a
  key nobody wrote (a miss). Reported: the largest folder bytes / C, which must be <= 1 (no
  allowance for writes in flight); a breach fails the run.

A control entry is read after every case: it must still load. Kinds whose file is valid data of
someone else (``foreign_fingerprint``, ``other_store_copy``) must also stay on disk: a miss,
never a deletion. Writes ``<out>.json`` and ``<out>.md``: per kind, cases, misses, loaded (must
be 0), valid entries deleted (must be 0) and the slowest read.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import secrets
import shutil
import struct
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from minipic.engine_ext.span_store.tiers import (  # noqa: E402
    HASHED_HEADER_BYTES,
    DirTier,
    Entry,
    TieredStore,
)
from minipic.engine_ext.span_store.tiers.backoff import WriteBackoff  # noqa: E402
from minipic.engine_ext.span_store.tiers.files import SECRET_NAME, entry_mac, key_id  # noqa: E402
from minipic.engine_ext.span_store.tiers.format import hashed_header  # noqa: E402
from minipic.span_contract import weights_digest as digests  # noqa: E402

FINGERPRINT = "fault-injection|model=tiny|dtype=float32|bs=16"
KINDS = ("bit_flip", "truncate", "extend", "foreign_fingerprint", "forged_unkeyed",
         "forged_other_secret", "other_store_copy", "renamed", "symlink", "fifo", "folder",
         "oversized", "secret_other_owner", "same_stamp_weights", "stale_writer",
         "transiently_bad_secret", "oversized_sparse_entry", "several_instances")
KEPT_KINDS = ("foreign_fingerprint", "other_store_copy",  # someone's valid entry: stays
              "same_stamp_weights")
OTHER_UID = 65534
CAPACITY = 64 << 20


def _entry(rng: random.Random) -> Entry:
    return Entry(rng.randbytes(rng.randrange(512, 24_000)),
                 {"home": rng.randrange(0, 4096), "layers": 2, "page_bytes": 4096})


def _forge(key: str, entry: Entry, mac_key: bytes | None, fingerprint: str = FINGERPRINT,
          claimed_key_id: bytes | None = None) -> bytes:
    """A well-formed entry file whose digest is a plain sha256 (``mac_key`` None) or a MAC
    under ``mac_key``, naming ``claimed_key_id`` (default: ``mac_key``'s own id, or zeros)."""
    fp, meta = fingerprint.encode(), entry.meta_json
    if claimed_key_id is None:
        claimed_key_id = key_id(mac_key) if mac_key is not None else bytes(8)
    fixed = hashed_header(fp, meta, len(entry.payload), claimed_key_id)
    if mac_key is None:
        key_b = key.encode()
        digest = hashlib.sha256(fixed[:HASHED_HEADER_BYTES] + struct.pack("<H", len(key_b))
                                + key_b + fp + meta + entry.payload).digest()
    else:
        digest = entry_mac(mac_key, fixed, key, fp, meta, entry.payload)
    return fixed + digest + fp + meta + entry.payload


def _weights_file(rng: random.Random, tensor_bytes: int = 3 << 20) -> bytes:
    """A safetensors file with one tensor: the same header every draw, fresh tensor bytes."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [tensor_bytes // 4],
                               "data_offsets": [0, tensor_bytes]}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + rng.randbytes(tensor_bytes)


def same_stamp_weights(work: Path, rng: random.Random, key: str, entry: Entry
                       ) -> tuple[bool | None, float, bool]:
    """Write ``entry`` under the fingerprint of the weights in ``work/weights``, replace them by
    other bytes that keep every size and mtime (a fine-tune unpacked by a build that normalises
    timestamps), and read ``key`` back under the fingerprint of the digest taken again. The
    digest is the engine's (its own cache, ``work/digests.json``), with the clock moved a minute
    on: the files are seconds old in practice, so the stamp cache answers, which is what this
    kind checks (a digest taken within 2 s of a change is never cached at all)."""
    folder, cache = work / "weights", str(work / "digests.json")
    weights = folder / "model.safetensors"
    if not folder.is_dir():
        folder.mkdir()
        (folder / "config.json").write_text('{"architectures": ["X"]}')
        weights.write_bytes(_weights_file(rng))
    clock, log = digests._now_ns, logging.getLogger("vllm.minipic.span_store")
    digests._now_ns = lambda: time.time_ns() + 60 * 10**9
    level, log.level = log.level, logging.ERROR  # "entries of another config": each case
    try:
        before = weights.stat()
        fingerprint = f"{FINGERPRINT}|weights={digests.weights_digest(str(folder), cache=cache)}"
        writer = DirTier(work / "store", CAPACITY, fingerprint, fsync=False)
        assert writer.put(key, entry)
        data = _weights_file(rng)
        if rng.random() < 0.5:  # in place; again if the kernel's coarse clock has not moved
            while weights.stat().st_ctime_ns == before.st_ctime_ns:
                with weights.open("r+b") as handle:
                    handle.write(data)
        else:
            (folder / "new").write_bytes(data)
            os.replace(folder / "new", weights)
        os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
        started = time.perf_counter()
        digest = digests.weights_digest(str(folder), cache=cache)
        reader = TieredStore(None, [DirTier(work / "store", CAPACITY,
                                            f"{FINGERPRINT}|weights={digest}", fsync=False)])
        got = reader.get(key)
        seconds = time.perf_counter() - started
        reader.close()
    finally:
        digests._now_ns = clock
        log.setLevel(level)
    path = writer.entry_path(key)
    deleted = not path.is_file()  # A's valid entry: a miss for B, never deleted
    path.unlink(missing_ok=True)
    return got is not None, seconds, deleted


class _Clock:
    """A clock a case advances: a tier's back-off without waiting for it."""

    now = 1000.0

    def __call__(self) -> float:
        return self.now


def _write_secret(root: Path, secret: bytes, mode: int = 0o600) -> None:
    """Replace the store's secret file by one holding ``secret`` (atomically: a new inode)."""
    tmp = root / "replacement"
    tmp.write_bytes(secret)
    tmp.chmod(mode)
    os.replace(tmp, root / SECRET_NAME)


def _quiet() -> tuple[logging.Logger, int]:
    """Rotations and bad secrets are logged once per tier; each case makes new tiers."""
    log = logging.getLogger("vllm.minipic.span_store")
    level, log.level = log.level, logging.ERROR
    return log, level


def stale_writer(work: Path, rng: random.Random, key: str, entry: Entry
                 ) -> tuple[bool | None, float, bool]:
    """Two replicas on one folder; its secret is rotated (replaced, or deleted and made anew by
    the next replica to start); the fresh replica fills ``key`` under the new secret, and the
    stale one, which has not looked at the file since, writes ``key`` too. Loaded: an entry the
    stale one wrote before the rotation reads as KV for the fresh one. Deleted: the fresh one's
    entry no longer reads as what it wrote (the stale writer replaced it), or the old entry is
    gone (a miss left in place is the rule)."""
    root = work / f"rotated-{key[:12]}"
    log, level = _quiet()
    try:
        stale = DirTier(root, CAPACITY, FINGERPRINT, fsync=False)
        before = rng.randbytes(32).hex()
        assert stale.put(before, _entry(rng))
        if rng.random() < 0.5:
            _write_secret(root, secrets.token_bytes(32))
        else:
            (root / SECRET_NAME).unlink()
        fresh = DirTier(root, CAPACITY, FINGERPRINT, fsync=False)
        assert fresh.put(key, entry)
        stale.put(key, _entry(rng))  # the same block, recomputed by the stale replica
        started = time.perf_counter()
        got = fresh.get(before)
        seconds = time.perf_counter() - started
        deleted = fresh.get(key) != entry or not fresh.entry_path(before).is_file()
    finally:
        log.setLevel(level)
    shutil.rmtree(root)
    return got is not None, seconds, deleted


def transiently_bad_secret(work: Path, rng: random.Random, key: str, entry: Entry
                           ) -> tuple[bool | None, float, bool]:
    """The secret file reads bad for a while -- new bytes at 0644 (a non-atomic rotation caught
    before its chmod), truncated, too long, or (as root) another user's -- and an entry MAC-ed
    under the bytes it holds, which others may know, is at ``key``. Loaded: that entry reads as
    KV. The folder's control entry, under the last good secret, must load meanwhile and after,
    and writes must resume once the file holds the good secret again."""
    root = work / f"bad-secret-{key[:12]}"
    clock = _Clock()
    log, level = _quiet()
    try:
        tier = DirTier(root, CAPACITY, FINGERPRINT, fsync=False, backoff=WriteBackoff(clock=clock))
        control, control_entry = rng.randbytes(32).hex(), _entry(rng)
        assert tier.put(control, control_entry)
        path, good, known = root / SECRET_NAME, (root / SECRET_NAME).read_bytes(), b""
        how = rng.choice(("0644", "truncated", "too long") + (("owner",) if os.geteuid() == 0
                                                                else ()))
        if how == "0644":
            known = secrets.token_bytes(32)
            _write_secret(root, known, 0o644)
        elif how == "truncated":
            known = good[:rng.randrange(0, 32)]
            path.write_bytes(known)  # in place: the same file, cut short
        elif how == "too long":
            known = good + secrets.token_bytes(rng.randrange(1, 32))
            path.write_bytes(known)
        else:
            known = secrets.token_bytes(32)
            _write_secret(root, known)
            os.chown(path, OTHER_UID, OTHER_UID)
        planted = tier.entry_path(key)
        planted.parent.mkdir(mode=0o700, exist_ok=True)
        planted.write_bytes(_forge(key, entry, known))
        started = time.perf_counter()
        got = tier.get(key)  # a key id the tier does not know: it looks at the file now
        seconds = time.perf_counter() - started
        if tier.get(control) != control_entry or tier.writes_enabled:
            raise AssertionError(f"a {how} secret stopped reads or let writes go on")
        _write_secret(root, good)
        clock.now += 1000
        if not tier.put(rng.randbytes(32).hex(), _entry(rng)):
            raise AssertionError(f"writes did not resume after a {how} secret was fixed")
        deleted = tier.get(control) != control_entry
    finally:
        log.setLevel(level)
    shutil.rmtree(root)
    return got is not None, seconds, deleted


# what the bound kinds measure, beside loaded / deleted (``run`` reports it)
EXTRA: dict[str, dict[str, float]] = {}


def oversized_sparse_entry(work: Path, rng: random.Random, key: str, entry: Entry
                           ) -> tuple[bool | None, float, bool]:
    """A sparse file at ``key``'s name, larger than the engine's entries and smaller than the
    tier, whose header (naming the store's public key id) says it is that large: read before
    its MAC check it would cost its size in memory. Loaded: it read as KV; deleted: a real entry
    of the engine's size stopped loading. Bytes ``os.read`` returned during the lookup are
    recorded."""
    tier = DirTier(work / "sparse", CAPACITY, FINGERPRINT, fsync=False)
    tier.bound_entries(24_000)  # the largest payload ``_entry`` makes: this "engine"'s blocks
    real = rng.randbytes(32).hex()
    assert tier.put(real, entry)
    kid = tier.entry_path(real).read_bytes()[24:32]
    fp, meta = FINGERPRINT.encode(), b"{}"
    size = rng.randrange(tier.max_entry_bytes + 1, CAPACITY)
    path = tier.entry_path(key)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    with path.open("wb") as fh:
        fh.write(hashed_header(fp, meta, size - 64 - len(fp) - len(meta), kid) + bytes(32)
                 + fp + meta)
        fh.truncate(size)
    read, os_read = [0], os.read

    def counted(fd: int, n: int) -> bytes:
        data = os_read(fd, n)
        read[0] += len(data)
        return data

    os.read = counted
    try:
        started = time.perf_counter()
        got = tier.get(key)
        seconds = time.perf_counter() - started
    finally:
        os.read = os_read
    row = EXTRA.setdefault("oversized_sparse_entry", {"max_bytes_read_per_lookup": 0,
                                                      "largest_planted_mib": 0.0})
    row["max_bytes_read_per_lookup"] = max(row["max_bytes_read_per_lookup"], read[0])
    row["largest_planted_mib"] = max(row["largest_planted_mib"], size / 2**20)
    deleted = tier.get(real) != entry
    for name in (key, real):
        tier.entry_path(name).unlink(missing_ok=True)
    return got is not None, seconds, deleted


def several_instances(work: Path, rng: random.Random, key: str, entry: Entry
                      ) -> tuple[bool | None, float, bool]:
    """Three instances of capacity C on one folder write 8 random entries each, at once; the
    folder's bytes (entries and temp files, each inode once) are sampled under the ledger's
    lock meanwhile and after. A sample above C fails the run."""
    import contextlib
    import fcntl
    import threading

    root = work / "instances"
    cap = 6 * 24_000
    tiers = [DirTier(root, cap, FINGERPRINT, fsync=False) for _ in range(3)]
    seeds = [rng.randrange(2**31) for _ in tiers]

    def write(tier: DirTier, seed: int) -> None:
        local = random.Random(seed)
        for _ in range(8):
            tier.put(local.randbytes(32).hex(), _entry(local))

    def folder_bytes() -> int:
        fd = os.open(root / ".store-usage", os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            seen = {}
            for shard in root.iterdir():
                if shard.name.startswith(".") or not shard.is_dir():
                    continue
                for item in shard.iterdir():
                    with contextlib.suppress(FileNotFoundError):
                        st = item.lstat()
                        seen[(st.st_dev, st.st_ino)] = st.st_size
            return sum(seen.values())
        finally:
            os.close(fd)

    threads = [threading.Thread(target=write, args=pair) for pair in zip(tiers, seeds,
                                                                          strict=True)]
    for t in threads:
        t.start()
    samples = [folder_bytes()]
    while any(t.is_alive() for t in threads):
        samples.append(folder_bytes())
    for t in threads:
        t.join()
    samples.append(folder_bytes())
    ratio = max(samples) / cap
    row = EXTRA.setdefault("several_instances", {"max_folder_over_capacity": 0.0,
                                                 "samples": 0})
    row["max_folder_over_capacity"] = max(row["max_folder_over_capacity"], ratio)
    row["samples"] += len(samples)
    if ratio > 1:
        raise AssertionError(f"{len(tiers)} instances of a {cap} B bound: the folder held "
                             f"{max(samples)} B")
    started = time.perf_counter()
    got = tiers[0].get(key)
    return got is not None, time.perf_counter() - started, False


class Injector:
    """One store, a foreign-config writer on the same directory, and another store elsewhere."""

    def __init__(self, work: Path, seed: int) -> None:
        self.work = work
        self.rng = random.Random(seed)
        self.tier = DirTier(work / "store", CAPACITY, FINGERPRINT, fsync=False)
        self.store = TieredStore(None, [self.tier])
        self.foreign = DirTier(work / "store", CAPACITY, FINGERPRINT + "|other-weights",
                               fsync=False)
        self.elsewhere = DirTier(work / "elsewhere", CAPACITY, FINGERPRINT, fsync=False)
        self.outside = work / "outside"
        self.outside.mkdir()
        self.control = self.key()
        self.control_entry = _entry(self.rng)
        assert self.tier.put(self.control, self.control_entry)

    def key(self) -> str:
        return self.rng.randbytes(32).hex()

    @property
    def our_key_id(self) -> bytes:
        return key_id((self.work / "store" / SECRET_NAME).read_bytes())

    def case(self, kind: str) -> tuple[bool | None, float, bool]:
        """Apply one fault of ``kind`` under a fresh key; (loaded, read seconds, a valid entry
        was deleted). Loaded is None for a case this machine cannot set up."""
        rng, key, entry = self.rng, self.key(), _entry(self.rng)
        path = self.tier.entry_path(key)
        if kind == "secret_other_owner":
            return self._secret_other_owner(key, entry)
        own_folder = {"same_stamp_weights": same_stamp_weights, "stale_writer": stale_writer,
                      "transiently_bad_secret": transiently_bad_secret, **BOUND_KINDS}
        if kind in own_folder:  # kinds that set up a store folder of their own
            outcome = own_folder[kind](self.work, rng, key, entry)
            if self.store.get(self.control) != (self.control_entry, "disk"):
                raise AssertionError(f"the control entry stopped loading after a {kind} case")
            return outcome
        if kind == "foreign_fingerprint":
            assert self.foreign.put(key, entry)
        else:
            assert self.tier.put(key, entry)
            raw = bytearray(path.read_bytes())
            if kind == "bit_flip":
                at = rng.randrange(len(raw))
                raw[at] ^= 1 << rng.randrange(8)
            elif kind == "truncate":
                raw = raw[:rng.randrange(len(raw))]
            elif kind == "extend":
                raw += rng.randbytes(rng.randrange(1, 1000))
            elif kind == "forged_unkeyed":
                raw = bytearray(_forge(key, entry, None, claimed_key_id=self.our_key_id))
            elif kind == "forged_other_secret":
                raw = bytearray(_forge(key, entry, secrets.token_bytes(32),
                                       claimed_key_id=self.our_key_id))
            elif kind == "other_store_copy":
                assert self.elsewhere.put(key, entry)
                raw = bytearray(self.elsewhere.entry_path(key).read_bytes())
            elif kind == "renamed":
                raw = bytearray(self.tier.entry_path(self.control).read_bytes())
            path.unlink()
            if kind == "symlink":
                target = self.outside / path.name
                target.write_bytes(bytes(raw))  # this very entry, valid, outside the store
                path.symlink_to(target)
            elif kind == "fifo":
                os.mkfifo(path, 0o600)
            elif kind == "folder":
                path.mkdir(mode=0o700)
                (path / "x").write_bytes(bytes(raw))
            elif kind == "oversized":
                with path.open("wb") as fh:
                    fh.truncate(CAPACITY + 1)
            else:
                path.write_bytes(bytes(raw))
        started = time.perf_counter()
        got = self.store.get(key)
        seconds = time.perf_counter() - started
        if self.store.get(self.control) != (self.control_entry, "disk"):
            raise AssertionError(f"the control entry stopped loading after a {kind} case")
        deleted = kind in KEPT_KINDS and not path.is_file()
        self._clean(path)
        return got is not None, seconds, deleted

    def _secret_other_owner(self, key: str, entry: Entry) -> tuple[bool | None, float, bool]:
        """A store folder whose secret another user created first, with an entry they MAC-ed
        under it: the tier must refuse the folder (unusable), so nothing loads."""
        if self.store.get(self.control) != (self.control_entry, "disk"):
            raise AssertionError("the control entry stopped loading")
        if os.geteuid() != 0:
            return None, 0.0, False
        root = self.work / f"planted-{key[:8]}"
        root.mkdir(mode=0o700)
        secret = secrets.token_bytes(32)
        (root / SECRET_NAME).write_bytes(secret)
        os.chmod(root / SECRET_NAME, 0o600)
        os.chown(root / SECRET_NAME, OTHER_UID, OTHER_UID)
        (root / key[:2]).mkdir(mode=0o700)
        (root / key[:2] / f"{key}.kvb").write_bytes(_forge(key, entry, secret))
        started = time.perf_counter()
        log = logging.getLogger("vllm.minipic.span_store")
        level, log.level = log.level, logging.ERROR  # the refusal's warning, once per case
        try:
            tier = DirTier(root, CAPACITY, FINGERPRINT, fsync=False)
            got = tier.get(key)
        finally:
            log.setLevel(level)
        seconds = time.perf_counter() - started
        loaded = got is not None or tier.usable
        shutil.rmtree(root)
        return loaded, seconds, False

    def _clean(self, path: Path) -> None:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists() or path.is_symlink():
            path.unlink()
        for item in self.outside.iterdir():
            item.unlink()


BOUND_KINDS = {"oversized_sparse_entry": oversized_sparse_entry,
               "several_instances": several_instances}


def run(cases: int, seed: int, work: Path | None = None, progress: bool = True) -> dict:
    """``cases`` faults, kinds in turn; the per-kind tally."""
    EXTRA.clear()
    owned = work is None
    work = Path(tempfile.mkdtemp(prefix="minipic-faults-")) if work is None else work
    try:
        injector = Injector(work, seed)
        tally: dict[str, Counter[str]] = {kind: Counter() for kind in KINDS}
        deleted: Counter[str] = Counter()
        slowest = dict.fromkeys(KINDS, 0.0)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=cases, desc="fault cases", unit="case")
        for i in range(cases):
            kind = KINDS[i % len(KINDS)]
            loaded, seconds, was_deleted = injector.case(kind)
            tally[kind]["cases"] += 1
            tally[kind]["skipped" if loaded is None else "loaded" if loaded else "misses"] += 1
            deleted[kind] += was_deleted
            slowest[kind] = max(slowest[kind], seconds)
            if bar is not None:
                bar.update()
        if bar is not None:
            bar.close()
        injector.store.close()
        stats = injector.tier.stats()
        return {"seed": seed, "cases": cases,
                "kinds": {k: {"cases": t["cases"], "misses": t["misses"],
                              "loaded": t["loaded"], "skipped": t["skipped"],
                              "valid_deleted": deleted[k], "slowest_read_ms": slowest[k] * 1e3}
                          for k, t in tally.items()},
                "loaded": sum(t["loaded"] for t in tally.values()),
                "misses": sum(t["misses"] for t in tally.values()),
                "valid_deleted": sum(deleted.values()),
                "tier": {k: stats[k] for k in ("corrupt_removed", "foreign_skipped",
                                               "other_key_skipped", "hits")},
                "extra": {k: dict(v) for k, v in EXTRA.items()}}
    finally:
        if owned:
            shutil.rmtree(work, ignore_errors=True)


def markdown(result: dict) -> str:
    lines = [f"Fault injection over the span store: {result['cases']} cases, seed "
             f"{result['seed']}: {result['misses']} misses, {result['loaded']} loaded, "
             f"{result['valid_deleted']} valid entries deleted.", "",
             "| fault | cases | misses | loaded | valid deleted | skipped | slowest read (ms) |",
             "|---|---|---|---|---|---|---|"]
    for kind, row in result["kinds"].items():
        lines.append(f"| {kind} | {row['cases']} | {row['misses']} | {row['loaded']} | "
                     f"{row['valid_deleted']} | {row['skipped']} | "
                     f"{row['slowest_read_ms']:.2f} |")
    for kind, row in result.get("extra", {}).items():
        lines.append(f"\n{kind}: " + ", ".join(f"{k} {v:.4g}" for k, v in row.items()))
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=10_000, help="fault cases (kinds in turn)")
    parser.add_argument("--seed", type=int, default=None, help="default: a fresh one")
    parser.add_argument("--out", default=str(ROOT / "results" / "span_store" / "faults"),
                        help="writes OUT.json and OUT.md")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    result = run(args.cases, seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return 0 if result["loaded"] == 0 and result["valid_deleted"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
