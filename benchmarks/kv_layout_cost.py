"""Per-layer cost of the CPU backend's KV layout: keys stored once vs a 3-region page.

    python benchmarks/kv_layout_cost.py            # -> results/kv_layout/kv_layout_cost.json

The CPU backend keeps stock KV memory (keys stored once, rotated at home); the alternative it
is held against kept an unrotated copy (region [0]) beside the stock regions and rotated that
copy by the read slot, at more memory per token. Both are timed here side by side, one layer,
SmolLM2-135M shapes (9 query / 3 kv heads, D=64, block 32), fp32 and bf16, one thread:

* ``write``: storing a prefill's keys and values (old: the unrotated copy, then rotate + vLLM's
  writer; new: rotate + vLLM's writer only);
* ``fill``: what N blocks read one slot off home cost before attention (old: gather the
  unrotated keys token by token, the model's rotary op at the new positions, vLLM's writer into
  a pool, values copied beside them; new: the blocks' home key pages moved by the slot
  difference with the same rotary op and a table of offsets, straight into the key shadow,
  values read in place: ``cpu_backend.move_keys``).

Medians of repeated runs; ratios new / old. Pure operator timing (no engine), so it needs no
model download and finishes in well under a minute.

``--engines`` also starts a stock and a minipic engine (SmolLM2, same ``VLLM_CPU_KVCACHE_SPACE``)
one after the other and records the KV blocks vLLM gave each and their bytes per token, next to
what the old 3-region page recorded in ``results/bench/bench.json`` at the same budget.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

HEADS, KV_HEADS, HEAD, BLOCK = 9, 3, 64, 32


def _rope(dtype: torch.dtype) -> Any:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        return get_rope(head_size=HEAD, max_position=8192, is_neox_style=True, dtype=dtype,
                        rope_parameters={"rope_theta": 100000.0})


def _median_ms(fn: Any, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(dtype: torch.dtype, blocks: int, reps: int) -> dict[str, float]:
    """Old vs new write of ``blocks`` blocks and fill of ``blocks`` off-home pool entries."""
    import vllm.v1.attention.backends.cpu_attn as cpu_attn
    from vllm import _custom_ops as ops

    from minipic.engine_ext.attention.cpu_backend import _rotate, move_keys
    from minipic.engine_ext.attention.cpu_kv_layout import probe
    from minipic.engine_ext.attention.step_plan import RotatedFill

    isa = cpu_attn._get_attn_isa(dtype, BLOCK, HEAD)
    rope = _rope(dtype)
    layout = probe(isa, dtype, BLOCK, HEAD)
    gen = torch.Generator().manual_seed(0)
    num_blocks = blocks + 4
    tokens = blocks * BLOCK
    key = torch.randn(tokens, KV_HEADS, HEAD, generator=gen).to(dtype)
    value = torch.randn(tokens, KV_HEADS, HEAD, generator=gen).to(dtype)
    slots = torch.arange(tokens) + 2 * BLOCK  # blocks 2.. at home slots 0..
    positions = torch.arange(tokens)
    old_page = torch.zeros(num_blocks, KV_HEADS, 3, BLOCK, HEAD, dtype=dtype)
    k_unrot, v_old, k_home_old = old_page.unbind(2)
    new_page = torch.zeros(num_blocks, KV_HEADS, 2 * BLOCK, HEAD, dtype=dtype)
    k_home, v_new = new_page.chunk(2, dim=2)
    write_blocks = torch.div(slots, BLOCK, rounding_mode="floor")
    write_offsets = slots % BLOCK

    def write_old() -> None:
        k_unrot[write_blocks, :, write_offsets] = key
        ops.cpu_attn_reshape_and_cache(_rotate(rope, positions, key), value, k_home_old, v_old,
                                       slots, isa)

    def write_new() -> None:
        ops.cpu_attn_reshape_and_cache(_rotate(rope, positions, key), value, k_home, v_new,
                                       slots, isa)

    write_old()
    write_new()
    pool = torch.zeros(blocks, KV_HEADS, 2 * BLOCK, HEAD, dtype=dtype)
    p_key, p_value = pool.chunk(2, dim=2)
    read_blocks = torch.arange(blocks) + 2
    entries = torch.arange(blocks)
    # read one slot later than home: every key moves by one block
    token_blocks = read_blocks.repeat_interleave(BLOCK)
    token_offsets = torch.arange(BLOCK).repeat(blocks)
    token_positions = positions + BLOCK
    token_pool_slots = torch.arange(tokens)
    offsets = torch.full((blocks,), BLOCK)

    def fill_old() -> None:
        keys = _rotate(rope, token_positions, k_unrot[token_blocks, :, token_offsets])
        ops.cpu_attn_reshape_and_cache(keys, keys, p_key, p_value, token_pool_slots, isa)
        p_value[entries] = v_old[read_blocks]

    shadow = torch.zeros(num_blocks, KV_HEADS, 2 * BLOCK, HEAD, dtype=dtype)
    s_key = shadow.chunk(2, dim=2)[0]
    none = torch.zeros(0, dtype=torch.long)
    fill = RotatedFill(copy_blocks=none, copy_dest=none, blocks=read_blocks, offsets=offsets,
                       dest=read_blocks)

    def fill_new() -> None:  # values stay where they are: the kernel reads them from the cache
        move_keys(layout, k_home, fill, rope, s_key)

    fill_old()
    old_keys = p_key.clone()
    fill_new()
    p_key.copy_(s_key[read_blocks])
    # same keys as rotating once, within the fp32 table's own angle error
    # (tests/engine/test_kernels.py) (bf16: rounded twice instead of once, a few units in the last
    # place)
    tol = float(key.abs().max()) * (8192 * 2.0**-23 if dtype == torch.float32 else 2.0**-5)
    torch.testing.assert_close(p_key.float(), old_keys.float(), atol=tol, rtol=0)
    out = {
        "write_old_ms": _median_ms(write_old, reps), "write_new_ms": _median_ms(write_new, reps),
        "fill_old_ms": _median_ms(fill_old, reps), "fill_new_ms": _median_ms(fill_new, reps),
        "page_bytes_old": old_page[0].numel() * old_page.element_size(),
        "page_bytes_new": new_page[0].numel() * new_page.element_size(),
    }
    out["write_new_over_old"] = out["write_new_ms"] / out["write_old_ms"]
    out["fill_new_over_old"] = out["fill_new_ms"] / out["fill_old_ms"]
    out["page_bytes_new_over_old"] = out["page_bytes_new"] / out["page_bytes_old"]
    return out


def engine_blocks() -> dict[str, Any]:
    """KV blocks and bytes per token of a stock and a minipic engine at the same KV budget."""
    from minipic.orchestrator import SyncOrchestrator

    out: dict[str, Any] = {}
    for name, pic in (("stock", False), ("minipic", True)):
        orc = SyncOrchestrator.embedded(pic=pic)
        try:
            backend = orc.aio.backend
            kv = backend.kv_usage.snapshot()
            block = backend.settings.block_size
            out[name] = {"blocks_total": kv.blocks_total, "block_bytes": kv.block_bytes,
                         "bytes_per_token": kv.block_bytes // block,
                         "kv_space_gib": float(backend.settings.plugin_env()[
                             "VLLM_CPU_KVCACHE_SPACE"])}
        finally:
            orc.close()
        print(f"{name}: {out[name]}", flush=True)
    out["bytes_per_token_minipic_over_stock"] = (out["minipic"]["bytes_per_token"]
                                                 / out["stock"]["bytes_per_token"])
    out["blocks_minipic_over_stock"] = (out["minipic"]["blocks_total"]
                                        / out["stock"]["blocks_total"])
    recorded = Path("results/bench/bench.json")
    if recorded.exists():
        old = (json.loads(recorded.read_text()).get("throughput", {}).get("kv_cache", {})
               .get("minipic"))
        if old and old.get("blocks_total"):
            out["old_layout_recorded"] = old
            out["blocks_now_over_old_layout"] = (out["minipic"]["blocks_total"]
                                                 / old["blocks_total"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 16, 64],
                        help="blocks written / filled per call (1: a decode step's refill)")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--engines", action="store_true",
                        help="also start stock and minipic engines and compare their KV blocks")
    parser.add_argument("--out", type=Path, default=Path("results/kv_layout/kv_layout_cost.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for blocks in args.blocks:
            row = {"dtype": str(dtype).removeprefix("torch."), "blocks": blocks,
                   **measure(dtype, blocks, args.reps)}
            rows.append(row)
            print(f"{row['dtype']:9s} {blocks:4d} blocks  write old {row['write_old_ms']:.3f} "
                  f"new {row['write_new_ms']:.3f} ms ({row['write_new_over_old']:.2f}x)  "
                  f"fill old {row['fill_old_ms']:.3f} new {row['fill_new_ms']:.3f} ms "
                  f"({row['fill_new_over_old']:.2f}x)", flush=True)
    engines = engine_blocks() if args.engines else None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "engines": engines,
        "machine": platform.processor() or platform.machine(), "threads": 1,
        "shapes": {"heads": HEADS, "kv_heads": KV_HEADS, "head_size": HEAD, "block": BLOCK},
        "rows": rows,
    }, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
