"""The pure parts of ``benchmarks/ttft_bound.py``: bound arithmetic, the step profile's call
paths and buckets, and the off-home key gather it led to (``PageLayout.token_keys``).

No engine and no wall-clock thresholds: timings here are synthetic numbers, so the tests say
whether the arithmetic and the bookkeeping are right, never whether a machine is fast.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

from minipic.bench import ttft_bound as tb
from minipic.engine_ext.attention.cpu_kv_layout import PageLayout, _permutation
from minipic.engine_ext.profiling import step_profile
from minipic.engine_ext.profiling.step_profile import (
    Event,
    exclusive_by_path,
    in_window,
    inclusive_by_path,
)

pytestmark = pytest.mark.fast


def _sample(minipic: float, uncached: float, full: float | None = None,
            ideal: float | None = None, repeat: float | None = None) -> dict[str, float]:
    row = {"minipic_s": minipic, "stock_uncached_s": uncached, "prompt_tokens": 8000,
           "cached_tokens": 7980}
    if full is not None:
        row.update(stock_full_s=full, stock_ideal_s=ideal, repeat_s=repeat)
    return row


def test_bound_is_full_over_uncached_and_ratio_needs_no_full_prefill() -> None:
    """speedup / bound = stock_uncached / minipic: the long stock prefill cancels out."""
    samples = [_sample(0.2, 0.1, 30.0, 0.15, 0.12), _sample(0.4, 0.1),
               _sample(0.25, 0.08, 32.0, 0.16, 0.13)]
    p = tb.point_summary(8192, samples)
    assert p["stock_full_s_p50"] == pytest.approx(31.0)  # median of the two full runs only
    assert p["minipic_s_p50"] == pytest.approx(0.25)
    assert p["stock_uncached_s_p50"] == pytest.approx(0.1)
    assert p["bound"] == pytest.approx(31.0 / 0.1)
    assert p["speedup"] == pytest.approx(31.0 / 0.25)
    assert p["speedup_over_bound"] == pytest.approx(0.1 / 0.25)
    assert p["ideal_over_bound"] == pytest.approx(0.1 / 0.155)
    assert p["uncached_tokens"] == 20
    assert p["stock_full_runs"] == 2
    assert p["gap_ms"] == pytest.approx(150.0)
    assert p["meets_ratio_goal"] is False
    assert p["meets_speedup_goal"] is True  # 124x at 8k


def test_goals_only_judge_the_speedup_at_8k() -> None:
    small = tb.point_summary(2048, [_sample(0.1, 0.095, 6.0, 0.1, 0.1)])
    big = tb.point_summary(8192, [_sample(0.5, 0.1, 30.0, 0.2, 0.2)])
    assert small["meets_speedup_goal"] is None and small["meets_ratio_goal"] is True
    g = tb.goals([small, big])
    assert g["ratio_met"] == {"2048": True, "8192": False}
    assert g["speedup_met"] == {"8192": False}  # 60x


def test_bound_rejects_a_zero_denominator() -> None:
    with pytest.raises(ValueError):
        tb.bound(1.0, 0.0)


def test_spans_for_rounds_spans_up_to_whole_blocks() -> None:
    assert tb.spans_for(8192, 128, 32, 96) == 63  # 63 * 128 + 96 <= 8192
    assert tb.spans_for(2048, 100, 32, 96) == 15  # a 100-token span takes 4 blocks
    assert tb.spans_for(100, 128, 32, 96) == 1


def _ev(path: str, t0: float, t1: float, pid: int = 1) -> Event:
    return Event(pid, path, t0, t1)


def test_exclusive_time_subtracts_direct_children_only() -> None:
    events = [_ev("a", 0, 10), _ev("a/b", 1, 5), _ev("a/b/c", 2, 3), _ev("a/d", 6, 8)]
    inc = inclusive_by_path(events)
    exc = exclusive_by_path(events)
    assert exc == {"a": 4, "a/b": 3, "a/b/c": 1, "a/d": 2}
    assert sum(exc.values()) == inc["a"]


def test_window_clips_and_filters_processes() -> None:
    events = [_ev("x", 0, 10, pid=1), _ev("y", 4, 6, pid=2), _ev("z", 11, 12, pid=1)]
    got = in_window(events, 5, 11, {1})
    assert [(e.path, e.t0, e.t1) for e in got] == [("x", 5, 10)]


def test_breakdown_buckets_a_cached_final_and_leaves_the_rest_to_transport() -> None:
    """A synthetic off-home step: every timed ms lands in one bucket, waits do not count."""
    w = "worker.execute_model"
    f = f"{w}/runner.model_forward"
    layer = f"{f}/attn.layer"
    off = f"{layer}/attn.off_home"
    events = [
        _ev("core.step", 1, 99, pid=10),  # the core waits for the worker inside: info only
        _ev("core.step/sched.schedule", 1, 2, pid=10),
        _ev("core.step/sched.schedule/sched.lookup", 1.2, 1.5, pid=10),
        _ev(w, 3, 95, pid=11),
        _ev(f"{w}/runner.attn_metadata", 3, 5, pid=11),
        _ev(f"{w}/runner.attn_metadata/plan.step_plan", 3.5, 4.5, pid=11),
        _ev(f, 5, 90, pid=11),
        _ev(layer, 10, 60, pid=11),
        _ev(f"{layer}/attn.write", 10, 12, pid=11),
        _ev(off, 12, 60, pid=11),
        _ev(f"{off}/attn.move_keys", 12, 40, pid=11),
        _ev(f"{off}/attn.move_keys/attn.gather_keys", 12, 30, pid=11),
        _ev(f"{off}/attn.move_keys/attn.rotate", 30, 32, pid=11),
        _ev(f"{off}/attn.shadow_pages", 40, 45, pid=11),
        _ev(f"{off}/attn.kernel", 45, 58, pid=11),
        _ev(f"{f}/attn.rotate", 62, 63, pid=11),  # RoPE on queries: part of the model
        _ev("frontend.process_outputs", 99, 99.5, pid=12),
    ]
    got = tb.breakdown(events, 0.0, 100.0, {10, 11, 12})
    b = got["buckets_ms"]
    ms = 1e3
    assert got["ttft_ms"] == pytest.approx(100 * ms)
    assert got["engine_steps"] == 1
    # + move_keys' own
    assert b["off-home fill: gather / scatter key pages"] == pytest.approx((18 + 8) * ms)
    assert b["off-home fill: rotate keys"] == pytest.approx(2 * ms)
    assert b["off-home fill: shadow pages (map / give back)"] == pytest.approx(5 * ms)
    assert b["off-home attention kernel"] == pytest.approx(13 * ms)
    assert b["off-home fill: copies (home blocks, private scratch)"] == pytest.approx(2 * ms)
    assert b["KV write (incl. RoPE at write)"] == pytest.approx(2 * ms)
    assert b["model compute outside attention"] == pytest.approx(35 * ms)  # 85 - 50, query RoPE
    assert b["step planning (plan_step)"] == pytest.approx(1 * ms)
    assert b["attention metadata, other"] == pytest.approx(1 * ms)
    assert b["worker execute_model, other"] == pytest.approx(5 * ms)
    assert b["scheduling: lookup (incl. past misses)"] == pytest.approx(0.3 * ms)
    assert b["scheduling: other"] == pytest.approx(0.7 * ms)
    timed = 92 + 1  # the worker's 92 ms and the scheduler's 1 ms
    assert b[tb.REST] == pytest.approx((100 - timed) * ms)
    assert sum(b.values()) == pytest.approx(got["ttft_ms"])
    assert got["info_ms"]["core.step"] == pytest.approx(97 * ms)
    assert got["info_ms"]["frontend.process_outputs"] == pytest.approx(0.5 * ms)


def test_median_breakdown_is_bucketwise() -> None:
    rows = [{"ttft_ms": t, "engine_steps": 1, "buckets_ms": {"a": a}, "info_ms": {}}
            for t, a in ((10, 1), (30, 3), (20, 9))]
    m = tb.median_breakdown(rows)
    assert m["ttft_ms"] == 20 and m["buckets_ms"] == {"a": 3} and m["requests"] == 3


def test_profile_wraps_functions_and_static_methods_and_records_nested_paths(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step_profile, "_STATE", {"installed": False, "writer": None})
    mod = types.ModuleType("_minipic_profile_probe")

    def inner(x: int) -> int:
        return x + 1

    def outer(x: int) -> int:
        return mod.inner(x) * 2  # looked up at call time, like the backend's helpers

    class Box:
        @staticmethod
        def helper(x: int) -> int:
            return mod.outer(x)

    mod.inner, mod.outer, mod.Box = inner, outer, Box
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    targets = (("t.inner", f"{mod.__name__}:inner"), ("t.outer", f"{mod.__name__}:outer"),
               ("t.helper", f"{mod.__name__}:Box.helper"), ("t.gone", f"{mod.__name__}:nope"))
    skipped = step_profile.install(tmp_path, targets, plugin_on=True)
    assert skipped == [f"{mod.__name__}:nope"]
    assert Box.helper(3) == 8 and Box().helper(1) == 4  # still a static method
    assert step_profile.install(tmp_path, targets) == []  # idempotent
    step_profile.flush()  # (a background thread would write them within FLUSH_INTERVAL_S)
    headers, events = step_profile.read_events(tmp_path)
    paths = ["t.helper", "t.helper/t.outer", "t.helper/t.outer/t.inner"]
    assert [e.path for e in events] == paths * 2
    (header,) = headers.values()
    assert header["skipped"] == [f"{mod.__name__}:nope"] and header["plugin"] is True
    assert all(e.t0 <= e.t1 for e in events)


def _layout(page_holds: torch.Tensor, bs: int, d: int) -> PageLayout:
    key = _permutation(page_holds, "key")
    return PageLayout(bs, d, *key, *key)


@pytest.mark.parametrize("kind", ["column_major", "shuffled"])
def test_token_keys_equals_the_layouts_definition(kind: str) -> None:
    """The fast copies (transpose for ``[D, bs]`` pages, one flat gather otherwise) give
    exactly the plain token rows ``plain_keys`` defines, on a strided view of a cache."""
    bs, d, heads, blocks_total = 8, 4, 3, 10
    cells = bs * d
    if kind == "column_major":  # page cell d*bs + t holds key (t, d)
        p = torch.arange(cells)
        holds = (p % bs) * d + p // bs
    else:
        holds = torch.randperm(cells, generator=torch.Generator().manual_seed(0))
    layout = _layout(holds, bs, d)
    assert layout.column_major_keys() is (kind == "column_major")
    kv = torch.randn(blocks_total, heads, 2 * bs, d)
    key_cache, _ = kv.chunk(2, dim=2)  # keys then values per head, as the backend views it
    assert not key_cache.is_contiguous()
    blocks = torch.tensor([7, 2, 2, 9])
    want = layout.plain_keys(key_cache[blocks]).transpose(1, 2).reshape(-1, heads * d)
    got = layout.token_keys(key_cache, blocks)
    assert torch.equal(got, want) and got.is_contiguous()
    # one block: still dense rows (vLLM's rotary op and writer need them)
    one = layout.token_keys(key_cache, blocks[:1])
    assert torch.equal(one, want[:bs]) and one.is_contiguous()
    assert layout.token_keys(key_cache, blocks[:0]).shape == (0, heads * d)
