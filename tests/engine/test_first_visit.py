"""A document's first visit in the CPU backend: a span's own tokens on vLLM's kernel over a copy
of their span's keys, the masked torch path chunked, and the kept copies of the decoding
queries shared by a request's rows and freed with the request (docs/design.md §1, §2).

Every step runs the real ``MinipicCPUAttentionImpl`` with vLLM's C++ kernel and writer on a
synthetic paged cache (``support/cpu_attention.py``), against the dense reference
(``kernels.dense_attention_ref``) under the layout rule, laid out here independently of the
engine's own derivation: a layout token (SSEP, PAD, PDEP) is seen by no query but its own and
takes no position, a real token sits at ``shift +`` the real tokens before it, a span's sink sits
on the positions just before its first real token and is seen by its own span only, a span's
tokens see their own segment only. Random keys, values and queries from a fresh seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from support.cpu_attention import CpuAttention, neox_rope
from support.tolerances import check_close, ulp

KV_HEADS, HEADS, HEAD, BLOCK = 2, 4, 64, 32
SINK = 24  # SmolLM2's opening, copied after each span's SSEP
# fp32: a few thousand keys summed in another order than the reference's; bf16: its rounding
ULPS = {torch.float32: 128, torch.bfloat16: 8}


@dataclass
class Layout:
    """A prompt's layout under rule 1, per token: what the reference and the span view need."""

    key_positions: torch.Tensor  # [n] int64 (-1: layout)
    sink: torch.Tensor  # [n] bool
    isolated: torch.Tensor  # [n] bool: inside an SSEP-led segment
    key_start: torch.Tensor  # [n] int64: the first key each token may see

    @property
    def size(self) -> int:
        return self.key_positions.numel()


def lay_out(system: int, spans: list[int], question: int) -> Layout:
    """``system`` real tokens padded to a block, then each span (SSEP, sink, ``spans[i]`` real
    tokens, pads to a block), then PDEP and ``question`` real tokens (``system`` 0: the prompt
    starts with the first span, as a span prefill does)."""
    kinds: list[str] = []  # "real", "layout", "sink"
    starts: list[int] = []
    isolated: list[bool] = []

    def pad() -> None:
        while len(kinds) % BLOCK:
            kinds.append("layout")
            starts.append(starts[-1])
            isolated.append(isolated[-1])

    if system:
        kinds += ["real"] * system
        starts += [0] * system
        isolated += [False] * system
        pad()
    for length in spans:
        begin = len(kinds)
        kinds += ["layout"] + ["sink"] * SINK + ["real"] * length
        starts += [begin] * (1 + SINK + length)
        isolated += [True] * (1 + SINK + length)
        pad()
    if question:
        kinds += ["layout"] + ["real"] * question
        starts += [0] * (1 + question)
        isolated += [False] * (1 + question)
    positions, real_before, sink_at = [], 0, 0
    shift = SINK if spans else 0
    for kind in kinds:
        if kind == "layout":
            positions.append(-1)
            sink_at = 0
        elif kind == "sink":
            positions.append(real_before + sink_at)
            sink_at += 1
        else:
            positions.append(real_before + shift)
            real_before += 1
    return Layout(torch.tensor(positions), torch.tensor([k == "sink" for k in kinds]),
                  torch.tensor(isolated), torch.tensor(starts))


@dataclass
class Request:
    """One request's tensors: queries unrotated, keys and values, its layout and table."""

    name: str
    layout: Layout
    query: torch.Tensor  # [n, HEADS, HEAD] unrotated
    keys: torch.Tensor  # [n, KV_HEADS, HEAD]
    values: torch.Tensor
    table: torch.Tensor  # [blocks] int32

    def expected(self, rope) -> torch.Tensor:
        """The dense reference for every token of the request."""
        from minipic.kernels import dense_attention_ref, rotate

        lay = self.layout
        args = (rope.cos_sin_cache, rope.rotary_dim, rope.is_neox_style)
        at = lay.key_positions.clamp(min=0)
        return dense_attention_ref(
            rotate(self.query, at, *args), [self.keys], [self.values],
            torch.tensor([0, lay.size], dtype=torch.int32), *args, HEAD**-0.5,
            key_start=lay.key_start, key_positions=lay.key_positions[None],
            key_sink=lay.sink[None], query_isolated=lay.isolated)


def make_request(gen: torch.Generator, name: str, layout: Layout, first_block: int,
                 dtype: torch.dtype) -> Request:
    n = layout.size
    blocks = -(-n // BLOCK)
    return Request(name, layout, torch.randn(n, HEADS, HEAD, generator=gen).to(dtype),
                   torch.randn(n, KV_HEADS, HEAD, generator=gen).to(dtype),
                   torch.randn(n, KV_HEADS, HEAD, generator=gen).to(dtype),
                   torch.arange(first_block, first_block + blocks, dtype=torch.int32))


def run_step(attn: CpuAttention, rope, requests: list[tuple[Request, int, int]]
             ) -> torch.Tensor:
    """One engine step: each request computes its tokens ``start .. end - 1`` (queries rotated
    at their physical positions, as the model does; the backend moves them)."""
    from minipic.engine_ext.attention.span_isolation import SpanView
    from minipic.kernels import rotate

    args = (rope.cos_sin_cache, rope.rotary_dim, rope.is_neox_style)
    qsl, lens, queries, keys, values, slots = [0], [], [], [], [], []
    shifts, starts, isolated, names = [], [], [], []
    width = max(end for _, _, end in requests)
    table = torch.zeros(len(requests), max(req.table.numel() for req, _, _ in requests),
                        dtype=torch.int32)
    key_positions = torch.zeros(len(requests), width, dtype=torch.int64)
    key_sink = torch.zeros(len(requests), width, dtype=torch.bool)
    for r, (req, start, end) in enumerate(requests):
        lay = req.layout
        physical = torch.arange(start, end)
        qsl.append(qsl[-1] + end - start)
        lens.append(end)
        queries.append(rotate(req.query[start:end], physical, *args))
        keys.append(req.keys[start:end])
        values.append(req.values[start:end])
        slots.append(req.table[physical // BLOCK].long() * BLOCK + physical % BLOCK)
        shifts.append(lay.key_positions[start:end].clamp(min=0) - physical)
        starts.append(lay.key_start[start:end])
        isolated.append(lay.isolated[start:end])
        table[r, :req.table.numel()] = req.table
        key_positions[r, :end] = lay.key_positions[:end]
        key_sink[r, :end] = lay.sink[:end]
        names.append(req.name)
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    slots_t = torch.cat(slots)
    view = SpanView(key_start=torch.cat(starts), masked=torch.ones(len(requests), dtype=torch.bool),
                    key_positions=key_positions, query_shift=torch.cat(shifts),
                    key_sink=key_sink, query_isolated=torch.cat(isolated), req_ids=names)
    plan = attn.plan(qsl_t, lens_t, table, slots_t, key_start=view.key_start, view=view)
    assert plan.masked is not None
    return attn.forward(torch.cat(queries), torch.cat(keys), torch.cat(values), qsl_t, lens_t,
                        table, slots_t, plan)


def check(out: torch.Tensor, want: torch.Tensor, values: torch.Tensor, dtype: torch.dtype,
          what: str, seed: int) -> None:
    """An output row is a weighted sum of values, so its rounding is counted in spacings at the
    values' scale, not at the output's: over thousands of keys the sum cancels to ~1/50 of a
    value while each term still rounds at the value's own magnitude."""
    scale = max(float(want.abs().max()), float(values.abs().max()))
    check_close(out, want, atol=ULPS[dtype] * ulp(scale, dtype), rtol=0.0, what=what, seed=seed)


@pytest.mark.fast
def test_a_6k_span_prefill_equals_the_reference(seed: int, monkeypatch) -> None:
    """A span prefill of ~6k tokens (SSEP, sink, document, pads), computed in two chunks as
    vLLM's chunked prefill sends it: on vLLM's kernel over a copy of the span's keys, and on the
    masked torch path with its chunks forced to a few queries, so that chunk boundaries fall
    everywhere. Both equal the dense reference."""
    from minipic.span_contract.env import MASKED_CHUNK_ENV, SPAN_ROWS_ENV

    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float32
    rope = neox_rope(HEAD, dtype, max_position=8192)
    document = 6000 + int(torch.randint(0, 100, (1,), generator=gen))
    layout = lay_out(0, [document], 0)
    req = make_request(gen, "span", layout, 1, dtype)
    want = req.expected(rope)
    cut = int(torch.randint(BLOCK, layout.size - BLOCK, (1,), generator=gen))
    # 1 MiB of scores: 5 queries of ~6k keys per chunk
    monkeypatch.setenv(MASKED_CHUNK_ENV, "1024")
    for rows in ("kernel", "masked"):
        monkeypatch.setenv(SPAN_ROWS_ENV, rows)
        attn = CpuAttention("auto", dtype, rope, None, monkeypatch, heads=HEADS,
                            kv_heads=KV_HEADS, head=HEAD, block=BLOCK,
                            blocks=-(-layout.size // BLOCK) + 2)
        for start, end in ((0, cut), (cut, layout.size)):
            out = run_step(attn, rope, [(req, start, end)])
            check(out, want[start:end], req.values, dtype,
                  f"{rows} rows, tokens {start}-{end}", seed)


@pytest.mark.fast
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cold_finals_with_and_without_copy_blocks_equal_the_reference(
        dtype: torch.dtype, seed: int, monkeypatch) -> None:
    """Several cold finals (system prompt, three spans computed in place, question) in one step,
    then decoded together: with no blocks reserved for their copies (as for a request the
    scheduler gave none) every step builds a copy for the step; with blocks reserved, each
    request keeps one copy in them across its steps; a request that leaves the batch
    (finished, aborted, preempted) has its copy forgotten at the next step, and at the first
    step without any span request the rest go too. Every step equals the reference."""
    gen = torch.Generator().manual_seed(seed)
    rope = neox_rope(HEAD, dtype)
    count = 4
    layouts = [lay_out(int(torch.randint(3, 40, (1,), generator=gen)),
                       [int(x) for x in torch.randint(20, 120, (3,), generator=gen)],
                       int(torch.randint(2, 20, (1,), generator=gen)) + 2)
               for _ in range(count)]
    sizes = [-(-lay.size // BLOCK) for lay in layouts]
    for reserved in (False, True):
        # the requests' own blocks, then as many again for their copies
        attn = CpuAttention("auto", dtype, rope, None, monkeypatch, heads=HEADS,
                            kv_heads=KV_HEADS, head=HEAD, block=BLOCK, blocks=2 * sum(sizes) + 1)
        firsts = [1 + sum(sizes[:i]) for i in range(count)]
        reqs = [make_request(gen, f"r{i}", lay, first, dtype)
                for i, (lay, first) in enumerate(zip(layouts, firsts, strict=True))]
        if reserved:
            for req, size, first in zip(reqs, sizes, firsts, strict=True):
                copy = first + sum(sizes)
                attn.reserve(req.name, list(range(copy, copy + size)))
        wants = [req.expected(rope) for req in reqs]
        kept = attn.kept.held  # the group's kept copies, by request
        # the prompts without their last two tokens, then two "decode" steps of one token
        steps = [[(req, 0, req.layout.size - 2) for req in reqs],
                 [(req, req.layout.size - 2, req.layout.size - 1) for req in reqs],
                 [(req, req.layout.size - 1, req.layout.size) for req in reqs[1:]]]
        held = []
        for number, step in enumerate(steps):
            out = run_step(attn, rope, step)
            at = 0
            for req, start, end in step:
                check(out[at:at + end - start], wants[int(req.name[1:])][start:end], req.values,
                      dtype, f"reserved {reserved}, step {number}, {req.name}", seed)
                at += end - start
            held.append(dict(kept))
        if reserved:
            assert all(held[0][r.name] is held[1][r.name] for r in reqs), \
                f"a copy was rebuilt between steps (seed={seed})"
            assert "r0" not in held[2] and all(r.name in held[2] for r in reqs[1:]), \
                f"r0 left the batch but its copy stayed (seed={seed})"
            assert attn.kept.transient_rows == 0, f"seed={seed}"
            plain = torch.tensor([0, 1], dtype=torch.int32)
            lens = torch.tensor([1], dtype=torch.int32)
            table = torch.tensor([[0]], dtype=torch.int32)
            slots = torch.tensor([0])
            plan = attn.plan(plain, lens, table, slots)
            assert plan.masked is None
            attn.forward(torch.randn(1, HEADS, HEAD, generator=gen).to(dtype),
                         torch.randn(1, KV_HEADS, HEAD, generator=gen).to(dtype),
                         torch.randn(1, KV_HEADS, HEAD, generator=gen).to(dtype),
                         plain, lens, table, slots, plan)
            assert not kept and attn.kept.used_pages == 0, \
                f"copies outlived every span request: {list(kept)} (seed={seed})"
        else:
            assert not any(held), f"copies kept with no blocks reserved (seed={seed})"
            assert attn.kept.transient_rows >= 2 * count, f"seed={seed}"


@pytest.mark.engine
@pytest.mark.shares("tiny_pic")
def test_a_request_aborted_mid_decode_frees_its_copy(engines, seed: int) -> None:
    """In a real engine (tiny Llama, plugin on): a span request decoding holds its kept copy in
    KV-cache blocks the scheduler reserved with it; aborted mid-decode, the worker forgets the
    copy once the engine runs its next step (a plain request here) and the scheduler has every
    block back (vLLM resets the prefix cache only when no block is in use)."""
    import random

    from support.pic_engine import pic_sampling, prefill, random_prompt

    from minipic.span_contract.engine_utilities import KEY_SHADOW_STATS_RPC

    llm = engines.get("tiny_pic")
    rng = random.Random(seed)
    vocab = llm.get_tokenizer().vocab_size
    prompt = random_prompt(llm, rng, vocab, [rng.randrange(20, 90) for _ in range(3)])
    prefill(llm, prompt.span_prefills)

    def kept(key: str) -> int:
        return sum(reply[key] for reply in llm.collective_rpc(KEY_SHADOW_STATS_RPC))

    transient = kept("kept_transient_rows")
    engine = llm.llm_engine
    engine.add_request(f"abort-{seed}", {"prompt_token_ids": list(prompt.token_ids)},
                       pic_sampling(max_tokens=64, logprobs=0, ignore_eos=True))
    for _ in range(6):  # the prompt, then a few decode steps
        engine.step()
    held = kept("kept_pages")
    assert held > 0, f"a decoding span request held no kept copy (seed={seed})"
    assert kept("kept_transient_rows") == transient, \
        f"a request with reserved blocks built a copy per step (seed={seed})"
    engine.abort_request([f"abort-{seed}"])
    while engine.has_unfinished_requests():
        engine.step()
    plain = [rng.randrange(100, vocab) for _ in range(40)]
    llm.generate([{"prompt_token_ids": plain}], pic_sampling(max_tokens=2, opt_in=False),
                 use_tqdm=False)
    assert kept("kept_pages") == 0, f"the aborted request's {held} pages stayed held ({seed})"
    assert llm.reset_prefix_cache(), f"blocks stayed in use after the abort (seed={seed})"
