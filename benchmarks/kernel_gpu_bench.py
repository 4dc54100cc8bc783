"""GPU benchmark: MiniPIC's RoPE-in-attention Triton kernel vs vLLM's stock Triton attention.

The question it answers: what does rotating every key tile inside attention cost, compared with
the stock engine that rotated each key once when it was written? Both kernels get the same
ragged batch; vLLM's ``unified_attention`` reads a copy of the KV cache whose keys were
pre-rotated at their positions (what a stock engine stores), ours reads the unrotated cache and
the model's cos/sin table. Pre-rotation is not timed. Launch settings for vLLM mirror its Triton
backend (2D kernel, or the 3D split-KV decode kernel for small decode batches, with the same
threshold and 16 softmax segments).

Each case is checked first: ours vs the torch reference (fp32 math) and ours vs vLLM. Times are
medians of CUDA-event timings after warm-up. Results go to ``--out`` as JSON; the printed ratio
is ours / vLLM (above 1: ours is slower).

Usage (on a CUDA machine, from the repo root)::

    python benchmarks/kernel_gpu_bench.py --out results/kernel_bench.json

Without CUDA it prints why it is skipping, writes ``{"skipped": ...}`` to ``--out`` if given,
and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from minipic.kernels import paged_attention_rope_ref, rotate  # noqa: E402

MODELS: dict[str, tuple[int, int, int]] = {
    # name: (num_heads, num_kv_heads, head_size)
    "smollm2": (9, 3, 64),
    "llama8b": (32, 8, 128),
}


@dataclass(frozen=True)
class Scenario:
    """A batch as a list of (context_len, query_len) per request."""

    name: str
    requests: tuple[tuple[int, int], ...]


def _scenarios(gen: torch.Generator) -> dict[str, Scenario]:
    def rand(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    return {
        # span hits: a cached 1024-token prefix plus a 1024-token suffix to prefill, x4
        "prefill": Scenario("prefill", tuple((1024, 1024) for _ in range(4))),
        # large continuous-batching decode step
        "decode": Scenario("decode", tuple((rand(511, 4095), 1) for _ in range(64))),
        # few long decodes: vLLM switches to its split-KV (3D) kernel here, ours does not split
        "decode-small": Scenario("decode-small", tuple((8191, 1) for _ in range(8))),
        # chunked prefill riding along with decodes
        "mixed": Scenario(
            "mixed", tuple([(1024, 512)] * 2 + [(rand(511, 4095), 1) for _ in range(48)])
        ),
    }


@dataclass
class Batch:
    query: torch.Tensor
    key_cache: torch.Tensor  # unrotated (MiniPIC)
    key_cache_rot: torch.Tensor  # rotated at each key's position (stock engine)
    value_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int


def _rope_table(max_pos: int, rotary_dim: int, base: float, device: torch.device) -> torch.Tensor:
    """Standard cat(cos, sin) table, the layout of vLLM's ``cos_sin_cache``."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, device=device).float() / rotary_dim))
    angles = torch.arange(max_pos, device=device).float()[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


def make_batch(
    scenario: Scenario,
    model: tuple[int, int, int],
    block_size: int,
    table: torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
    gen: torch.Generator,
) -> Batch:
    """Disjoint, shuffled physical blocks per request (so pre-rotating a block is well defined
    for the stock kernel), keys rotated per request for the stock copy."""
    num_heads, num_kv_heads, head_size = model
    seq_lens = [c + q for c, q in scenario.requests]
    q_lens = [q for _, q in scenario.requests]
    n_blocks = [math.ceil(s / block_size) for s in seq_lens]
    total = sum(n_blocks)
    perm = torch.randperm(total, generator=gen).to(device)
    shape = (total, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(shape, device=device, dtype=dtype)
    value_cache = torch.randn(shape, device=device, dtype=dtype)
    key_cache_rot = key_cache.clone()
    block_table = torch.zeros(len(seq_lens), max(n_blocks), dtype=torch.int32, device=device)
    start = 0
    for i, nb in enumerate(n_blocks):
        blocks = perm[start : start + nb]
        start += nb
        block_table[i, :nb] = blocks.to(torch.int32)
        keys = key_cache[blocks].reshape(-1, num_kv_heads, head_size)
        pos = torch.arange(keys.shape[0], device=device)
        rot = rotate(keys, pos, table, table.shape[1], True)
        key_cache_rot[blocks] = rot.view(nb, block_size, num_kv_heads, head_size)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    query = torch.randn(sum(q_lens), num_heads, head_size, device=device, dtype=dtype)
    return Batch(
        query,
        key_cache,
        key_cache_rot,
        value_cache,
        block_table,
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        qsl.to(device),
        max(q_lens),
        max(seq_lens),
    )


def _vllm_runner(b: Batch, scale: float) -> tuple[Callable[[], torch.Tensor], str]:
    """A closure running vLLM's stock Triton attention the way its backend would."""
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    num_tokens, num_heads, head_size = b.query.shape
    num_kv_heads = b.key_cache.shape[2]
    seq_threshold_3d = 128 // num_kv_heads  # triton_attn.py: MIN_LAUNCH_GRID_SIZE_2D // kv heads
    segments = 16  # NUM_PAR_SOFTMAX_SEGMENTS
    rows = max(seq_threshold_3d, num_tokens)
    pad = 1 << (head_size - 1).bit_length()
    dev = b.query.device
    segm_out = torch.empty(rows, num_heads, segments, pad, dtype=torch.float32, device=dev)
    segm_max = torch.empty(rows, num_heads, segments, dtype=torch.float32, device=dev)
    segm_sum = torch.empty(rows, num_heads, segments, dtype=torch.float32, device=dev)
    out = torch.empty_like(b.query)
    num_reqs = b.seq_lens.numel()
    path = "3D" if b.max_query_len == 1 and num_reqs <= seq_threshold_3d else "2D"

    def run() -> torch.Tensor:
        unified_attention(
            q=b.query,
            k=b.key_cache_rot,
            v=b.value_cache,
            out=out,
            cu_seqlens_q=b.query_start_loc,
            max_seqlen_q=b.max_query_len,
            seqused_k=b.seq_lens,
            max_seqlen_k=b.max_seq_len,
            softmax_scale=scale,
            causal=True,
            window_size=(-1, -1),
            block_table=b.block_table,
            softcap=0,
            q_descale=None,
            k_descale=None,
            v_descale=None,
            seq_threshold_3D=seq_threshold_3d,
            num_par_softmax_segments=segments,
            softmax_segm_output=segm_out,
            softmax_segm_max=segm_max,
            softmax_segm_expsum=segm_sum,
        )
        return out

    return run, path


def _time_ms(fn: Callable[[], Any], warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def run_case(
    model_name: str, scenario: Scenario, args: argparse.Namespace, gen: torch.Generator
) -> dict[str, Any]:
    from minipic.kernels.triton_paged_attention import paged_attention_rope_triton

    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    model = MODELS[model_name]
    head_size = model[2]
    scale = head_size**-0.5
    # vLLM casts the cos/sin cache to the activation dtype; both kernels see the same table.
    table = args.table[head_size].to(dtype)
    b = make_batch(scenario, model, args.block_size, table, dtype, device, gen)
    out = torch.empty_like(b.query)

    def ours() -> torch.Tensor:
        return paged_attention_rope_triton(
            b.query, b.key_cache, b.value_cache, b.block_table, b.seq_lens, b.query_start_loc,
            table, head_size, True, scale, True, out=out, max_query_len=b.max_query_len,
        )  # fmt: skip

    rec: dict[str, Any] = {
        "model": model_name,
        "scenario": scenario.name,
        "num_reqs": len(scenario.requests),
        "num_tokens": b.query.shape[0],
        "total_kv_tokens": int(b.seq_lens.sum()),
        "heads": list(model),
    }
    got = ours().clone()
    ref = paged_attention_rope_ref(
        b.query, b.key_cache, b.value_cache, b.block_table, b.seq_lens, b.query_start_loc,
        table, head_size, True, scale, True,
    )  # fmt: skip
    rec["rel_err_vs_ref"] = _rel_err(got, ref)
    rec["ours_ms"] = _time_ms(ours, args.warmup, args.reps)
    try:
        stock, path = _vllm_runner(b, scale)
        rec["vllm_path"] = path
        rec["rel_err_vs_vllm"] = _rel_err(got, stock())
        rec["vllm_ms"] = _time_ms(stock, args.warmup, args.reps)
        rec["ratio_ours_over_vllm"] = rec["ours_ms"] / rec["vllm_ms"]
    except Exception as e:  # vLLM missing or its kernel API moved: still report ours
        rec["vllm_error"] = f"{type(e).__name__}: {e}"
    rec["ok"] = rec["rel_err_vs_ref"] < args.tol and rec.get("rel_err_vs_vllm", 0.0) < args.tol
    return rec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write results as JSON here")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument(
        "--scenarios", nargs="+", default=["prefill", "decode", "decode-small", "mixed"]
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--tol", type=float, default=3e-2, help="max relative error (bf16)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        msg = "CUDA is not available: kernel_gpu_bench needs an NVIDIA GPU; skipping."
        print(msg)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump({"skipped": msg}, f, indent=2)
        return 0

    gen = torch.Generator().manual_seed(args.seed)
    scenarios = _scenarios(gen)
    unknown = set(args.scenarios) - set(scenarios)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; choose from {sorted(scenarios)}")
    max_pos = 16384
    args.table = {d: _rope_table(max_pos, d, 10000.0, torch.device("cuda")) for d in (64, 128)}

    results = []
    for model_name in args.models:
        for name in args.scenarios:
            rec = run_case(model_name, scenarios[name], args, gen)
            results.append(rec)
            ratio = rec.get("ratio_ours_over_vllm")
            print(
                f"{model_name:8s} {name:13s} tokens={rec['num_tokens']:5d} "
                f"kv={rec['total_kv_tokens']:7d} ours={rec['ours_ms']:.3f} ms "
                + (
                    f"vllm[{rec['vllm_path']}]={rec['vllm_ms']:.3f} ms ratio={ratio:.2f} "
                    if ratio is not None
                    else f"vllm: {rec.get('vllm_error')} "
                )
                + f"err_ref={rec['rel_err_vs_ref']:.1e} ok={rec['ok']}",
                flush=True,
            )
    summary = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "dtype": args.dtype,
        "block_size": args.block_size,
        "reps": args.reps,
        "results": results,
    }
    try:
        import triton

        summary["triton"] = triton.__version__
        import vllm

        summary["vllm"] = vllm.__version__
    except ImportError:
        pass
    ratios = [r["ratio_ours_over_vllm"] for r in results if "ratio_ours_over_vllm" in r]
    if ratios:
        geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        summary["geomean_ratio_ours_over_vllm"] = geo
        print(f"geomean ratio ours/vllm = {geo:.2f} over {len(ratios)} cases")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
        print(f"wrote {args.out}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
