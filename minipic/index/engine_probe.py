"""What ``minipic index`` asks of the engine besides prefills: its store's counters, and when a
batch's blocks are on disk (through a worker extension in this process, or by watching the store
directory of a server).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minipic.span_contract.engine_utilities import INDEX_FLUSH_RPC, SPAN_STORE_STATS_UTILITY

if TYPE_CHECKING:
    from minipic.orchestrator import Orchestrator

DURABLE_TIMEOUT_S = 120.0


class IndexWorkerExtension:
    """Mixed into the index engine's worker (vLLM's ``worker_extension_cls``, an extension
    point): lets the index wait until the worker's span store has written what it was given.

    Why: the store writes off the engine's step (a background writer per tier); a manifest line
    written before its blocks are on disk would make a rerun skip a document the store lost.
    """

    def minipic_index_flush(self, timeout_s: float) -> dict[str, Any]:  # INDEX_FLUSH_RPC
        from minipic.engine_ext.span_store.worker_side import flush_worker_store

        return flush_worker_store(timeout_s)


class Probe:
    """What the index asks of the engine besides prefills: its store counters, and when a
    batch's blocks are on disk."""

    fingerprint: str = ""

    async def counts(self) -> dict[str, int]:
        raise NotImplementedError

    async def durable(self, new_blocks: int) -> str | None:
        """Wait until the batch's saves are on disk; None, or why they may not be."""
        raise NotImplementedError


class EmbeddedProbe(Probe):
    def __init__(self, orc: Orchestrator) -> None:
        self.backend: Any = orc.backend  # not the engine: close() must be able to free it
        self.last: dict[str, Any] = {}

    @property
    def engine(self) -> Any:
        return self.backend.engine

    async def stats(self) -> dict[str, Any]:
        stats = await self.engine.engine_core.call_utility_async(SPAN_STORE_STATS_UTILITY)
        if not stats:
            raise RuntimeError("the engine runs no span store")
        self.fingerprint = str(stats["fingerprint"])
        return stats

    async def counts(self) -> dict[str, int]:
        return dict((await self.stats())["counts"])

    async def durable(self, new_blocks: int) -> str | None:
        (flushed,) = await self.engine.collective_rpc(INDEX_FLUSH_RPC, args=(DURABLE_TIMEOUT_S,))
        before, self.last = self.last, flushed
        if flushed.get("tiers", 1) == 0:
            return ("the store's writes are off: it has no usable directory (its secret could "
                    "not be read or created, or the weights are unknown; see the engine log)")
        if not flushed.get("writes_enabled", True):
            return ("the store's writes are off for now: paused after a full, read-only or "
                    "forbidden disk (see the engine log)")
        if flushed.get("pending_writes", 0):
            return f"{flushed['pending_writes']} writes still pending after {DURABLE_TIMEOUT_S} s"
        for key in ("skipped_queue_full", "write_errors", "writer_errors"):
            if flushed.get(key, 0) > before.get(key, 0):
                return f"the store dropped writes ({key})"
        return None


class HttpProbe(Probe):
    def __init__(self, orc: Orchestrator, store_dir: Path) -> None:
        self.base_url = orc.backend.base_url  # type: ignore[attr-defined]
        # the server's API key, when the client has one: /minipic/config asks for it too
        self.headers = dict(getattr(orc.backend, "_headers", None) or {})
        self.store_dir = store_dir
        self.entries = store_usage(store_dir)[0]

    async def stats(self) -> dict[str, Any]:
        import httpx

        from minipic.orchestrator.http_backend import CONFIG_PATH

        async with httpx.AsyncClient(base_url=self.base_url, timeout=30,
                                     headers=self.headers) as client:
            reply = await client.get(CONFIG_PATH)
        reply.raise_for_status()
        stats = reply.json().get("span_store")
        if not stats:
            raise RuntimeError(f"{self.base_url} runs no span store (minipic serve "
                               "--span-store DIR)")
        self.fingerprint = str(stats["fingerprint"])
        return stats

    async def counts(self) -> dict[str, int]:
        return dict((await self.stats())["counts"])

    async def durable(self, new_blocks: int) -> str | None:
        want = self.entries + new_blocks
        deadline = time.monotonic() + DURABLE_TIMEOUT_S
        while True:
            now = (await asyncio.to_thread(store_usage, self.store_dir))[0]
            if now >= want:
                self.entries = now
                return None
            if time.monotonic() > deadline:
                self.entries = now
                return (f"{want - now} of {new_blocks} saved blocks not in {self.store_dir} "
                        f"after {DURABLE_TIMEOUT_S} s (another store directory, or evicted?)")
            await asyncio.sleep(0.01)


def store_usage(store_dir: Path) -> tuple[int, int]:
    """``(entries, bytes)`` of the span-store entry files in a directory (temp files and the
    manifest excluded; not verified)."""
    from minipic.engine_ext.span_store.tiers.format import SUFFIX, TEMP_PREFIX

    entries = size = 0
    try:
        shards = list(os.scandir(store_dir))
    except OSError:
        return 0, 0
    for shard in shards:
        if shard.name.startswith(".") or not shard.is_dir(follow_symlinks=False):
            continue
        try:
            items = list(os.scandir(shard.path))
        except OSError:
            continue
        for item in items:
            if item.name.endswith(SUFFIX) and not item.name.startswith(TEMP_PREFIX):
                try:
                    size += item.stat(follow_symlinks=False).st_size
                except OSError:
                    continue
                entries += 1
    return entries, size


def block_payload_bytes(store_dir: Path) -> int | None:
    """KV bytes of one stored block (an entry's payload length, from its header)."""
    from minipic.engine_ext.span_store.tiers.format import SUFFIX, payload_length

    for shard in sorted(store_dir.glob("??")):
        for path in shard.glob(f"*{SUFFIX}"):
            length = payload_length(path)
            if length is not None:
                return length
    return None
