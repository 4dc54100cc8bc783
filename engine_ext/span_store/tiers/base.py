"""What every tier shares: the entry, the key rule, and the names of a read's outcomes."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field

logger = logging.getLogger("vllm.minipic.span_store")

RAM_SOURCE = "ram"

# Keys become file names: lowercase letters, digits, '-' and '_' only, so a key can never
# escape its folder, never look like a temp file, and two keys never merge on a case-insensitive
# shared filesystem.
KEY_RE = re.compile(r"[0-9a-z_-]{2,200}")

# Verification outcomes of a read. Removed: the file is damaged or not ours to understand.
# Kept: the file is valid data of another configuration or a newer minipic sharing the folder.
REMOVED_REASONS = {
    "format": "not a span-store entry (bad magic or metadata)",
    "version": "an entry of an older or unknown format version",
    "length": "truncated or extended (its size disagrees with its header)",
    "checksum": "damaged or forged (MAC mismatch)",
    "special": "not a regular file (a symlink, FIFO, device or folder) or larger than the tier",
}
KEPT_REASONS = {
    "foreign": "written by another model or config (fingerprint differs)",
    "newer": "written in a newer format version",
    "other_key": "MAC-ed under another store secret (written before the secret was rotated, "
                 "or copied from another store)",
}


def check_key(key: str) -> None:
    """Raise ``ValueError`` unless ``key`` is a valid store key (see ``KEY_RE``)."""
    if not isinstance(key, str) or not KEY_RE.fullmatch(key):
        raise ValueError(f"invalid span-store key {key!r}: expected 2-200 chars of [0-9a-z_-]")


def _encode_meta(meta: dict) -> bytes:
    if not isinstance(meta, dict):
        raise TypeError(f"Entry.meta must be a dict, got {type(meta).__name__}")
    return json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Entry:
    """One stored KV block: opaque payload bytes plus small JSON-able metadata.

    The metadata is normalised through JSON at construction (so a RAM hit returns exactly what a
    disk hit would, and a non-JSON value fails in the caller's thread, not a writer's). Treat
    ``meta`` as read-only: a RAM hit hands every reader the same object. A ``bytearray`` or
    ``memoryview`` payload is copied into ``bytes``, so a buffer mutated after ``put`` can never
    change what the store returns.
    """

    payload: bytes
    meta: dict
    _meta_json: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.payload, bytes):
            if not isinstance(self.payload, bytearray | memoryview):
                raise TypeError(f"Entry.payload must be bytes, got {type(self.payload).__name__}")
            object.__setattr__(self, "payload", bytes(self.payload))
        meta_json = _encode_meta(self.meta)
        object.__setattr__(self, "meta", json.loads(meta_json))
        object.__setattr__(self, "_meta_json", meta_json)

    @classmethod
    def _trusted(cls, payload: bytes, meta: dict, meta_json: bytes) -> Entry:
        """Build from verified disk bytes without re-encoding the metadata."""
        entry = object.__new__(cls)
        object.__setattr__(entry, "payload", payload)
        object.__setattr__(entry, "meta", meta)
        object.__setattr__(entry, "_meta_json", meta_json)
        return entry

    @property
    def meta_json(self) -> bytes:
        return self._meta_json

    @property
    def nbytes(self) -> int:
        """Bytes this entry accounts for in RAM: payload plus metadata JSON."""
        return len(self.payload) + len(self._meta_json)
