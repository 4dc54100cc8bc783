"""Store reads ahead of the step (``engine_ext/span_store/fill_queue.py``), on a real
``TieredStore`` over a real ``DirTier``: reads land in asking order within the per-step byte
cap, a slow read past its deadline is given up (a miss), and ``threads=0`` reads at once."""

from __future__ import annotations

import random
import threading

import pytest

from minipic.engine_ext.span_store.fill_queue import FillQueue
from minipic.engine_ext.span_store.tiers import DirTier, Entry, TieredStore

pytestmark = pytest.mark.fast


class SlowTier(DirTier):
    """A real DirTier whose reads wait for ``gate`` (a slow disk, made deterministic)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()

    def get(self, key: str):
        self.gate.wait(30)
        return super().get(key)


@pytest.fixture
def stored(tmp_path, seed):
    rng = random.Random(seed)
    tier = SlowTier(tmp_path, 1 << 26, "fp")
    entries = {rng.randbytes(32).hex(): Entry(rng.randbytes(rng.randrange(1000, 5000)), {"i": i})
               for i in range(12)}
    for key, entry in entries.items():
        assert tier.put(key, entry)
    store = TieredStore(None, [tier])
    yield tier, store, entries
    store.close()


def test_reads_land_in_order_within_the_step_cap(stored) -> None:
    tier, store, entries = stored
    keys = list(entries)
    cap = sum(len(entries[k].payload) for k in keys[:3])  # about three entries a step
    fills = FillQueue(store, threads=4, step_bytes=cap, wait_s=5.0)
    fills.submit(list(enumerate(keys)))
    landed: list[int] = []
    for _ in range(20):
        step = fills.ready()
        assert sum(len(f[0].payload) for _, _, f in step if f) <= cap or len(step) == 1
        for block_id, key, found in step:
            assert found == (entries[key], "disk") and keys[block_id] == key
            landed.append(block_id)
        if not fills:
            break
    assert sorted(landed) == list(range(len(keys))) and len(fills) == 0
    fills.close()


def test_a_read_past_its_deadline_is_a_miss_and_its_late_result_is_dropped(stored) -> None:
    tier, store, entries = stored
    keys = list(entries)
    fills = FillQueue(store, threads=2, deadline_s=0.2, wait_s=0.0)
    tier.gate.clear()  # the disk hangs
    fills.submit([(7, keys[0])])
    assert fills.ready() == []  # still reading, not yet late
    deadline = threading.Event()
    deadline.wait(0.3)
    assert fills.ready() == [(7, keys[0], None)] and fills.timed_out == 1
    tier.gate.set()
    fills.submit([(8, keys[1])])
    fills.wait_s = 5.0
    assert fills.ready() == [(8, keys[1], (entries[keys[1]], "disk"))]  # 7 never reappears
    fills.close()


def test_without_threads_reads_at_once(stored) -> None:
    _, store, entries = stored
    keys = list(entries)
    fills = FillQueue(store, threads=0)
    fills.submit([(1, keys[0]), (2, "0" * 64)])
    assert fills.ready() == [(1, keys[0], (entries[keys[0]], "disk")), (2, "0" * 64, None)]
