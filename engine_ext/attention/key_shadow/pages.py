"""A layer's key shadow: pages shaped like its KV cache, holding keys moved to another slot.

The position-free CPU backend (``engine_ext/attention/cpu_backend.py``) attends a request that
reads blocks off their home slot with keys from here and values from the KV cache itself: vLLM's
C++ kernel takes the key and value tensors separately and indexes both with one block table
and one set of strides (measured: a key tensor with other strides gives wrong results), so
the shadow has exactly the cache's shape and the page of block ``b`` sits at index ``b``.

**Why address space, not a tensor.** A shadow as large as the cache would double KV memory if
it were committed. It is an anonymous private mapping (``MAP_NORESERVE`` on Linux): the kernel
commits memory only for the pages written (keys of the blocks read off home; the shadow's value
halves are never touched), and :meth:`KeyShadow.release` gives a block's pages back with
``madvise(MADV_DONTNEED)``, after which they read as zeros. Which blocks hold a page, and the cap
on how many may, is the pool's index (``engine_ext/attention/key_shadow/pool.py``), shared by all
layers of a KV-cache group.
"""

from __future__ import annotations

import math
import mmap
import sys

import torch

# Linux: reserve no swap for the mapping (only written pages are ever committed); not exposed
# by Python's mmap module.
_MAP_NORESERVE = 0x4000 if sys.platform.startswith("linux") else 0


class KeyShadow:
    """Zero-initialised pages ``[num_blocks, kv_heads, 2 * block_size, head_size]``, lazily
    committed; :attr:`keys` is the key half, with the same strides as the cache's."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.shape = tuple(shape)
        self.dtype = dtype
        self.nbytes = math.prod(self.shape) * torch.empty(0, dtype=dtype).element_size()
        self.block_bytes = self.nbytes // max(self.shape[0], 1)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        self._map = mmap.mmap(-1, max(self.nbytes, 1), flags=flags)
        pages = torch.frombuffer(self._map, dtype=torch.uint8, count=self.nbytes)
        self.pages = pages.view(self.dtype).view(self.shape)
        self.keys = self.pages.chunk(2, dim=2)[0]

    def matches(self, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        """Whether this shadow fits a cache of ``shape`` (a rebuilt cache needs a new shadow)."""
        return tuple(shape) == self.shape and dtype == self.dtype

    def release(self, blocks: list[int]) -> None:
        """Give the pages of ``blocks`` back to the OS (they read as zeros afterwards).

        Only whole OS pages inside each block's range are dropped, so a neighbour's data is
        never lost; consecutive blocks are released in one call.
        """
        for start, stop in _runs(sorted(blocks)):
            self._drop(start * self.block_bytes, stop * self.block_bytes)

    def release_all(self) -> None:
        self._drop(0, self.nbytes)

    def _drop(self, begin: int, end: int) -> None:
        page = mmap.PAGESIZE
        begin = -(-begin // page) * page
        end = end // page * page
        if end > begin:
            self._map.madvise(mmap.MADV_DONTNEED, begin, end - begin)


def _runs(blocks: list[int]) -> list[tuple[int, int]]:
    """``[start, stop)`` runs of consecutive ids in a sorted list."""
    runs: list[tuple[int, int]] = []
    for block in blocks:
        if runs and runs[-1][1] == block:
            runs[-1] = (runs[-1][0], block + 1)
        else:
            runs.append((block, block + 1))
    return runs
