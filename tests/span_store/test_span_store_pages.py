"""The span store's page copies, on CPU tensors: the format the GPU path shares.

``engine_ext/span_store/worker_side.PageCopier`` moves whole blocks (every layer's page) between
a worker's KV caches and the store with plain tensor copies (``.cpu()`` out, ``copy_`` in), so
the same code serves CUDA caches: only the device of the tensors differs. Here on CPU tensors
shaped like vLLM's pages: a saved block loads back byte for byte into another block, with its
home slot; an entry that does not fit this engine's pages (other page size, layer count, dtype)
is a miss, never a partial copy.
"""

from __future__ import annotations

import pytest
import torch

from minipic.engine_ext.span_store.tiers import Entry, RamTier, TieredStore
from minipic.engine_ext.span_store.worker_side import PageCopier

pytestmark = pytest.mark.fast


def _caches(layers: int, dtype: torch.dtype, seed: int, heads: int = 2, block: int = 32,
            head: int = 16) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(
        8, heads, block, 2 * head, generator=gen).to(dtype) for i in range(layers)}


def _copier(caches: dict[str, torch.Tensor]) -> PageCopier:
    copier = PageCopier(TieredStore(RamTier(64 << 20), []), Entry)
    copier.register(caches)
    return copier


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_block_round_trips_with_its_home(dtype: torch.dtype, seed: int) -> None:
    caches = _caches(3, dtype, seed)
    copier = _copier(caches)
    assert copier.save(3, "k" * 40, slot=7)
    before = {name: cache[5].clone() for name, cache in caches.items()}
    source, home = copier.load(5, "k" * 40)
    assert (source, home) == ("ram", 7)  # no metadata builder here: the slot is the home
    for name, cache in caches.items():
        assert torch.equal(cache[5], cache[3]), name
        assert not torch.equal(cache[5], before[name]), name
    assert copier.load(6, "z" * 40) is None  # not in the store: a miss


def test_entry_from_other_pages_is_a_miss(seed: int) -> None:
    store = TieredStore(RamTier(64 << 20), [])
    writer = PageCopier(store, Entry)
    writer.register(_caches(2, torch.float32, seed))
    assert writer.save(1, "a" * 40, slot=0)
    for other in (_caches(3, torch.float32, seed), _caches(2, torch.float32, seed, head=32),
                  _caches(2, torch.bfloat16, seed)):
        reader = PageCopier(store, Entry)
        reader.register(other)
        target = next(iter(other.values()))[4].clone()
        assert reader.load(4, "a" * 40) is None
        assert torch.equal(next(iter(other.values()))[4], target), "a miss writes nothing"
