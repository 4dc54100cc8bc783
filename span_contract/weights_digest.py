"""The weights digest: sha256 of a model folder's files, which names the weights in every span
store key, and the caches that keep a restart from re-hashing them.

Why a digest of the bytes: the store must never serve KV computed by other weights under the same
block hash, and a name is not a digest (the same hub id or folder can hold other weights
tomorrow). Hashing a 270 MB model takes about a second; a 60 GB one, minutes. So the digest is
cached next to the minipic cache, under a **stamp** of each file that a replacement cannot keep:
size, mtime, **ctime, inode and device**. Sizes and mtimes alone are kept by fine-tunes of one
architecture (identical shapes) and by image builds that normalise timestamps
(``SOURCE_DATE_EPOCH``, Nix, Bazel); ``os.utime`` restores an mtime. No call sets a ctime: any
write, ``utime`` or rename-into-place moves it to the kernel's clock, and a file renamed over the
old one is another inode. The one way to keep a stamp is to rewrite a file in place within one
tick of the kernel's coarse clock of the moment it was stamped; so, as git does for its index
("racily clean" entries), a digest is not cached while any file's ctime is within
``_RACY_NS`` of the clock: the next start hashes again. A spurious re-hash (a ``chmod``, a
container whose overlay mount has another device number) only costs time.

Every look also re-hashes, whole, the files of at most ``_SMALL_BYTES`` (configs, tokenizer
models, remote code) and each safetensors file's header (its 8-byte length and JSON: names,
dtypes, shapes, offsets), and compares them with what the cache recorded (``quick``): a few MB for
any model, so it costs milliseconds, and it catches a changed config or tensor layout even on a
file system whose stamps are not trustworthy (a FUSE mount that reports inode 0). Tensor bytes
have no checksum in the format, so they are covered by the stamp and the full hash only.

**Two caches.** The launcher (``SpanStoreConfig.resolved``) and the engine
(``connector.engine_weights_digest``) each keep their own file (``LAUNCHER_CACHE``,
``ENGINE_CACHE``): the engine's check exists to catch a launcher digest that is wrong (weights
replaced during start-up, a cache entry left by a bug or written by someone), so it must not read
what it checks. The cost: a model is hashed in full twice when its stamp is new (once per side),
never on a restart of unchanged files. Engine processes that start together (the scheduler and
every tensor-parallel rank) take a lock on their cache while hashing, so one hashes and the others
find its entry.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

LAUNCHER_CACHE = "weights-digests.json"
ENGINE_CACHE = "weights-digests-engine.json"
# what a model folder's KV depends on: weights, configs, tokenizer models, and the modeling code
# a ``trust_remote_code`` model brings in ``.py`` files
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".json", ".model", ".gguf", ".py")
_SMALL_BYTES = 1 << 20  # hashed whole at every look (configs, tokenizers, code)
_HEADER_MAX = 100 << 20  # safetensors' own limit on a header
# a file changed this close to the clock may share its ctime with a later in-place rewrite
_RACY_NS = 2_000_000_000


def weights_digest(model: str, revision: str | None = None, *, cache: str = LAUNCHER_CACHE
                   ) -> str:
    """sha256 over the model's weight and config files ("" when the files cannot be found: a hub
    id not downloaded yet, which means no store), cached in ``cache`` under the files' stamps
    and quick digest (module docstring)."""
    root = local_model_dir(model, revision)
    if root is None:
        return ""
    files = sorted(p for p in root.glob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    if not any(p.suffix != ".json" for p in files):
        return ""  # no weights here: nothing to name
    name = str(root.resolve())
    path = _cache_path(cache)
    with _locked(path):
        stamp, now = _stamp(files), _now_ns()
        quick = _quick_digest(files)
        entry = _read_cache(path).get(name)
        if entry and entry.get("stamp") == stamp and entry.get("quick") == quick:
            return str(entry["digest"])
        value = _full_digest(files)
        racy = any(abs(s[3] - now) <= _RACY_NS for s in stamp)
        if path is not None and not racy and _stamp(files) == stamp:  # unchanged while hashed
            _write_cache(path, name, {"stamp": stamp, "quick": quick, "digest": value})
    return value


def engine_digest(model: str, revision: str | None = None) -> str:
    """``weights_digest`` with the engine's own cache (never the launcher's)."""
    return weights_digest(model, revision, cache=ENGINE_CACHE)


def local_model_dir(model: str, revision: str | None = None) -> Path | None:
    """The folder holding ``model``'s files: the folder itself, or the local Hugging Face
    snapshot of a hub id at ``revision`` (never a download). None when there is none."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:  # noqa: BLE001 (not a hub id, not cached, no hub library: unknown)
        return None


def _now_ns() -> int:
    """The clock a stamp's ctimes are compared with (a hook: tests set it)."""
    return time.time_ns()


def _stamp(files: list[Path]) -> list[list[Any]]:
    """Per file: name, size, mtime, ctime, inode, device (``st`` follows a hub snapshot's
    symlinks to the blobs)."""
    out = []
    for p in files:
        st = p.stat()
        out.append([p.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev])
    return out


def _quick_digest(files: list[Path]) -> str:
    """sha256 over the small files' bytes and the safetensors headers: cheap at any size."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size <= _SMALL_BYTES:
                digest.update(handle.read())
            elif path.suffix == ".safetensors":
                head = handle.read(8)
                digest.update(head)
                if len(head) == 8:
                    (length,) = struct.unpack("<Q", head)
                    if length <= min(_HEADER_MAX, size - 8):
                        digest.update(handle.read(length))
    return digest.hexdigest()


def _full_digest(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode())
        with path.open("rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()[:32]


def _cache_path(cache: str) -> Path | None:
    try:
        from minipic.span_contract.models import cache_root

        return cache_root() / cache
    except Exception:  # noqa: BLE001 (no writable cache: compute every time)
        return None


@contextlib.contextmanager
def _locked(path: Path | None) -> Iterator[None]:
    """Hold ``path``'s lock file: processes starting together hash once, the others wait and
    find the entry. Without a writable cache folder, no lock (each hashes)."""
    handle = None
    if path is not None:
        try:
            import fcntl

            path.parent.mkdir(parents=True, exist_ok=True)
            handle = open(path.with_suffix(".lock"), "a")  # noqa: SIM115 (closed below)
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:
            if handle is not None:
                handle.close()
            handle = None
    try:
        yield
    finally:
        if handle is not None:
            handle.close()  # releases the lock


def _read_cache(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _write_cache(path: Path, name: str, entry: dict[str, Any]) -> None:
    known = _read_cache(path)
    known[name] = entry
    try:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known))
        os.replace(tmp, path)
    except OSError:
        pass  # a cache only: the digest is recomputed next time
