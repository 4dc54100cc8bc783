"""The blocks of a span request's kept copy, reserved with the request on vLLM's own
``KVCacheManager`` (``engine_ext/attention/kept_reservation.py``): admission counts them,
they go back with the request, and a plain request or a span prefill is untouched.

The wrappers are applied to a private manager here (not installed on vLLM's class), with random
sizes from the test's seed; the engine side (a real engine's worker reading the copy from the
blocks, freed on abort) is ``tests/engine/test_first_visit.py``.
"""

from __future__ import annotations

import inspect
import random
from typing import Any

import pytest
import torch

from minipic.engine_ext.attention import kept_reservation
from minipic.engine_ext.vllm_surface.added_names import KEPT_BLOCKS_ATTR, KEPT_PAGES_ATTR

pytestmark = pytest.mark.fast

BLOCK = 16


class Manager:
    """A real ``KVCacheManager`` of ``num_blocks`` blocks, called through the wrappers."""

    def __init__(self, num_blocks: int) -> None:
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8,
                                 dtype=torch.float32)
        config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                               kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
        self.kvm = KVCacheManager(config, max_model_len=4096, scheduler_block_size=BLOCK,
                                  hash_block_size=BLOCK, enable_caching=False)
        # vLLM's own methods, whether or not an engine of this process installed the plugin
        self._allocate = kept_reservation._wrap_allocate_slots(
            inspect.unwrap(KVCacheManager.allocate_slots))
        self._free = kept_reservation._wrap_free(inspect.unwrap(KVCacheManager.free))

    def allocate(self, request: Any, tokens: int) -> Any:
        return self._allocate(self.kvm, request, tokens)

    def free(self, request: Any) -> None:
        self._free(self.kvm, request)

    @property
    def free_blocks(self) -> int:
        return self.kvm.block_pool.get_num_free_blocks()


def request(rid: str, prompt: int, *, opted: bool = True, max_tokens: int = 16) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from minipic.span_contract.span_config import SPANS_OPT_IN_KEY

    params = SamplingParams(max_tokens=max_tokens,
                            extra_args={SPANS_OPT_IN_KEY: True} if opted else None)
    params.update_from_generation_config({}, None)
    return Request(rid, list(range(100, 100 + prompt)), params, None)


def copy_blocks(req: Any) -> int:
    return sum(len(b) for b in req.__dict__.get(KEPT_BLOCKS_ATTR, {}).values())


def test_a_decoding_span_request_holds_its_copy_and_gives_it_back(seed: int) -> None:
    """Chunked over several steps, then decoding: the copy's blocks come with the step that
    reaches the prompt's end (not before), grow with the request, are in no table, and go back
    with the request's own blocks."""
    rng = random.Random(seed)
    m = Manager(rng.randrange(64, 200))
    start = m.free_blocks
    prompt = rng.randrange(3 * BLOCK, 12 * BLOCK)
    req = request("a", prompt)
    cut = rng.randrange(1, prompt)
    assert m.allocate(req, cut) is not None
    assert copy_blocks(req) == 0, f"a prompt chunk before the end got a copy (seed={seed})"
    req.num_computed_tokens = cut
    assert m.allocate(req, prompt - cut) is not None
    assert copy_blocks(req) == -(-prompt // BLOCK), f"seed={seed}"
    own = m.kvm.get_block_ids("a")[0]
    copies = [b.block_id for b in req.__dict__[KEPT_BLOCKS_ATTR][0]]
    assert not set(own) & set(copies), f"a copy block is in the request's table (seed={seed})"
    req.num_computed_tokens = prompt
    for _ in range(2 * BLOCK):  # decode, one token a step
        req.append_output_token_ids(7)
        assert m.allocate(req, 1) is not None
        req.num_computed_tokens += 1
    assert copy_blocks(req) == -(-(prompt + 2 * BLOCK) // BLOCK), f"seed={seed}"
    assert start - m.free_blocks == len(m.kvm.get_block_ids("a")[0]) + copy_blocks(req)
    m.free(req)
    assert m.free_blocks == start, f"blocks stayed taken after the request left (seed={seed})"
    assert KEPT_BLOCKS_ATTR not in req.__dict__


def test_admission_counts_the_copy(seed: int) -> None:
    """A span request that decodes fits only where its blocks and its copy's fit: vLLM gets
    None (so it waits or preempts) and nothing is taken; a plain request of the same size, or a
    span prefill (one token out), still fits."""
    rng = random.Random(seed)
    prompt_blocks = rng.randrange(4, 12)
    prompt = prompt_blocks * BLOCK - rng.randrange(0, BLOCK)
    # room for the prompt and half its copy, beside another request holding the rest
    m = Manager(3 * prompt_blocks + 1)  # and vLLM's null block
    held = (prompt_blocks + prompt_blocks // 2) * BLOCK
    other = request("other", held, opted=False)
    assert m.allocate(other, held) is not None
    assert prompt_blocks <= m.free_blocks < 2 * prompt_blocks
    before = m.free_blocks
    span = request("span", prompt)
    assert m.allocate(span, prompt) is None, f"admitted without room for its copy ({seed})"
    assert m.free_blocks == before and copy_blocks(span) == 0
    plain = request("plain", prompt, opted=False)
    assert m.allocate(plain, prompt) is not None and copy_blocks(plain) == 0
    m.free(plain)
    prefill = request("prefill", prompt, max_tokens=1)
    assert m.allocate(prefill, prompt) is not None and copy_blocks(prefill) == 0
    m.free(prefill)
    m.free(other)  # room again: the span request is admitted with its copy
    assert m.allocate(span, prompt) is not None
    assert copy_blocks(span) == -(-prompt // BLOCK), f"seed={seed}"


def test_a_request_too_long_to_fit_twice_runs_without_a_copy(seed: int) -> None:
    """The copy is a speed-up, never a condition: a request that could not fit the cache with
    its copy even alone is admitted without one (its steps build a copy each)."""
    rng = random.Random(seed)
    blocks = rng.randrange(8, 40)
    m = Manager(blocks + 1)
    req = request("long", (blocks - 1) * BLOCK - rng.randrange(0, BLOCK))
    assert m.allocate(req, req.num_prompt_tokens) is not None
    assert copy_blocks(req) == 0, f"seed={seed}"


def test_the_step_hands_each_scheduled_requests_blocks_to_the_worker(seed: int) -> None:
    """``_update_after_schedule`` puts every scheduled request's copy blocks on the scheduler
    output, per KV-cache group; the worker's pools read their group's."""
    import types

    from minipic.engine_ext.attention import kept_pool

    rng = random.Random(seed)
    m = Manager(128)
    reqs = [request(f"r{i}", rng.randrange(BLOCK, 4 * BLOCK)) for i in range(3)]
    for req in reqs:
        assert m.allocate(req, req.num_prompt_tokens) is not None
    plain = request("p", 20, opted=False)
    assert m.allocate(plain, 20) is not None
    scheduler = types.SimpleNamespace(requests={r.request_id: r for r in [*reqs, plain]})
    output = types.SimpleNamespace(num_scheduled_tokens={"r0": 1, "r2": 1, "p": 1})
    seen = []
    kept_reservation._wrap_update_after_schedule(lambda s, o: seen.append(o))(scheduler, output)
    pages = getattr(output, KEPT_PAGES_ATTR)
    assert seen == [output] and set(pages) == {"r0", "r2"}
    for rid in pages:
        want = [b.block_id for b in scheduler.requests[rid].__dict__[KEPT_BLOCKS_ATTR][0]]
        assert pages[rid] == (want,)
    try:
        kept_pool.set_step_reservations(pages, [["layer.0"]])
        pool = kept_pool.KeptPool(["layer.0"], BLOCK)
        assert pool.reservations() == {rid: pages[rid][0] for rid in pages}
        assert kept_pool.KeptPool(["layer.9"], BLOCK).reservations() == {}
    finally:
        kept_pool.set_step_reservations({}, [])
