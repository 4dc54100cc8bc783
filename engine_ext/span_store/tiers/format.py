"""The entry file format: the one place that writes an entry's bytes and the one that reads them.

**On-disk format** (one file per entry, ``<root>/<key[:2]>/<key>.kvb``; 256 shard folders keep
every folder small — hex-digest keys spread uniformly over them)::

    offset size  field
    0      8     magic            b"MPICSPAN"
    8      2     format version   3 (little-endian, like every field)
    10     2     F: fingerprint length (bytes of UTF-8)
    12     4     M: metadata JSON length
    16     8     P: payload length
    24     8     key id: which store secret the MAC is under (``files.key_id``)
    32     32    HMAC-SHA256 under the store's secret over: bytes 0..32, the key (u16 length +
                 UTF-8), fingerprint, metadata JSON, payload
    64     F     fingerprint (the tier's config fingerprint, UTF-8)
    64+F   M     metadata JSON (UTF-8, sorted keys)
    64+F+M P     payload

The MAC is HMAC-SHA256 (``hmac``/``hashlib``, no dependency) keyed by a secret each store
directory creates at first use (``files``: why, and the file modes, no-follow opens and bounded
reads that keep other local users from reading or planting KV). On CPUs with SHA extensions
sha256 ran ~1.7 GB/s on the dev machine, so verifying a 2 MB block costs ~1 ms. A CRC would be
faster but has 32 bits and no key; the MAC makes a wrong-bytes read practically impossible and a
forged one impossible without the secret. It covers the key as well, so a file copied or renamed
under another key never verifies, and the header's lengths, so a damaged length field is caught
too. An entry under another key id is not checked against our secret at all: it was written
before a rotation or in another store, so it is a miss that stays (``"other_key"``), never
"damage" to remove. Format versions 1 (an unkeyed sha256) and 2 (no key id) read as old formats
and are removed.

Nothing here opens an entry: the directory tier does the file I/O (``read`` callables here are
its reads of one open file) and keeps the bookkeeping.
"""

from __future__ import annotations

import hmac
import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from minipic.engine_ext.span_store.tiers.base import Entry
from minipic.engine_ext.span_store.tiers.files import (
    KEY_ID_BYTES,
    entry_mac,
    key_id,
    open_entry,
    read_exactly,
)

MAGIC = b"MPICSPAN"
# 3: the key id in the header; 2: HMAC under the store's secret; 1: unkeyed sha256
FORMAT_VERSION = 3
# magic, version, fingerprint length, meta length, payload length, key id, HMAC-SHA256
HEADER = struct.Struct(f"<8sHHIQ{KEY_ID_BYTES}s32s")
_FIXED = struct.Struct(f"<8sHHIQ{KEY_ID_BYTES}s")  # the hashed part of the header
HASHED_HEADER_BYTES = _FIXED.size  # the header up to (not including) the digest
SUFFIX = ".kvb"
TEMP_PREFIX = ".tmp."

Read = Callable[[int], bytes]  # up to n bytes of the file, fewer only at its end


class Header(NamedTuple):
    """An entry header's fields (magic checked; version and lengths not yet)."""

    version: int
    fp_len: int
    meta_len: int
    payload_len: int
    key_id: bytes
    digest: bytes

    @property
    def file_bytes(self) -> int:
        """The size of the file this header describes."""
        return HEADER.size + self.fp_len + self.meta_len + self.payload_len


def unpack_header(head: bytes) -> Header | str:
    """The fields of ``head`` (the file's first ``HEADER.size`` bytes), or why it is no entry's
    header: ``"format"`` (bad magic) or ``"length"`` (too short)."""
    if len(head) < len(MAGIC) or head[:len(MAGIC)] != MAGIC:
        return "format"
    if len(head) < HEADER.size:
        # an older format's shorter header still names its version
        if len(head) >= 10 and int.from_bytes(head[8:10], "little") < FORMAT_VERSION:
            return "version"
        return "length"
    _, version, fp_len, meta_len, payload_len, kid, digest = HEADER.unpack(head)
    return Header(version, fp_len, meta_len, payload_len, kid, digest)


def hashed_header(fingerprint: bytes, meta_json: bytes, payload_len: int, kid: bytes) -> bytes:
    """The header up to its digest (the part the digest covers), naming key id ``kid``."""
    return _FIXED.pack(MAGIC, FORMAT_VERSION, len(fingerprint), len(meta_json), payload_len, kid)


def encode_entry(key: str, entry: Entry, fingerprint: bytes, secret: bytes) -> list[bytes]:
    """The file's bytes for ``entry`` under ``key``, in parts (header, fingerprint, metadata,
    payload) so the payload is written without a copy."""
    meta_json = entry.meta_json
    fixed = hashed_header(fingerprint, meta_json, len(entry.payload), key_id(secret))
    mac = entry_mac(secret, fixed, key, fingerprint, meta_json, entry.payload)
    return [fixed + mac, fingerprint, meta_json, entry.payload]


def read_entry(read: Read, file_size: int, key: str, fingerprint: bytes,
               secret: bytes) -> Entry | str:
    """The verified entry of a file of ``file_size`` bytes, read from its start through
    ``read``, or the reason it is not one (a key of ``REMOVED_REASONS`` / ``KEPT_REASONS``)."""
    head = read(HEADER.size)
    header = unpack_header(head)
    if isinstance(header, str):
        return header
    if header.version != FORMAT_VERSION:
        return "newer" if header.version > FORMAT_VERSION else "version"
    if file_size != header.file_bytes:
        return "length"
    if not hmac.compare_digest(header.key_id, key_id(secret)):
        return "other_key"  # checked before the MAC: another secret's entry is not damage
    fp = read(header.fp_len)
    meta_json = read(header.meta_len)
    payload = read(header.payload_len)
    if (len(fp) != header.fp_len or len(meta_json) != header.meta_len
            or len(payload) != header.payload_len):
        return "length"  # shrank while we read it
    mac = entry_mac(secret, head[:HASHED_HEADER_BYTES], key, fp, meta_json, payload)
    if not hmac.compare_digest(mac, header.digest):
        return "checksum"
    if fp != fingerprint:
        return "foreign"
    try:
        meta = json.loads(meta_json)
    except ValueError:
        return "format"
    if not isinstance(meta, dict):
        return "format"
    return Entry._trusted(payload, meta, meta_json)


def read_fingerprint(read: Read) -> bytes | None:
    """The fingerprint an entry file was written under (unverified), or None if it has no
    entry header."""
    header = unpack_header(read(HEADER.size))
    return None if isinstance(header, str) else read(header.fp_len)


def payload_length(path: Path) -> int | None:
    """The payload length an entry file's header states (unverified; the KV bytes of one
    block), or None if the file cannot be read or has no entry header. Opened like an entry
    (``files.open_entry``): a symlink, FIFO or folder at ``path`` is refused, never followed or
    waited on."""
    try:
        fd, _st = open_entry(path.parent, path.name, 1 << 62)
    except OSError:
        return None
    try:
        head = read_exactly(fd, HEADER.size)
    except OSError:
        return None
    finally:
        os.close(fd)
    header = unpack_header(head)
    return None if isinstance(header, str) else header.payload_len
