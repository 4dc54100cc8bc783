"""Tests for ``kernels``: RoPE from the model's table, paged reference, Triton kernel.

What is proved here and why it matters for MiniPIC (docs/design.md §1):

* ``rotate`` equals vLLM's own rotary modules (``get_rope``: default, partial rotary, gptj,
  llama3, linear, yarn) when given their ``cos_sin_cache``: the rotary variant comes from the
  model's table, never from frequencies we re-derive.
* The paged reference equals an independent contiguous formulation (SDPA) on ragged batches with
  shuffled block tables, GQA, mixed prefill/decode.
* The Triton kernel (Triton's CPU interpreter here, compiled on a GPU machine) equals the
  reference, including when one physical block is read by two requests at two logical offsets
  in one launch -- the "no block copies" property.

Inputs are fresh random every run; each assertion message carries the seed, and
``MINIPIC_TEST_SEED=<seed>`` replays a run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
from support.tolerances import check, check_close, ulp

ON_GPU = torch.cuda.is_available()  # without a GPU conftest chose Triton's interpreter

from minipic.kernels import dense_attention_ref, paged_attention_rope_ref, rotate  # noqa: E402
from minipic.kernels.triton_paged_attention import paged_attention_rope_triton  # noqa: E402


def _triton_runnable_here() -> bool:
    """False when another test module imported Triton (e.g. through vLLM) before the line
    above ran: the interpreter cannot run in such a process."""
    if ON_GPU:
        return True
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(standard.cdiv, InterpretedFunction)


TRITON_HERE = _triton_runnable_here()
needs_triton = pytest.mark.skipif(
    not TRITON_HERE,
    reason="Triton was imported before TRITON_INTERPRET=1 was set; these tests run in a fresh "
    "process instead (test_triton_tests_in_fresh_process)",
)

pytestmark = pytest.mark.fast

DEVICE = torch.device("cuda" if ON_GPU else "cpu")


# ------------------------------------------------------------------------------------------------
# helpers


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randint(gen: torch.Generator, lo: int, hi: int) -> int:
    """Uniform integer in [lo, hi]."""
    return int(torch.randint(lo, hi + 1, (1,), generator=gen))


def _rope_table(
    max_pos: int, rotary_dim: int, gen: torch.Generator, random_table: bool = False
) -> torch.Tensor:
    """A ``[max_pos, rotary_dim]`` cat(cos, sin) table.

    ``random_table`` fills it with arbitrary numbers instead of real cos/sin, which proves the
    kernel uses table entries verbatim (e.g. yarn's mscale-multiplied tables) and assumes
    nothing like cos^2 + sin^2 = 1.
    """
    if random_table:
        return torch.rand(max_pos, rotary_dim, generator=gen) * 2 - 1
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    angles = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


@dataclass
class Batch:
    """One ragged batch in the engine's paged layout, plus contiguous copies for the dense ref."""

    query: torch.Tensor  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    keys: list[torch.Tensor]  # per request [seq_len, num_kv_heads, head_size], logical order
    values: list[torch.Tensor]

    def to(self, device: torch.device) -> Batch:
        return Batch(
            *(t.to(device) for t in (self.query, self.key_cache, self.value_cache)),
            *(t.to(device) for t in (self.block_table, self.seq_lens, self.query_start_loc)),
            [k.to(device) for k in self.keys],
            [v.to(device) for v in self.values],
        )


def make_batch(
    gen: torch.Generator,
    reqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    pad_tokens: int = 0,
) -> Batch:
    """Build a batch from ``(context_len, query_len)`` per request.

    Physical blocks are a random permutation (non-contiguous, non-monotonic tables). Everything
    a correct kernel must not read is NaN: spare blocks, the slots past ``seq_len`` in each
    request's last block, and the block-table padding (which points at NaN blocks), so any
    out-of-range read shows up as NaN in the output.
    """
    seq_lens = [c + q for c, q in reqs]
    n_blocks = [-(-s // block_size) for s in seq_lens]
    spare = 2
    total_blocks = sum(n_blocks) + spare
    perm = torch.randperm(total_blocks, generator=gen).tolist()
    spare_ids = perm[-spare:]
    shape = (total_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.full(shape, float("nan"))
    value_cache = torch.full(shape, float("nan"))
    max_blocks = max(n_blocks) + 2
    block_table = torch.tensor(spare_ids * max_blocks, dtype=torch.int32)[:max_blocks]
    block_table = block_table.repeat(len(reqs), 1)
    keys, values = [], []
    nxt = 0
    for i, seq_len in enumerate(seq_lens):
        k = torch.randn(seq_len, num_kv_heads, head_size, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, head_size, generator=gen)
        for b in range(n_blocks[i]):
            phys = perm[nxt]
            nxt += 1
            block_table[i, b] = phys
            rows = slice(b * block_size, min(seq_len, (b + 1) * block_size))
            n = rows.stop - rows.start
            key_cache[phys, :n] = k[rows]
            value_cache[phys, :n] = v[rows]
        keys.append(k.to(dtype))
        values.append(v.to(dtype))
    q_lens = [q for _, q in reqs]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    query = torch.randn(sum(q_lens) + pad_tokens, num_heads, head_size, generator=gen)
    return Batch(
        query.to(dtype),
        key_cache.to(dtype),
        value_cache.to(dtype),
        block_table,
        torch.tensor(seq_lens, dtype=torch.int32),
        qsl,
        keys,
        values,
    )


def mixed_requests(gen: torch.Generator, n_decode: int = 2) -> list[tuple[int, int]]:
    """Fresh prefill, prefill on top of cached context, decodes (one at position 0), shuffled."""
    reqs = [
        (0, _randint(gen, 2, 40)),  # fresh prefill
        (_randint(gen, 1, 60), _randint(gen, 2, 24)),  # chunked prefill / prefix-cache hit
        (0, 1),  # first token
    ]
    reqs += [(_randint(gen, 1, 90), 1) for _ in range(n_decode)]
    order = torch.randperm(len(reqs), generator=gen).tolist()
    return [reqs[i] for i in order]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (NaN anywhere gives NaN)."""
    diff = (out.float() - ref.float()).abs().max()
    return (diff / ref.float().abs().max().clamp_min(1e-6)).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float, seed: int, what: str) -> None:
    nan_rows = torch.isnan(out.float()).flatten(1).any(1).nonzero().flatten().tolist()
    assert not nan_rows, f"{what}: NaN in output rows {nan_rows[:10]} (seed={seed})"
    check(rel_err(out, ref), tol, f"{what}: relative error", seed)


def table_angle_tolerance(max_position: int, rows: int) -> float:
    """How far results that read ``rows`` fp32 rotary-table rows apart may differ, as a share of
    the largest element. vLLM's table holds cos/sin of ``pos * inv_freq``: ``inv_freq`` and the
    product are each rounded (2 x 2^-24 relative), so a row's angle is off by up to
    ``max_position * 2^-23`` radians, and each row read moves an element by that angle times
    its rotation pair's norm (<= sqrt(2) x the largest element)."""
    return rows * 2**0.5 * max_position * 2.0**-23


def run_ref(b: Batch, table: torch.Tensor, rot: int, neox: bool, causal: bool = True):
    scale = b.query.shape[-1] ** -0.5
    return paged_attention_rope_ref(
        b.query, b.key_cache, b.value_cache, b.block_table, b.seq_lens, b.query_start_loc,
        table, rot, neox, scale, causal,
    )  # fmt: skip


def run_dense(b: Batch, table: torch.Tensor, rot: int, neox: bool, causal: bool = True):
    scale = b.query.shape[-1] ** -0.5
    return dense_attention_ref(
        b.query, b.keys, b.values, b.query_start_loc, table, rot, neox, scale, causal
    )


def run_triton(
    b: Batch, table: torch.Tensor, rot: int, neox: bool, causal: bool = True, **kw
) -> torch.Tensor:
    """Launch on a NaN-poisoned output so unwritten rows cannot pass as correct."""
    out = torch.full_like(b.query, float("nan"))
    scale = b.query.shape[-1] ** -0.5
    res = paged_attention_rope_triton(
        b.query, b.key_cache, b.value_cache, b.block_table, b.seq_lens, b.query_start_loc,
        table.to(b.query.device), rot, neox, scale, causal, out=out, **kw,
    )  # fmt: skip
    assert res is out
    return out


# ------------------------------------------------------------------------------------------------
# RoPE vs vLLM's rotary modules


@pytest.fixture(scope="module")
def vllm_get_rope():
    """vLLM's ``get_rope``; CustomOps need a current vLLM config even on CPU."""
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    def make(**kwargs):
        with set_current_vllm_config(VllmConfig()):
            return get_rope(**kwargs)

    return make


ROPE_CASES = {
    "default": dict(head_size=64, max_position=2048),
    "partial": dict(
        head_size=128, max_position=2048, rope_parameters={"partial_rotary_factor": 0.25}
    ),
    "gptj": dict(head_size=64, max_position=2048, is_neox_style=False),
    "gptj-partial": dict(
        head_size=64, max_position=1024, is_neox_style=False,
        rope_parameters={"partial_rotary_factor": 0.5},
    ),
    "llama3": dict(
        head_size=128, max_position=8192,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
    ),
    "linear": dict(
        head_size=64, max_position=1024, rope_parameters={"rope_type": "linear", "factor": 4.0}
    ),
    "yarn": dict(
        head_size=64, max_position=4096,
        rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
        },
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rotate_matches_vllm_rotary(case: str, vllm_get_rope, seed: int) -> None:
    gen = _gen(seed)
    rope = vllm_get_rope(dtype=torch.float32, **ROPE_CASES[case])
    table, rot, neox = rope.cos_sin_cache, rope.rotary_dim, rope.is_neox_style
    head_size = rope.head_size
    assert table.shape[-1] == rot
    n_tok, n_heads = 37, 3
    pos = torch.randint(0, table.shape[0], (n_tok,), generator=gen)
    x = torch.randn(n_tok, n_heads, head_size, generator=gen)

    ours = rotate(x, pos, table, rot, neox)
    native, _ = rope.forward_native(pos, x.reshape(n_tok, -1).clone(), None)
    check_close(ours, native.view_as(x), atol=1e-5, rtol=1e-5, what=f"{case} vs vLLM", seed=seed)
    # The CPU default path (C++ op), i.e. what a stock engine would have stored on this host.
    native_cpu, _ = rope.forward_cpu(pos, x.reshape(n_tok, -1).clone(), None)
    check_close(ours, native_cpu.view_as(x), atol=1e-5, rtol=1e-5,
                what=f"{case} vs vLLM's CPU op", seed=seed)
    if rot < head_size:
        assert torch.equal(ours[..., rot:], x[..., rot:]), "non-rotary dims must pass through"

    # bf16: vLLM rounds cos/sin and products to bf16, we compute in fp32 and round once.
    rope16 = vllm_get_rope(dtype=torch.bfloat16, **ROPE_CASES[case])
    x16 = x.to(torch.bfloat16)
    ours16 = rotate(x16, pos, rope16.cos_sin_cache, rot, neox)
    native16, _ = rope16.forward_native(pos, x16.reshape(n_tok, -1).clone(), None)
    assert ours16.dtype == torch.bfloat16
    check_close(ours16, native16.view_as(x), atol=5e-2, rtol=2e-2, what=f"{case} bf16",
                seed=seed)


@pytest.mark.parametrize("neox", [True, False])
def test_rotate_matches_complex_formulation(neox: bool, seed: int) -> None:
    """Independent of vLLM: pairs rotated as complex numbers by angle pos * base^(-2i/rot)."""
    gen = _gen(seed)
    head_size, rot, base = 64, 48, 10000.0
    table = _rope_table(512, rot, gen)
    pos = torch.randint(0, 512, (11,), generator=gen)
    x = torch.randn(11, 2, head_size, generator=gen, dtype=torch.float64)
    half = rot // 2
    idx = torch.arange(half)
    first, second = (idx, idx + half) if neox else (2 * idx, 2 * idx + 1)
    theta = pos[:, None].double() * base ** (-2.0 * idx.double() / rot)  # [tokens, half]
    z = torch.complex(x[..., first], x[..., second]) * torch.polar(
        torch.ones_like(theta), theta
    ).unsqueeze(1)
    expected = x.clone()
    expected[..., first], expected[..., second] = z.real, z.imag
    ours = rotate(x.float(), pos, table, rot, neox)
    # the fp32 table's angle error (one row read) against exact complex arithmetic, plus a few
    # fp32 roundings of the products
    scale = float(x.abs().max())
    tol = table_angle_tolerance(512, rows=1) * scale + 4 * ulp(scale, torch.float32)
    check(float((ours.double() - expected).abs().max()), tol, "complex formulation", seed)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rotate_low_precision_computes_in_fp32(dtype: torch.dtype, seed: int) -> None:
    gen = _gen(seed)
    table = _rope_table(256, 64, gen)
    pos = torch.randint(0, 256, (9,), generator=gen)
    x = torch.randn(9, 4, 64, generator=gen).to(dtype)
    out = rotate(x, pos, table, 64, True)
    assert out.dtype == dtype
    # Exactly one rounding: equal to the fp32 result rounded to dtype.
    assert torch.equal(out, rotate(x.float(), pos, table, 64, True).to(dtype)), f"seed={seed}"


# ------------------------------------------------------------------------------------------------
# paged reference vs dense reference


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,rot,neox,block_size",
    [
        (4, 4, 64, 64, True, 16),
        (4, 2, 64, 32, False, 32),
        (6, 2, 128, 128, False, 16),
        (9, 3, 64, 64, True, 32),
        (3, 1, 80, 40, True, 16),
    ],
)
@pytest.mark.parametrize("causal", [True, False])
def test_paged_ref_matches_dense_ref(
    num_heads, num_kv_heads, head_size, rot, neox, block_size, causal, seed
) -> None:
    gen = _gen(seed)
    b = make_batch(
        gen, mixed_requests(gen, n_decode=3), num_heads, num_kv_heads, head_size, block_size
    )
    table = _rope_table(256, rot, gen, random_table=bool(_randint(gen, 0, 1)))
    assert_close(
        run_ref(b, table, rot, neox, causal), run_dense(b, table, rot, neox, causal), 1e-5, seed,
        "paged ref vs dense ref",
    )  # fmt: skip


def test_paged_ref_bf16_and_padding_rows(seed: int) -> None:
    """bf16 in/out; rows past query_start_loc[-1] (CUDA-graph padding) stay untouched."""
    gen = _gen(seed)
    b = make_batch(gen, mixed_requests(gen), 4, 2, 64, 16, torch.bfloat16, pad_tokens=3)
    table = _rope_table(256, 64, gen)
    out = torch.full_like(b.query, float("nan"))
    paged_attention_rope_ref(
        b.query, b.key_cache, b.value_cache, b.block_table, b.seq_lens, b.query_start_loc,
        table, 64, True, 0.125, out=out,
    )  # fmt: skip
    n = int(b.query_start_loc[-1])
    assert out.dtype == torch.bfloat16
    assert torch.isnan(out[n:]).all(), "padding rows must not be written"
    assert_close(out[:n], run_dense(b, table, 64, True)[:n], 1e-2, seed, "bf16 paged vs dense")


def test_paged_ref_rotates_keys_by_logical_position(seed: int) -> None:
    """A single key at logical position j must score exactly (q . R_j k) * scale."""
    gen = _gen(seed)
    table = _rope_table(64, 32, gen)
    b = make_batch(gen, [(20, 1)], 1, 1, 32, 16)
    v_onehot = torch.eye(32)[:21].unsqueeze(1)  # value j = e_j: output = softmax probs
    for j in range(21):
        blk = int(b.block_table[0, j // 16])
        b.value_cache[blk, j % 16] = v_onehot[j]
    probs = run_ref(b, table, 32, True)[0, 0, :21]
    k_rot = rotate(b.keys[0], torch.arange(21), table, 32, True)[:, 0]
    expected = torch.softmax((k_rot @ b.query[0, 0]) * 32**-0.5, dim=0)
    # torch.testing's fp32 defaults
    check_close(probs, expected, atol=1e-5, rtol=1.3e-6, what="scores at j", seed=seed)


# ------------------------------------------------------------------------------------------------
# Triton kernel vs reference

# (num_heads, num_kv_heads, head_size, rotary_dim, neox, block_size, launch overrides)
TRITON_CASES = [
    (4, 4, 64, 64, True, 16, {}),
    (4, 2, 64, 64, False, 32, {}),
    (6, 2, 128, 128, True, 16, {}),
    (6, 2, 64, 32, False, 16, {}),  # GQA 3, partial rotary
    (2, 1, 128, 64, True, 32, {}),  # GQA 2, partial rotary, neox
    (4, 2, 128, 32, False, 32, {"block_n": 16}),  # K tile smaller than a block
    (3, 3, 64, 64, True, 16, {"block_n": 64}),  # K tile spanning several blocks
    (9, 3, 64, 64, True, 16, {"block_m": 32}),  # SmolLM2 head layout
    (2, 1, 80, 80, False, 16, {}),  # head size padded to 128 inside the kernel
]


@needs_triton
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,rot,neox,block_size,launch",
    TRITON_CASES,
    ids=[f"H{c[0]}-KV{c[1]}-D{c[2]}-R{c[3]}-{'neox' if c[4] else 'gptj'}-B{c[5]}" for c in
         TRITON_CASES],
)  # fmt: skip
def test_triton_matches_reference(
    num_heads, num_kv_heads, head_size, rot, neox, block_size, launch, seed
) -> None:
    gen = _gen(seed)
    b = make_batch(gen, mixed_requests(gen), num_heads, num_kv_heads, head_size, block_size)
    table = _rope_table(256, rot, gen, random_table=bool(_randint(gen, 0, 1)))
    ref = run_ref(b, table, rot, neox)
    out = run_triton(b.to(DEVICE), table, rot, neox, **launch).cpu()
    assert_close(out, ref, 1e-3, seed, "triton vs ref")


@needs_triton
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("gqa", [1, 2, 3])
def test_triton_grid(gqa: int, head_size: int, block_size: int, neox: bool, seed: int) -> None:
    """Every GQA ratio x head size x block size x rotary style; the rotary fraction (full,
    half, quarter) and the number of KV heads are drawn per run."""
    gen = _gen(seed)
    rot = head_size // [1, 2, 4][_randint(gen, 0, 2)]
    num_kv_heads = _randint(gen, 1, 2)
    num_heads = gqa * num_kv_heads
    b = make_batch(gen, mixed_requests(gen), num_heads, num_kv_heads, head_size, block_size)
    table = _rope_table(256, rot, gen)
    out = run_triton(b.to(DEVICE), table, rot, neox).cpu()
    what = f"triton vs ref (rotary_dim={rot}, num_kv_heads={num_kv_heads})"
    assert_close(out, run_ref(b, table, rot, neox), 1e-3, seed, what)


@needs_triton
def test_triton_non_causal_and_decode_only(seed: int) -> None:
    gen = _gen(seed)
    table = _rope_table(256, 64, gen)
    b = make_batch(gen, mixed_requests(gen), 4, 2, 64, 16)
    out = run_triton(b.to(DEVICE), table, 64, True, causal=False).cpu()
    assert_close(out, run_ref(b, table, 64, True, causal=False), 1e-3, seed, "non-causal")
    # Decode-only batch takes the small-tile launch path (max_query_len == 1).
    b = make_batch(gen, [(_randint(gen, 0, 100), 1) for _ in range(4)], 6, 2, 64, 32)
    out = run_triton(b.to(DEVICE), table, 64, False, max_query_len=1).cpu()
    assert_close(out, run_ref(b, table, 64, False), 1e-3, seed, "decode-only")


@needs_triton
def test_triton_ragged_edges(seed: int) -> None:
    """Empty requests, a one-token sequence, padding rows, and a single request."""
    gen = _gen(seed)
    table = _rope_table(256, 64, gen)
    reqs = [(0, 1), (7, 0), (_randint(gen, 1, 40), 1), (0, 17), (5, 0)]
    b = make_batch(gen, reqs, 4, 2, 64, 16, pad_tokens=5)
    out = run_triton(b.to(DEVICE), table, 64, True).cpu()
    n = int(b.query_start_loc[-1])
    assert torch.isnan(out[n:]).all(), f"padding rows written (seed={seed})"
    assert_close(out[:n], run_ref(b, table, 64, True)[:n], 1e-3, seed, "ragged edges")
    b = make_batch(gen, [(_randint(gen, 0, 30), _randint(gen, 1, 20))], 4, 4, 64, 16)
    out = run_triton(b.to(DEVICE), table, 64, True).cpu()
    assert_close(out, run_ref(b, table, 64, True), 1e-3, seed, "single request")


@needs_triton
def test_triton_bf16(seed: int) -> None:
    gen = _gen(seed)
    table = _rope_table(256, 128, gen).to(torch.bfloat16)
    b = make_batch(gen, mixed_requests(gen), 4, 2, 128, 16, torch.bfloat16)
    out = run_triton(b.to(DEVICE), table, 128, True).cpu()
    assert out.dtype == torch.bfloat16
    # K is rotated in fp32 then rounded to bf16 (as a stock engine stores it), P is bf16 too.
    assert_close(out, run_ref(b, table, 128, True), 3e-2, seed, "bf16 triton vs ref")


# ------------------------------------------------------------------------------------------------
# the MiniPIC point: one physical block, two logical offsets, one launch


@needs_triton
def test_shared_blocks_at_two_offsets(seed: int) -> None:
    """A cached span's physical blocks are used by request A at logical block 0 and by request
    B at logical block 3 (and by a decode C at block 1) in the same batch. All must match the
    dense reference, and match a layout where B and C got private copies of the span blocks,
    bit for bit: sharing changes nothing, so no copies or re-rotations are needed."""
    gen = _gen(seed)
    bs, h, kvh, d, rot, neox = 16, 4, 2, 64, 64, True
    table = _rope_table(256, rot, gen, random_table=bool(_randint(gen, 0, 1)))
    span_k = torch.randn(2 * bs, kvh, d, generator=gen)
    span_v = torch.randn(2 * bs, kvh, d, generator=gen)

    def own(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, kvh, d, generator=gen), torch.randn(n, kvh, d, generator=gen)

    a_tail, b_head, b_tail, c_head, c_tail = own(9), own(3 * bs), own(12), own(bs), own(1)
    # request -> (keys, values, query_len); the span sits at a different offset in each
    seqs = {
        "A": (torch.cat([span_k, a_tail[0]]), torch.cat([span_v, a_tail[1]]), 6),
        "B": (
            torch.cat([b_head[0], span_k, b_tail[0]]),
            torch.cat([b_head[1], span_v, b_tail[1]]),
            10,
        ),
        "C": (
            torch.cat([c_head[0], span_k, c_tail[0]]),
            torch.cat([c_head[1], span_v, c_tail[1]]),
            1,
        ),
    }
    span_slots = {"A": 0, "B": 3, "C": 1}  # logical block index where the span starts

    def layout(shared: bool) -> Batch:
        """Lay out the three requests; span blocks physical 5 and 2 (reversed on purpose)."""
        n_blocks = {r: -(-len(k) // bs) for r, (k, _, _) in seqs.items()}
        total = sum(n_blocks.values()) + 1
        kc = torch.full((total, bs, kvh, d), float("nan"))
        vc = torch.full_like(kc, float("nan"))
        free = [i for i in torch.randperm(total, generator=gen).tolist() if i not in (5, 2)]
        span_phys = [5, 2]
        table_rows = []
        for r, (k, v, _) in seqs.items():
            row = []
            for blk in range(n_blocks[r]):
                in_span = span_slots[r] <= blk < span_slots[r] + 2
                if in_span and (shared or r == "A"):
                    phys = span_phys[blk - span_slots[r]]
                else:
                    phys = free.pop()
                rows = slice(blk * bs, min(len(k), (blk + 1) * bs))
                kc[phys, : rows.stop - rows.start] = k[rows]
                vc[phys, : rows.stop - rows.start] = v[rows]
                row.append(phys)
            table_rows.append(row + [free[0]] * (8 - len(row)))
        q_lens = [q for _, _, q in seqs.values()]
        return Batch(
            torch.randn(sum(q_lens), h, d, generator=torch.Generator().manual_seed(seed)),
            kc,
            vc,
            torch.tensor(table_rows, dtype=torch.int32),
            torch.tensor([len(k) for k, _, _ in seqs.values()], dtype=torch.int32),
            torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32),
            [k for k, _, _ in seqs.values()],
            [v for _, v, _ in seqs.values()],
        )

    shared, private = layout(shared=True), layout(shared=False)
    assert (shared.block_table[1, 3:5] == shared.block_table[0, 0:2]).all()
    assert (shared.block_table[2, 1:3] == shared.block_table[0, 0:2]).all()
    assert not (private.block_table[1, 3:5] == private.block_table[0, 0:2]).any()
    dense = run_dense(shared, table, rot, neox)
    ref_shared = run_ref(shared, table, rot, neox)
    assert_close(ref_shared, dense, 1e-5, seed, "shared blocks: ref vs dense")
    assert torch.equal(ref_shared, run_ref(private, table, rot, neox)), f"seed={seed}"
    tri_shared = run_triton(shared.to(DEVICE), table, rot, neox).cpu()
    assert_close(tri_shared, dense, 1e-3, seed, "shared blocks: triton vs dense")
    tri_private = run_triton(private.to(DEVICE), table, rot, neox).cpu()
    assert torch.equal(tri_shared, tri_private), f"sharing changed the result (seed={seed})"


# ------------------------------------------------------------------------------------------------
# compiled-mode check without a GPU: the interpreter accepts things the compiler rejects


_COMPILE_SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction
from minipic.kernels import triton_paged_attention as tpa

fn = tpa._paged_attention_rope_kernel
assert isinstance(fn, JITFunction), "must run without TRITON_INTERPRET"
for cfg in json.loads(sys.argv[1]):
    consts = dict(
        HEAD_SIZE=cfg["head"], HEAD_PAD=triton.next_power_of_2(cfg["head"]), ROT_DIM=cfg["rot"],
        HALF_PAD=max(16, triton.next_power_of_2(cfg["rot"] // 2)),
        PASS_PAD=max(16, triton.next_power_of_2(max(1, cfg["head"] - cfg["rot"]))),
        IS_NEOX=cfg["neox"], QPK=cfg["qpk"], BLOCK_M=cfg["bm"], BLOCK_Q=cfg["bm"] // cfg["qpk"],
        BLOCK_N=cfg["bn"], BLOCK_SIZE=16, CAUSAL=cfg["causal"], DOT_FP32=cfg["dtype"] == "fp32",
        HAS_KEY_START=cfg.get("key_start", False),
        HAS_KEY_POSITIONS=bool(cfg.get("key_positions")), HAS_SINK=cfg.get("sink", False),
        num_reqs=1,
        stride_qd=1, stride_od=1, stride_kd=1, stride_vd=1, stride_csd=1,
    )
    int_ptrs = {"block_table_ptr", "seq_lens_ptr", "query_start_loc_ptr"}
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name == "key_start_ptr":
            sig[name] = "*i64"
        elif name == "key_positions_ptr":
            sig[name] = "*" + (cfg.get("key_positions") or "i32")
        elif name in ("key_sink_ptr", "query_isolated_ptr"):
            sig[name] = "*u8"  # bool tensors, read as bytes
        elif name.endswith("_ptr"):
            sig[name] = "*i32" if name in int_ptrs else "*" + cfg["dtype"]
        else:
            sig[name] = "fp32" if name == "qk_scale" else "i32"
    constexprs = {(fn.arg_names.index(k),): v for k, v in consts.items()}
    # Pointers and non-unit strides 16-divisible, as Triton specialises them at launch.
    attrs = {
        (fn.arg_names.index(n),): [["tt.divisibility", 16]]
        for n, t in sig.items() if t != "constexpr" and n not in ("num_reqs", "qk_scale")
    }
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    try:
        out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    except Exception as e:
        if "ptxas" in str(e) and "No such file" in str(e):
            print("SKIP: ptxas unavailable")
            sys.exit(0)
        raise
    assert out.asm.get("cubin"), cfg
    print("compiled", cfg)
"""


def test_triton_kernel_compiles_for_sm90() -> None:
    """The interpreter accepts code that the compiler rejects (e.g. loop-carried type changes),
    so also compile real sm_90 cubins with Triton's bundled ptxas -- no GPU needed --
    specialised the way a launch would be (unit strides and num_reqs == 1 become constants).
    Runs in a subprocess: a process that imported Triton with TRITON_INTERPRET=1 cannot
    generate code."""
    pytest.importorskip("triton.backends.nvidia")
    cfgs = [
        dict(dtype="bf16", head=128, rot=128, neox=True, qpk=4, bm=16, bn=32, causal=True),
        dict(dtype="fp32", head=80, rot=32, neox=False, qpk=3, bm=64, bn=32, causal=False),
        dict(dtype="bf16", head=64, rot=64, neox=True, qpk=3, bm=64, bn=32, causal=True,
             key_start=True),
        dict(dtype="bf16", head=128, rot=64, neox=False, qpk=4, bm=16, bn=32, causal=True,
             key_start=True, key_positions="i32"),
        dict(dtype="fp32", head=64, rot=64, neox=True, qpk=2, bm=64, bn=32, causal=False,
             key_positions="i64"),
        dict(dtype="bf16", head=128, rot=128, neox=True, qpk=4, bm=64, bn=32, causal=True,
             key_start=True, key_positions="i64", sink=True),
    ]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT, json.dumps(cfgs)],
        env=env, cwd=root, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if proc.stdout.startswith("SKIP"):
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("compiled") == len(cfgs), proc.stdout


def test_triton_tests_in_fresh_process() -> None:
    """Fallback for full-suite runs in which Triton was imported before this module could set
    TRITON_INTERPRET=1: rerun this file's Triton tests in a clean interpreter process."""
    if TRITON_HERE:
        pytest.skip("Triton tests ran in this process")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(__file__),
         "-k", "triton_matches or triton_grid or triton_non_causal or triton_ragged or "
         "triton_bf16 or shared_blocks"],
        env=env, cwd=root, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


# ------------------------------------------------------------------------------------------------
# Span isolation: a per-query first visible key (key_start)


def _span_key_starts(gen: torch.Generator, b: Batch, block_size: int) -> torch.Tensor:
    """Per query token, a random block-aligned ``key_start <= its position`` that is constant
    within a random segmentation of each request (what span isolation produces)."""
    starts = []
    qsl, lens = b.query_start_loc.tolist(), b.seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        n_blocks = -(-seq_len // block_size)
        marks = sorted({0, *(_randint(gen, 0, n_blocks - 1) for _ in range(2))})
        per_block = []
        for blk in range(n_blocks):
            lead = max(m for m in marks if m <= blk)
            isolated = _randint(gen, 0, 1) == 1 or lead == 0
            per_block.append(lead * block_size if isolated else 0)
        q_len = qsl[i + 1] - qsl[i]
        starts += [per_block[p // block_size] for p in range(seq_len - q_len, seq_len)]
    starts += [0] * (b.query.shape[0] - len(starts))  # padding rows
    return torch.tensor(starts, dtype=torch.int64)


def test_key_start_paged_ref_matches_dense_ref(seed: int) -> None:
    gen = _gen(seed)
    b = make_batch(gen, mixed_requests(gen) + [(40, 50), (0, 90)], 4, 2, 64, 16)
    table = _rope_table(256, 64, gen)
    key_start = _span_key_starts(gen, b, 16)
    assert key_start.any()
    scale = 64 ** -0.5
    paged = paged_attention_rope_ref(
        b.query, b.key_cache, b.value_cache, b.block_table, b.seq_lens, b.query_start_loc,
        table, 64, True, scale, key_start=key_start)  # fmt: skip
    dense = dense_attention_ref(b.query, b.keys, b.values, b.query_start_loc, table, 64, True,
                                scale, key_start=key_start)
    assert_close(paged, dense, 1e-5, seed, "paged vs dense with key_start")
    plain = run_ref(b, table, 64, True)
    assert rel_err(paged, plain) > 1e-3, "key_start must change some output"


@needs_triton
def test_key_start_triton_matches_reference(seed: int) -> None:
    gen = _gen(seed)
    b = make_batch(gen, mixed_requests(gen) + [(40, 50), (0, 90)], 6, 2, 64, 16)
    table = _rope_table(256, 32, gen)
    key_start = _span_key_starts(gen, b, 16)
    scale = 64 ** -0.5
    ref = paged_attention_rope_ref(
        b.query, b.key_cache, b.value_cache, b.block_table, b.seq_lens, b.query_start_loc,
        table, 32, False, scale, key_start=key_start)  # fmt: skip
    out = run_triton(b.to(DEVICE), table, 32, False,
                     key_start=key_start.to(DEVICE)).cpu()
    assert_close(out, ref, 1e-3, seed, "triton vs ref with key_start")


# ------------------------------------------------------------------------------------------------
# Rule 1: layout keys (markers, pads) invisible, real keys at logical positions (key_positions)


def _random_layout(gen: torch.Generator, b: Batch) -> list[torch.Tensor]:
    """Per request, a ``[seq_len]`` bool mask of layout keys: scattered marker-like keys at a
    per-request rate (0 to 50 %) plus one random pad-like run."""
    marks = []
    for seq_len in b.seq_lens.tolist():
        rate = _randint(gen, 0, 50) / 100
        layout = torch.rand(seq_len, generator=gen) < rate
        start = _randint(gen, 0, seq_len - 1)
        layout[start : start + _randint(gen, 0, 6)] = True
        marks.append(layout)
    return marks


def _key_positions(gen: torch.Generator, layout: list[torch.Tensor],
                   dtype: torch.dtype = torch.int64, poison: int = 10**6) -> torch.Tensor:
    """``[num_reqs, W]``: a real key's logical position is the number of real keys before it, a
    layout key gets a random negative entry. ``W`` exceeds the longest request by 0..3 columns,
    and columns past a request's ``seq_len`` hold ``poison`` (a row the rotary table lacks, so
    reading one fails)."""
    width = max(len(m) for m in layout) + _randint(gen, 0, 3)
    kp = torch.full((len(layout), width), poison, dtype=torch.int64)
    for i, m in enumerate(layout):
        real_before = (~m).long().cumsum(0) - 1
        negative = -torch.randint(1, 5, (len(m),), generator=gen)
        kp[i, : len(m)] = torch.where(m, negative, real_before)
    return kp.to(dtype)


def _layout_rows(b: Batch, layout: list[torch.Tensor]) -> list[tuple[int, int, int]]:
    """``(query row, request, key index)`` of every layout query in the batch."""
    rows = []
    qsl = b.query_start_loc.tolist()
    for i, seq_len in enumerate(b.seq_lens.tolist()):
        q_len = qsl[i + 1] - qsl[i]
        for t in range(q_len):
            p = seq_len - q_len + t
            if layout[i][p]:
                rows.append((qsl[i] + t, i, p))
    return rows


def _amplify_layout_keys(b: Batch, layout: list[torch.Tensor], block_size: int) -> None:
    """Scale layout keys and values by 50 in place (paged cache and contiguous copies), so any
    leak of a layout key into a real query's output is large."""
    for i, m in enumerate(layout):
        for j in m.nonzero().flatten().tolist():
            blk, off = int(b.block_table[i, j // block_size]), j % block_size
            b.key_cache[blk, off] *= 50
            b.value_cache[blk, off] *= 50
        b.keys[i][m] *= 50
        b.values[i][m] *= 50


@pytest.mark.parametrize("with_key_start", [True, False], ids=["key_start", "no_key_start"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non_causal"])
def test_layout_keys_paged_ref_matches_dense_ref(causal: bool, with_key_start: bool,
                                                 seed: int) -> None:
    """The paged reference (the CPU attention path) equals the independent SDPA formulation
    with random layouts: random layout keys and logical positions, random span key_start,
    mixed prefill / decode rows, GQA 3, random rotary fraction and style. Also: int32 and
    int64 positions agree bit for bit, identity positions with no layout key are bit-identical
    to no key_positions, and the layout does change the output."""
    gen = _gen(seed)
    rot, neox, b, table, key_start, layout = _random_layout_case(gen, with_key_start)
    kp = _key_positions(gen, layout)
    scale = 64**-0.5

    def paged(positions: torch.Tensor | None) -> torch.Tensor:
        return paged_attention_rope_ref(
            b.query, b.key_cache, b.value_cache, b.block_table, b.seq_lens, b.query_start_loc,
            table, rot, neox, scale, causal, key_start=key_start, key_positions=positions,
        )  # fmt: skip

    out = paged(kp)
    dense = dense_attention_ref(b.query, b.keys, b.values, b.query_start_loc, table, rot, neox,
                                scale, causal, key_start, key_positions=kp)
    assert_close(out, dense, 1e-5, seed, "paged vs dense with key_positions")
    assert torch.equal(out, paged(kp.to(torch.int32))), f"int32 vs int64 (seed={seed})"
    identity = torch.arange(kp.shape[1]).expand_as(kp).contiguous()
    assert torch.equal(paged(identity), paged(None)), f"identity positions (seed={seed})"
    if any(m.any() for m in layout):
        assert rel_err(out, paged(None)) > 1e-3, "layout keys must change some output"


def _random_layout_case(gen: torch.Generator, with_key_start: bool) -> tuple:
    """``(rot, neox, batch, table, key_start, layout)``: mixed prefill / decode rows, GQA 3, a
    random rotary fraction, style and table, random span key starts and layout keys."""
    rot, neox = [64, 32][_randint(gen, 0, 1)], bool(_randint(gen, 0, 1))
    b = make_batch(gen, mixed_requests(gen) + [(40, 50), (0, 90)], 6, 2, 64, 16)
    table = _rope_table(256, rot, gen, random_table=bool(_randint(gen, 0, 1)))
    key_start = _span_key_starts(gen, b, 16) if with_key_start else None
    return rot, neox, b, table, key_start, _random_layout(gen, b)


def _compaction_case(gen: torch.Generator) -> tuple:
    """``(rot, neox, batch, table, layout)`` for the compacted-sequence tests: heads 6 / 2,
    head size 64, blocks of 16, random rotary fraction and style, random layout keys."""
    rot, neox = [64, 32][_randint(gen, 0, 1)], bool(_randint(gen, 0, 1))
    b = make_batch(gen, mixed_requests(gen) + [(30, 40), (0, 70)], 6, 2, 64, 16)
    table = _rope_table(256, rot, gen)
    return rot, neox, b, table, _random_layout(gen, b)


def _mixed_and_decode(gen: torch.Generator, num_heads: int, num_kv_heads: int, head_size: int,
                      block_size: int, launch: dict) -> list[tuple]:
    """``(batch, launch)``: a mixed batch, and a decode-only one with the small-tile launch."""
    return [
        (make_batch(gen, mixed_requests(gen) + [(20, 30)], num_heads, num_kv_heads, head_size,
                    block_size, pad_tokens=2), launch),
        (make_batch(gen, [(_randint(gen, 0, 60), 1) for _ in range(4)], num_heads, num_kv_heads,
                    head_size, block_size), {**launch, "max_query_len": 1}),
    ]  # fmt: skip


def _triton_cases(cases: list[tuple]) -> pytest.MarkDecorator:
    """Parametrize a rule-1 Triton test by ``(heads, kv heads, head size, rot, neox, block,
    causal, key_start, position dtype, launch)`` cases."""
    return pytest.mark.parametrize(
        "num_heads,num_kv_heads,head_size,rot,neox,block_size,causal,with_key_start,kp_dtype,"
        "launch", cases,
        ids=[f"H{c[0]}-KV{c[1]}-D{c[2]}-R{c[3]}-B{c[5]}-{'causal' if c[6] else 'full'}"
             f"{'-ks' if c[7] else ''}-{str(c[8])[6:]}" for c in cases])


# (num_heads, num_kv_heads, head_size, rot, neox, block_size, causal, key_start, kp dtype, launch)
LAYOUT_TRITON_CASES = [
    (6, 2, 64, 32, False, 16, True, True, torch.int32, {}),
    (4, 4, 64, 64, True, 32, True, False, torch.int64, {"block_n": 16}),
    (2, 1, 80, 80, True, 16, False, True, torch.int64, {"block_n": 32}),
]


@needs_triton
@pytest.mark.parametrize("with_sink", [False, True], ids=["", "sink"])
@_triton_cases(LAYOUT_TRITON_CASES)
def test_layout_keys_triton_matches_reference(
    num_heads, num_kv_heads, head_size, rot, neox, block_size, causal, with_key_start, kp_dtype,
    launch, with_sink, seed,
) -> None:
    """The Triton kernel with key_positions equals the paged reference (random layouts, key
    tiles narrower and wider than a block, GQA, partial rotary, both position dtypes, with and
    without key_start, with and without sink keys and isolated queries), and on a decode-only
    batch (the small-tile launch); each layout query's output is its own value vector."""
    gen = _gen(seed)
    table = _rope_table(256, rot, gen, random_table=bool(_randint(gen, 0, 1)))
    scale = head_size**-0.5
    batches = _mixed_and_decode(gen, num_heads, num_kv_heads, head_size, block_size, launch)
    for b, kw in batches:
        key_start = _span_key_starts(gen, b, block_size) if with_key_start else None
        layout = _random_layout(gen, b)
        sinks: dict = {}
        if with_sink:
            kp, key_sink = _sink_positions(gen, layout, _random_sink(gen, layout), kp_dtype,
                                           poison=table.shape[0] - 1)
            sinks = {"key_sink": key_sink, "query_isolated": _random_isolated(gen, b)}
        else:
            kp = _key_positions(gen, layout, kp_dtype, poison=table.shape[0] - 1)
        ref = paged_attention_rope_ref(
            b.query, b.key_cache, b.value_cache, b.block_table, b.seq_lens, b.query_start_loc,
            table, rot, neox, scale, causal, key_start=key_start, key_positions=kp,
            **sinks)  # fmt: skip
        dev = b.to(DEVICE)
        out = run_triton(dev, table, rot, neox, causal,
                         key_start=None if key_start is None else key_start.to(DEVICE),
                         key_positions=kp.to(DEVICE),
                         **{k: v.to(DEVICE) for k, v in sinks.items()}, **kw).cpu()  # fmt: skip
        n = int(b.query_start_loc[-1])
        assert torch.isnan(out[n:]).all(), f"padding rows written (seed={seed})"
        what = f"triton vs ref with key_positions ({kw})"
        assert_close(out[:n], ref[:n], 1e-3, seed, what)
        # A layout query's only visible key gets probability exactly 1: P V is V, l is 1.
        for row, i, p in _layout_rows(b, layout):
            want = b.values[i][p].repeat_interleave(num_heads // num_kv_heads, dim=0)
            assert torch.equal(out[row], want), f"layout query row {row} (seed={seed})"


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non_causal"])
def test_layout_keys_equal_attention_over_compacted_sequence(causal: bool, seed: int) -> None:
    """What rule 1 is for: with the layout keys marked, every real query's output equals plain
    attention over the compacted sequence (layout keys removed, real keys at 0 .. n_real - 1),
    computed by the plain dense formulation without key_positions. Layout keys and values are
    scaled up so that any leak shows."""
    gen = _gen(seed)
    block_size, head_size = 16, 64
    rot, neox, b, table, layout = _compaction_case(gen)
    _amplify_layout_keys(b, layout, block_size)
    kp = _key_positions(gen, layout)
    scale = head_size**-0.5
    out = paged_attention_rope_ref(
        b.query, b.key_cache, b.value_cache, b.block_table, b.seq_lens, b.query_start_loc,
        table, rot, neox, scale, causal, key_positions=kp)  # fmt: skip

    # The compacted batch: real keys only; the real queries keep their (already rotated) rows.
    rows, q_lens, keys, values = [], [], [], []
    qsl = b.query_start_loc.tolist()
    for i, seq_len in enumerate(b.seq_lens.tolist()):
        real = ~layout[i]
        q_len = qsl[i + 1] - qsl[i]
        mine = [qsl[i] + t for t in range(q_len) if real[seq_len - q_len + t]]
        rows += mine
        q_lens.append(len(mine))
        keys.append(b.keys[i][real])
        values.append(b.values[i][real])
    assert rows, f"no real query drawn (seed={seed})"
    compact_qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    compact = dense_attention_ref(b.query[rows], keys, values, compact_qsl, table, rot, neox,
                                  scale, causal)
    assert_close(out[rows], compact, 1e-5, seed, "layout-marked vs compacted attention")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non_causal"])
def test_layout_query_output_is_its_own_value(causal: bool, seed: int) -> None:
    """A layout query sees only its own key (whatever its query vector, key_start or the
    causal setting), so its output is its own value vector, copied to every query head of the
    KV head's GQA group: exactly, in both references. Layout queries are forced in every
    request, including the first token of a sequence and a decode."""
    gen = _gen(seed)
    num_heads, num_kv_heads, block_size = 6, 2, 16
    group = num_heads // num_kv_heads
    b = make_batch(gen, mixed_requests(gen) + [(20, 30)], num_heads, num_kv_heads, 64,
                   block_size)
    table = _rope_table(256, 64, gen)
    key_start = _span_key_starts(gen, b, block_size)
    layout = _random_layout(gen, b)
    qsl = b.query_start_loc.tolist()
    for i, seq_len in enumerate(b.seq_lens.tolist()):
        q_len = qsl[i + 1] - qsl[i]
        layout[i][seq_len - q_len + _randint(gen, 0, q_len - 1)] = True
    kp = _key_positions(gen, layout)
    lrows = _layout_rows(b, layout)
    for row, _, _ in lrows:
        b.query[row] *= 30  # large scores everywhere: masking, not luck, must decide
    scale = 64**-0.5
    paged = paged_attention_rope_ref(
        b.query, b.key_cache, b.value_cache, b.block_table, b.seq_lens, b.query_start_loc,
        table, 64, True, scale, causal, key_start=key_start, key_positions=kp)  # fmt: skip
    dense = dense_attention_ref(b.query, b.keys, b.values, b.query_start_loc, table, 64, True,
                                scale, causal, key_start, key_positions=kp)
    assert len(lrows) >= len(qsl) - 1
    for row, i, p in lrows:
        want = b.values[i][p].repeat_interleave(group, dim=0)  # head h reads KV head h // group
        assert torch.equal(paged[row], want), f"paged: layout query row {row} (seed={seed})"
        assert torch.equal(dense[row], want), f"dense: layout query row {row} (seed={seed})"


# ------------------------------------------------------------------------------------------------
# The sink: a span's private copy of the model's opening, seen only by isolated queries


def _random_sink(gen: torch.Generator, layout: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per request, a ``[seq_len]`` bool mask of sink keys: one or two random runs (1 to 8
    keys) of non-layout keys, none in about a quarter of the requests."""
    sinks = []
    for m in layout:
        sink = torch.zeros_like(m)
        if _randint(gen, 0, 3) and len(m) > 1:
            for _ in range(_randint(gen, 1, 2)):
                start = _randint(gen, 0, len(m) - 1)
                sink[start : start + _randint(gen, 1, 8)] = True
        sinks.append(sink & ~m)
    return sinks


def _sink_positions(gen: torch.Generator, layout: list[torch.Tensor], sink: list[torch.Tensor],
                    dtype: torch.dtype = torch.int64, poison: int = 10**6,
                    sink_max: int = 200) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key_positions, key_sink)``, both ``[num_reqs, W]`` as :func:`_key_positions` lays them
    out: a real key's position counts the real keys before it (sink keys excluded, as if they
    were not there), a sink key gets a random position in ``[0, sink_max)`` (a virtual one: it
    may repeat a real key's), a layout key a random negative entry."""
    kp = _key_positions(gen, [m | s for m, s in zip(layout, sink, strict=True)], dtype, poison)
    key_sink = torch.zeros(kp.shape, dtype=torch.bool)
    for i, s in enumerate(sink):
        virtual = torch.randint(0, sink_max, (len(s),), generator=gen).to(dtype)
        kp[i, : len(s)] = torch.where(s, virtual, kp[i, : len(s)])
        key_sink[i, : len(s)] = s
    return kp, key_sink


def _random_isolated(gen: torch.Generator, b: Batch) -> torch.Tensor:
    """``[num_tokens]`` bool (padding rows included): each query row isolated or not, at a
    per-request rate (0 to 100 %)."""
    iso = torch.zeros(b.query.shape[0], dtype=torch.bool)
    qsl = b.query_start_loc.tolist()
    for i in range(len(qsl) - 1):
        rate = _randint(gen, 0, 4) / 4
        iso[qsl[i] : qsl[i + 1]] = torch.rand(qsl[i + 1] - qsl[i], generator=gen) < rate
    return iso


@pytest.mark.parametrize("with_key_start", [True, False], ids=["key_start", "no_key_start"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non_causal"])
def test_sink_keys_paged_ref_matches_dense_ref(causal: bool, with_key_start: bool,
                                               seed: int) -> None:
    """With sink keys (random runs among random layout keys) and random isolated queries, the
    paged reference equals the SDPA formulation. Also: no sink key marked, or every query
    isolated, is bit-identical to no ``key_sink`` (the sink keys are then real keys), and the
    sink does change some output when a non-isolated query could see a sink key."""
    gen = _gen(seed)
    rot, neox, b, table, key_start, layout = _random_layout_case(gen, with_key_start)
    sink = _random_sink(gen, layout)
    kp, key_sink = _sink_positions(gen, layout, sink)
    iso = _random_isolated(gen, b)
    scale = 64**-0.5

    def paged(ks: torch.Tensor | None, qi: torch.Tensor | None) -> torch.Tensor:
        return paged_attention_rope_ref(
            b.query, b.key_cache, b.value_cache, b.block_table, b.seq_lens, b.query_start_loc,
            table, rot, neox, scale, causal, key_start=key_start, key_positions=kp,
            key_sink=ks, query_isolated=qi,
        )  # fmt: skip

    out = paged(key_sink, iso)
    dense = dense_attention_ref(b.query, b.keys, b.values, b.query_start_loc, table, rot, neox,
                                scale, causal, key_start, key_positions=kp, key_sink=key_sink,
                                query_isolated=iso)
    assert_close(out, dense, 1e-5, seed, "paged vs dense with sink keys")
    plain = paged(None, None)
    assert torch.equal(paged(torch.zeros_like(key_sink), iso), plain), f"no sink (seed={seed})"
    assert torch.equal(paged(key_sink, torch.ones_like(iso)), plain), f"all isolated ({seed})"
    if any(s.any() for s in sink) and not iso[: int(b.query_start_loc[-1])].all():
        # only a test of the mask when some non-isolated query has a sink key in range
        seen = _sink_seen_by_non_isolated(b, sink, iso, causal, key_start, kp)
        if seen:
            assert rel_err(out, plain) > 1e-4, f"the sink must change some output ({seed})"


def _sink_seen_by_non_isolated(b: Batch, sink: list[torch.Tensor], iso: torch.Tensor,
                               causal: bool, key_start: torch.Tensor | None,
                               key_positions: torch.Tensor) -> bool:
    """Whether some non-isolated real query has a sink key (not its own) in its visible range.
    A layout query (negative position) sees only itself under rule 1, so it never counts."""
    qsl = b.query_start_loc.tolist()
    for i, seq_len in enumerate(b.seq_lens.tolist()):
        q_len = qsl[i + 1] - qsl[i]
        for t in range(q_len):
            row, p = qsl[i] + t, seq_len - q_len + t
            lo = 0 if key_start is None else int(key_start[row])
            hi = p + 1 if causal else seq_len
            idx = [j for j in sink[i][lo:hi].nonzero().flatten().add(lo).tolist() if j != p]
            if not iso[row] and idx and int(key_positions[i, p]) >= 0:
                return True
    return False


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non_causal"])
def test_sink_keys_seen_only_by_isolated_queries(causal: bool, seed: int) -> None:
    """What the sink's mask is for. A real query that is not isolated attends exactly as over
    the compacted sequence with the layout keys *and* the sink keys removed (real keys at
    0 .. n_real - 1; the plain dense formulation, no key_positions); an isolated real query
    attends as over the sequence with only the layout keys removed, the sink keys at their
    positions -- so dropping the sink changes its output. Layout and sink keys and values are
    scaled up so that a leak, or a missing sink, shows."""
    gen = _gen(seed)
    block_size, head_size = 16, 64
    rot, neox, b, table, layout = _compaction_case(gen)
    sink = _random_sink(gen, layout)
    iso = _random_isolated(gen, b)
    # The last request (a 70-token prefill): a sink run at 5..9, then query 30 isolated and
    # query 31 not, both real, so each kind is drawn in every run.
    layout[-1][5:10] = False
    layout[-1][30:32] = False
    sink[-1][:] = False
    sink[-1][5:10] = True
    last = int(b.query_start_loc[-2])
    iso[last + 30], iso[last + 31] = True, False
    _amplify_layout_keys(b, [m | s for m, s in zip(layout, sink, strict=True)], block_size)
    kp, key_sink = _sink_positions(gen, layout, sink)
    scale = head_size**-0.5
    out = paged_attention_rope_ref(
        b.query, b.key_cache, b.value_cache, b.block_table, b.seq_lens, b.query_start_loc,
        table, rot, neox, scale, causal, key_positions=kp, key_sink=key_sink,
        query_isolated=iso)  # fmt: skip

    # Per kind of query, the compacted batch of the keys it attends over. Every kept key in a
    # request's query window stays a query (the dense formulation aligns queries to the end of
    # the keys); only the real queries of that kind are compared.
    qsl = b.query_start_loc.tolist()
    for isolated in (False, True):
        rows, q_lens, keys, values, positions, compared = [], [], [], [], [], []
        for i, seq_len in enumerate(b.seq_lens.tolist()):
            real = ~layout[i] & ~sink[i]
            kept = ~layout[i] if isolated else real
            q_len = qsl[i + 1] - qsl[i]
            mine = [qsl[i] + t for t in range(q_len) if kept[seq_len - q_len + t]]
            compared += [len(rows) + k for k, row in enumerate(mine)
                         if real[seq_len - q_len + row - qsl[i]] and bool(iso[row]) == isolated]
            rows += mine
            q_lens.append(len(mine))
            keys.append(b.keys[i][kept])
            values.append(b.values[i][kept])
            positions.append(kp[i, :seq_len][kept])
        compact_qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(),
                                   dtype=torch.int32)
        compact_kp = None
        if isolated:  # the sink keys at their own (virtual) positions
            compact_kp = torch.zeros(len(positions), max(len(p) for p in positions),
                                     dtype=torch.int64)
            for i, p in enumerate(positions):
                compact_kp[i, : len(p)] = p
        want = dense_attention_ref(b.query[rows], keys, values, compact_qsl, table, rot, neox,
                                   scale, causal, key_positions=compact_kp)
        what = "isolated" if isolated else "non-isolated"
        assert compared, f"no {what} real query drawn (seed={seed})"
        assert_close(out[rows][compared], want[compared], 1e-5, seed,
                     f"{what} queries vs their compacted keys")
    # Dropping the sink (every query non-isolated) changes the isolated query that sees it.
    dropped = paged_attention_rope_ref(
        b.query, b.key_cache, b.value_cache, b.block_table, b.seq_lens, b.query_start_loc,
        table, rot, neox, scale, causal, key_positions=kp, key_sink=key_sink,
        query_isolated=torch.zeros_like(iso))  # fmt: skip
    assert rel_err(out[last + 30], dropped[last + 30]) > 1e-2, f"sink unseen (seed={seed})"
    assert torch.equal(out[last + 31], dropped[last + 31]), f"seed={seed}"


def test_sink_arguments_are_checked() -> None:
    """key_sink and query_isolated come together, only with key_positions, with the right
    shapes and dtypes; every entry point says so before computing anything."""
    gen = _gen(0)
    b = make_batch(gen, [(3, 2), (0, 4)], 2, 1, 16, 16)
    table = _rope_table(64, 16, gen)
    kp = torch.arange(8).repeat(2, 1)
    ks, iso = torch.zeros(2, 8, dtype=torch.bool), torch.zeros(6, dtype=torch.bool)
    bad = [
        (dict(key_positions=kp, key_sink=ks), "together"),
        (dict(key_positions=kp, query_isolated=iso), "together"),
        (dict(key_sink=ks, query_isolated=iso), "key_positions"),
        (dict(key_positions=kp, key_sink=ks[:, :7], query_isolated=iso), "key_sink"),
        (dict(key_positions=kp, key_sink=ks.int(), query_isolated=iso), "key_sink"),
        (dict(key_positions=kp, key_sink=ks, query_isolated=iso[:5]), "query_isolated"),
        (dict(key_positions=kp, key_sink=ks, query_isolated=iso.int()), "query_isolated"),
    ]
    args = (b.query, b.key_cache, b.value_cache, b.block_table, b.seq_lens, b.query_start_loc,
            table, 16, True, 0.25)
    dense_args = (b.query, b.keys, b.values, b.query_start_loc, table, 16, True, 0.25)
    for kw, msg in bad:
        for fn, a in ((paged_attention_rope_ref, args), (dense_attention_ref, dense_args),
                      (paged_attention_rope_triton, args)):
            with pytest.raises(ValueError, match=msg):
                fn(*a, **kw)


# ------------------------------------------------------------------------------------------------
# Keys stored once, rotated at home: moving them to another position equals rotating once


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rotate_by_offset_equals_rotating_once(case: str, vllm_get_rope, seed: int) -> None:
    """``rotate_by_offset(R(h) k~, p - h) == R(p) k~`` and ``unrotate(R(h) k~, h) == k~`` for
    every rotary variant the backend accepts: neox and gptj, partial rotary (the other dims
    pass through), llama3 / linear tables, and YaRN, whose table folds ``mscale`` into cos/sin
    (it must be applied once, not twice). Offsets of both signs (a span read earlier or later
    than it was written). fp32: the difference of rotating twice vs once is rounding-level."""
    from minipic.kernels import rotate_by_offset, unrotate

    gen = _gen(seed)
    rope = vllm_get_rope(dtype=torch.float32, **ROPE_CASES[case])
    table, rot, neox = rope.cos_sin_cache, rope.rotary_dim, rope.is_neox_style
    n_tok, n_heads = 41, 3
    home = torch.randint(0, table.shape[0], (n_tok,), generator=gen)
    target = torch.randint(0, table.shape[0], (n_tok,), generator=gen)
    k = torch.randn(n_tok, n_heads, rope.head_size, generator=gen)

    def native(pos: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return rope.forward_native(pos, x.reshape(n_tok, -1).clone(), None)[0].view_as(x)

    at_home = native(home, k)
    moved = rotate_by_offset(at_home, target - home, table, rot, neox)
    once = native(target, k)
    scale = float(table[0, 0])
    if case == "yarn":
        assert scale != 1.0, "the YaRN case must exercise a folded scale"
    # moving reads two table rows (home, offset) where rotating once reads one: three angle
    # errors apart (measured over 4000 keys: max 1.2e-4 of the key's largest element at 2k
    # positions, 3.8e-4 at 8k; median 1.5e-5 / 6.9e-5); unrotating reads two
    rel = float((moved - once).abs().max() / k.abs().max())
    check(rel, table_angle_tolerance(table.shape[0], rows=3), f"{case}: rotating twice vs once",
          seed)
    if rot < rope.head_size:
        assert torch.equal(moved[..., rot:], k[..., rot:]), "non-rotary dims must pass through"
    back_home = unrotate(at_home, home, table, rot, neox)
    check(float((back_home - k).abs().max() / k.abs().max()),
          table_angle_tolerance(table.shape[0], rows=2), f"{case}: unrotate", seed)
    # moving by zero is the identity, and moving there and back returns the key
    assert torch.equal(rotate_by_offset(at_home, torch.zeros_like(home), table, rot, neox),
                       at_home)
    back = rotate_by_offset(moved, home - target, table, rot, neox)
    check(float((back - at_home).abs().max() / k.abs().max()),
          table_angle_tolerance(table.shape[0], rows=2), f"{case}: there and back", seed)


def test_cpu_kv_layout_round_trips_vllm_writer(seed: int) -> None:
    """The measured page layout reads back exactly what vLLM's C++ writer stored, for every
    dtype (the bf16 pages use another packing on AMX hosts), and packs plain keys into the
    layout the writer would have produced."""
    pytest.importorskip("vllm")
    import vllm.v1.attention.backends.cpu_attn as cpu_attn
    from vllm import _custom_ops as ops

    from minipic.engine_ext.attention.cpu_kv_layout import probe

    gen = _gen(seed)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for block, head in ((32, 64), (64, 128)):
            isa = cpu_attn._get_attn_isa(dtype, block, head)
            layout = probe(isa, dtype, block, head)
            keys = torch.randn(3 * block, 2, head, generator=gen).to(dtype)
            values = torch.randn(3 * block, 2, head, generator=gen).to(dtype)
            page = torch.zeros(3, 2, 2 * block, head, dtype=dtype)
            key_cache, value_cache = page.chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache,
                                           torch.arange(3 * block), isa)
            plain = keys.view(3, block, 2, head).transpose(1, 2)  # [blocks, heads, bs, D]
            what = f"{dtype} isa={isa} block={block} head={head}"
            assert torch.equal(layout.plain_keys(key_cache), plain), what
            assert torch.equal(layout.plain_values(value_cache),
                               values.view(3, block, 2, head).transpose(1, 2)), what
            assert torch.equal(layout.packed_keys(plain).view_as(key_cache), key_cache), what
            # token rows of some blocks (one block too: vLLM's ops need dense rows)
            for blocks in (torch.tensor([1]), torch.tensor([2, 0])):
                rows = layout.token_keys(key_cache, blocks)
                assert rows.is_contiguous(), what
                want = keys.view(3, block, 2 * head)[blocks].reshape(-1, 2 * head)
                assert torch.equal(rows, want), what
            # single tokens picked straight from the pages (the masked rows' kept copy), where
            # the layout is a plain matrix (None: the caller reads whole pages instead)
            tokens = torch.randperm(3 * block, generator=gen)[: block + 3]
            picked = layout.tokens_at(page, tokens // block, tokens % block)
            if picked is not None:
                assert all(t.is_contiguous() for t in picked), what
                assert torch.equal(picked[0], keys[tokens]), what
                assert torch.equal(picked[1], values[tokens]), what
            elif isa == "vec":
                raise AssertionError(f"{what}: the vector kernels' pages are plain matrices")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_move_keys_into_the_shadow_equals_rotating_once(case: str, dtype: torch.dtype,
                                                        vllm_get_rope, seed: int) -> None:
    """The off-home fill (``cpu_backend.move_keys``): keys vLLM's writer cached
    rotated at their home, moved into a target page set (the key shadow) by a per-block
    offset, read back through the measured layout, equal the keys rotated once at the read
    position, for every rotary variant. Rotating on the pages (column-major keys, neox) and on
    token rows are the same arithmetic: bit-identical wherever both apply. Values and the
    target's other pages are not touched."""
    import vllm.v1.attention.backends.cpu_attn as cpu_attn
    from vllm import _custom_ops as ops

    from minipic.engine_ext.attention.cpu_backend import move_keys
    from minipic.engine_ext.attention.cpu_kv_layout import probe
    from minipic.engine_ext.attention.step_plan import RotatedFill

    gen = _gen(seed)
    rope = vllm_get_rope(dtype=dtype, **ROPE_CASES[case])
    head, heads, block, num_blocks = rope.head_size, 2, 32, 12
    isa = cpu_attn._get_attn_isa(dtype, block, head)
    layout = probe(isa, dtype, block, head)
    max_pos = rope.cos_sin_cache.shape[0]
    home_slot = torch.randint(0, max_pos // block, (num_blocks,), generator=gen)
    k = torch.randn(num_blocks * block, heads, head, generator=gen)
    v = torch.randn(num_blocks * block, heads, head, generator=gen).to(dtype)
    home = (home_slot.unsqueeze(1) * block + torch.arange(block)).flatten()

    def native(pos: torch.Tensor) -> torch.Tensor:
        return rope.forward_native(pos, k.reshape(k.shape[0], -1).to(dtype).clone(),
                                   None)[0].view_as(k)

    cache = torch.zeros(num_blocks, heads, 2 * block, head, dtype=dtype)
    key_cache, value_cache = cache.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(native(home), v, key_cache, value_cache,
                                   torch.arange(num_blocks * block), isa)
    blocks = torch.randperm(num_blocks, generator=gen)[: num_blocks // 2]
    read_slot = torch.randint(0, max_pos // block, (blocks.numel(),), generator=gen)
    offsets = (read_slot - home_slot[blocks]) * block
    dest = torch.randperm(num_blocks, generator=gen)[: blocks.numel()]
    moved = {}
    for on_pages in (False, True):
        if on_pages and not (layout.column_major_keys() and rope.is_neox_style):
            continue
        target = torch.full_like(cache, 7.0)
        fill = RotatedFill(copy_blocks=torch.zeros(0, dtype=torch.long),
                           copy_dest=torch.zeros(0, dtype=torch.long), blocks=blocks,
                           offsets=offsets, dest=dest)
        move_keys(layout, key_cache, fill, rope, target.chunk(2, dim=2)[0], on_pages)
        others = torch.ones(num_blocks, dtype=torch.bool)
        others[dest] = False
        assert bool((target[others] == 7.0).all()) and bool((target[:, :, block:] == 7.0).all())
        moved[on_pages] = layout.plain_keys(target.chunk(2, dim=2)[0][dest])
    want_pos = (read_slot.unsqueeze(1) * block + torch.arange(block)).flatten()
    want = native(torch.zeros(num_blocks * block, dtype=torch.long).index_copy(
        0, (blocks.unsqueeze(1) * block + torch.arange(block)).flatten(), want_pos))
    want = want.view(num_blocks, block, heads, head)[blocks].transpose(1, 2)
    if True in moved:
        assert torch.equal(moved[True], moved[False]), f"{case}: the two ways differ"
    err = float((moved[False].float() - want.float()).abs().max())
    if dtype == torch.float32:
        # the table's angle errors, as in test_rotate_by_offset_equals_rotating_once
        tol = table_angle_tolerance(max_pos, rows=3) * float(want.abs().max())
    else:
        # bf16, in half-spacings h of bf16 at M, the largest magnitude any intermediate reaches
        # (a rotation pair's norm, <= sqrt(2) x the largest element). Rotating once in vLLM's
        # native bf16 arithmetic rounds two products and their sum (3 h) and reads cos/sin
        # rounded in the table (<= 2 x 1.75 h: YaRN folds mscale ~1.14 into them, so they
        # reach the next binade): 6.5 h per element. The moved key was rotated that way at
        # home, and that error (a pair's: <= sqrt(2) x 6.5 h) is carried through the move's
        # rotation, which adds its own rounded table (<= 1.4 h) and result (1 h): 11.6 h.
        # Their difference: <= 18.1 h = 9.1 spacings; 12 spacings leaves a third for margin.
        tol = 12 * ulp(2**0.5 * float(want.float().abs().max()), dtype)
    check(err, tol, f"{case} {dtype}: moved vs rotated once", seed)
