"""vLLM 0.33 readiness, without installing it (``engine_ext/vllm_surface/patch_sources.py``).

* The patch table's per-version rows match vLLM 0.33.0's own sources (its PyPI sdist, pinned by
  sha256, read with :mod:`ast`), and the reader agrees with ``inspect`` on the installed 0.32.
* Each wrapper takes 0.33's parameter lists: the hasher factory's ``num_hash_lookahead_tokens``
  (0 works, > 0 is refused), the lookup's ``max_cache_hit_length`` (honoured past misses, on a
  real ``KVCacheManager`` of the installed vLLM).
* A 0.33 install is refused unless allowed: its signatures are only statically checked.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Any

import pytest

from minipic.engine_ext.vllm_surface import patches
from minipic.engine_ext.vllm_surface.added_names import CACHED_RUNS_ATTR
from minipic.engine_ext.vllm_surface.patch_sources import VllmSources, differences
from minipic.span_contract.errors import EngineIntegrationError
from minipic.span_contract.span_config import SPANS_OPT_IN_KEY, SpanConfig
from tests.support.vllm_upstream import fetch

pytestmark = pytest.mark.fast

BLOCK = 16
CONFIG = SpanConfig(block_size=BLOCK, ssep_id=5, pdep_id=11, pad_id=16)


@pytest.fixture(scope="module")
def next_sources() -> VllmSources:
    from minipic.span_contract.models import cache_root

    return VllmSources(fetch.next_sources(cache_root()))


def test_table_matches_vllm_033_sources(next_sources: VllmSources) -> None:
    assert next_sources.version == fetch.NEXT_VERSION == "0.33.0"
    assert patches.VLLM_VERSIONS[fetch.NEXT_VERSION] == "static"
    assert differences(next_sources) == []
    # the rows that changed in 0.33 are recorded as changed (the check above is not vacuous)
    changed = {p.target for p in patches.PATCH_POINTS if p.params_for("0.33.0") != p.params}
    assert {t.rsplit(":", 1)[1] for t in changed} == {
        "get_request_block_hasher", "KVCacheManager.get_computed_blocks"}
    assert next_sources.params("vllm.v1.engine.core:get_request_block_hasher")[-1] == (
        "num_hash_lookahead_tokens")


def test_source_reader_agrees_with_inspect_on_the_installed_vllm() -> None:
    import inspect

    import vllm

    installed = VllmSources(Path(vllm.__file__).parents[1])
    assert installed.version == vllm.__version__.split("+")[0]
    assert differences(installed) == []
    for point in patches.PATCH_POINTS:
        if point.kind == "adds":  # minipic's own methods: checked absent from vLLM above
            continue
        # vLLM's own code, also where an engine of this process installed the wrappers
        current = patches.stock(point.target)
        assert installed.params(point.target) == tuple(inspect.signature(current).parameters)


def test_a_row_that_moved_is_reported(next_sources: VllmSources, monkeypatch) -> None:
    """The static check fails when a row is not updated for the new version."""
    rows = tuple(p if "get_computed_blocks" not in p.target
                 else patches.PatchPoint(p.feature, p.target, p.params, p.why, p.platform)
                 for p in patches.PATCH_POINTS)
    monkeypatch.setattr(patches, "PATCH_POINTS", rows)
    found = differences(next_sources)
    assert len(found) == 2 and all("max_cache_hit_length" in line for line in found), found
    with pytest.raises(LookupError, match="does not exist"):
        next_sources.params("vllm.v1.core.kv_cache_manager:KVCacheManager.no_such_method")


def test_static_version_needs_the_allow_switch(monkeypatch) -> None:
    monkeypatch.delenv(patches.ALLOW_VERSION_ENV, raising=False)
    found = patches.problems("hash", vllm_version="0.33.0")
    assert any("checked statically" in p and f"{patches.ALLOW_VERSION_ENV}=0.33.0" in p
               for p in found), found
    # and, allowed, the installed 0.32 signatures are then compared with 0.33's rows
    monkeypatch.setenv(patches.ALLOW_VERSION_ENV, "0.33.0")
    found = patches.problems("hash", vllm_version="0.33.0")
    assert found and all("num_hash_lookahead_tokens" in p for p in found), found
    assert patches.problems("hash") == []  # the installed version, its own rows


# -- wrappers with 0.33's parameter lists ------------------------------------------------------


def _sha(obj: Any) -> bytes:
    return hashlib.sha256(repr(obj).encode()).digest()


def test_hasher_factory_takes_the_lookahead_and_refuses_it(monkeypatch) -> None:
    import types

    from minipic.engine_ext.hashing import span_hashing

    fake_config = types.SimpleNamespace(
        additional_config={}, model_config=types.SimpleNamespace(enforce_eager=True,
                                                                 is_hybrid=False),
        cache_config=types.SimpleNamespace(block_size=BLOCK))
    monkeypatch.setitem(span_hashing._ENGINE, "vllm_config", fake_config)
    wrapped = span_hashing.hasher_factory(CONFIG)(lambda *a: None)
    assert callable(wrapped(BLOCK, _sha, 0))  # EngineCore 0.33 passes it by position
    assert callable(wrapped(BLOCK, _sha))  # 0.32
    with pytest.raises(EngineIntegrationError, match="disable_lookahead_block_hashes"):
        wrapped(BLOCK, _sha, 1)


def _manager() -> Any:
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    return KVCacheManager(config, max_model_len=1024, scheduler_block_size=BLOCK,
                          hash_block_size=BLOCK)


def _request(rid: str, tokens: list[int]) -> Any:
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.request import Request

    from minipic.engine_ext.hashing.span_hashing import make_span_block_hasher

    init_none_hash(_sha)
    params = SamplingParams(max_tokens=1, extra_args={SPANS_OPT_IN_KEY: True})
    params.update_from_generation_config({}, None)
    return Request(rid, tokens, params, None,
                   block_hasher=make_span_block_hasher(BLOCK, _sha, CONFIG))


def _span(rng: random.Random) -> list[int]:
    return [CONFIG.ssep_id] + [rng.randrange(100, 30_000) for _ in range(BLOCK - 1)]


def test_lookup_honours_max_cache_hit_length_past_misses(seed: int) -> None:
    """The 0.33 lookup bound holds for the blocks attached after a miss too: a real
    ``KVCacheManager``; the stock 0.32 lookup stands in for 0.33's, bound applied as 0.33 does."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from minipic.engine_ext.holes import scheduler_lookup as hole_lookup

    rng = random.Random(seed)
    span_b = _span(rng)
    tail = [CONFIG.pdep_id] + [rng.randrange(100, 30_000) for _ in range(BLOCK + 3)]
    kvm = _manager()
    first = _request("warm", _span(rng) + span_b + tail)
    kvm.get_computed_blocks(first)
    assert kvm.allocate_slots(first, first.num_tokens) is not None  # computes and caches
    kvm.free(first)

    # vLLM's lookup, also where an engine of this process installed minipic's around it
    stock_032 = patches.stock(f"{KVCacheManager.__module__}:KVCacheManager.get_computed_blocks")

    def stock_033(self: Any, request: Any, max_cache_hit_length: int | None = None) -> Any:
        blocks, hit, boundary = stock_032(self, request)
        assert max_cache_hit_length is None or hit <= max_cache_hit_length
        return blocks, hit, boundary

    lookup = hole_lookup._wrap_get_computed_blocks(stock_033)
    # another first span (a miss), then span B, which is cached: a run past the miss
    for bound, expect_run in ((None, True), (2 * BLOCK, True), (2 * BLOCK - 1, False),
                              (BLOCK, False)):
        second = _request(f"probe-{bound}", _span(rng) + span_b + tail)
        kwargs = {} if bound is None else {"max_cache_hit_length": bound}
        blocks, hit, _ = lookup(kvm, second, **kwargs)
        assert hit == 0  # the leading block missed
        pending = second.__dict__.get(CACHED_RUNS_ATTR)
        runs = pending.runs if pending else []
        assert bool(runs) == expect_run, (bound, runs)
        if runs:
            assert runs[0][0] == 1 and len(runs[0][1]) == 1
        kvm.free(second)  # unpins the runs it found
    positional = _request("positional", _span(rng) + span_b + tail)
    lookup(kvm, positional, BLOCK)  # 0.33's scheduler may pass it by position
    assert CACHED_RUNS_ATTR not in positional.__dict__
    kvm.free(positional)
