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
* ``fifo``, ``folder``, ``oversized`` (a sparse file larger than the tier).

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
from minipic.engine_ext.span_store.tiers.files import SECRET_NAME, entry_mac, key_id  # noqa: E402
from minipic.engine_ext.span_store.tiers.format import hashed_header  # noqa: E402

FINGERPRINT = "fault-injection|model=tiny|dtype=float32|bs=16"
KINDS = ("bit_flip", "truncate", "extend", "foreign_fingerprint", "forged_unkeyed",
         "forged_other_secret", "other_store_copy", "renamed", "symlink", "fifo", "folder",
         "oversized", "secret_other_owner")
KEPT_KINDS = ("foreign_fingerprint", "other_store_copy")  # someone's valid entry: stays
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


def run(cases: int, seed: int, work: Path | None = None, progress: bool = True) -> dict:
    """``cases`` faults, kinds in turn; the per-kind tally."""
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
                                               "other_key_skipped", "hits")}}
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
