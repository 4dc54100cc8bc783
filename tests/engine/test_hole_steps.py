"""All holes of a prompt in one engine step: the plan, and both attention backends on it.

* ``plan_holes`` equals a token-by-token oracle (every uncached token after the computed
  prefix, the first ``budget`` of them, grouped in runs) on fresh random run layouts;
* one step in which a request computes three holes around two cached blocks (one of them an
  isolated span, one read off its home slot), next to a plain request: the CPU backend (its
  C++ kernel rows, the scratch path and the torch reference path) and the CUDA backend's Triton
  kernel (Triton's interpreter here) equal the dense reference in which each hole is a request
  of its own reading keys up to its last token — exactly what one hole per step computed.

The engine side (step counts from the scheduler, preemption, abort, mixed batches, the
references) is ``tests/engine/test_hole_steps_engine.py``.
"""

from __future__ import annotations

import random
import types

import pytest
import torch
from support.cpu_attention import CpuAttention, neox_rope
from support.tolerances import check_close

from minipic.engine_ext.holes.scheduler_steps import plan_holes
from minipic.engine_ext.vllm_surface.added_names import CACHED_RUNS_ATTR

pytestmark = pytest.mark.fast

KV_HEADS, HEADS, HEAD, BLOCK = 2, 4, 64, 32


def _oracle(cached: set[int], computed: int, budget: int, num_tokens: int
            ) -> list[tuple[int, int]]:
    """Holes by brute force: walk the tokens, take uncached ones until the budget is spent."""
    holes: list[list[int]] = []
    left = budget
    for t in range(computed, num_tokens):
        if left == 0:
            break
        if t // BLOCK in cached:
            continue
        if holes and holes[-1][1] == t:
            holes[-1][1] += 1
        else:
            holes.append([t, t + 1])
        left -= 1
    return [(a, b) for a, b in holes]


@pytest.mark.parametrize("trial", range(20))
def test_plan_holes_equals_token_oracle(trial: int, seed: int) -> None:
    rng = random.Random(seed * 100 + trial)
    num_blocks = rng.randrange(3, 40)
    num_tokens = (num_blocks - 1) * BLOCK + rng.randrange(1, BLOCK + 1)
    computed_blocks = rng.randrange(0, num_blocks - 1)
    computed = computed_blocks * BLOCK + (rng.randrange(BLOCK) if rng.random() < 0.3 else 0)
    # cached blocks after the first miss, never the last block (vLLM computes it)
    first = computed // BLOCK + 1
    cached = {b for b in range(first, num_blocks - 1) if rng.random() < 0.5}
    runs: list[tuple[int, list[int]]] = []
    for b in sorted(cached):
        if runs and runs[-1][0] + len(runs[-1][1]) == b:
            runs[-1][1].append(b)
        else:
            runs.append((b, [b]))
    budget = rng.randrange(1, num_tokens + 1)
    got = plan_holes(runs, computed, budget, num_tokens, BLOCK)
    want = _oracle(cached, computed, budget, num_tokens)
    assert got == want, f"seed={seed} trial={trial} runs={runs} computed={computed}"


def test_plan_holes_leaves_a_run_at_the_prefix_to_the_jump() -> None:
    assert plan_holes([(2, [7])], 2 * BLOCK, 500, 10 * BLOCK, BLOCK) == []


# ------------------------------------------------------------------------------------------------
# one holed step through the backends

# Step 1 computes span S (blocks 5, 9, home slots 0-1), span T (block 13, home slot 0) and an
# unrelated X. Step 2 computes H = [head][S][cold isolated span][T][question] as three holes in
# one step (blocks 7, 3, 11 new; S and T cached, S read at slots 1-2 and T at slot 4: off
# home), next to C = [S][5 new] with S at home.
H_TABLE = [7, 5, 9, 3, 13, 11]
H_HOLES = [(0, 32, 0), (96, 128, 96), (160, 170, 0)]  # (start, end, key_start)
C_TABLE = [5, 9, 12]


def _randn(gen: torch.Generator, n: int, heads: int = KV_HEADS) -> torch.Tensor:
    return torch.randn(n, heads, HEAD, generator=gen)


def _slots(table: list[int], positions: list[int]) -> list[int]:
    return [table[p // BLOCK] * BLOCK + p % BLOCK for p in positions]


def _holed_scenario(attend, gen: torch.Generator, tol: float, what: str) -> None:
    """Run the two steps through ``attend(query, key, value, qsl, seq_lens, table, slots,
    positions, key_start)`` (``positions`` / ``key_start`` None in step 1) and compare step 2
    with the per-hole dense reference."""
    from minipic.kernels import dense_attention_ref

    rope = neox_rope(HEAD, torch.float32)
    # step 1: S (64), T (32, its own request), X (20); all contiguous from position 0
    s_kv, t_kv, x_kv = (( _randn(gen, n), _randn(gen, n)) for n in (64, 32, 20))
    tables = torch.zeros(3, 6, dtype=torch.int32)
    tables[0, :2] = torch.tensor([5, 9])
    tables[1, 0] = 13
    tables[2, 0] = 2
    pos1 = list(range(64)) + list(range(32)) + list(range(20))
    slots1 = _slots([5, 9], range(64)) + _slots([13], range(32)) + _slots([2], range(20))
    q1 = rope.forward_native(torch.tensor(pos1), _randn(gen, 116, HEADS).flatten(1), None)[0]
    attend(q1.view(-1, HEADS, HEAD), torch.cat([s_kv[0], t_kv[0], x_kv[0]]),
           torch.cat([s_kv[1], t_kv[1], x_kv[1]]), torch.tensor([0, 64, 96, 116],
                                                                  dtype=torch.int32),
           torch.tensor([64, 32, 20], dtype=torch.int32), tables, torch.tensor(slots1),
           None, None)

    # step 2: H's three holes, then C's 5 tokens
    hole_kv = [(_randn(gen, e - s), _randn(gen, e - s)) for s, e, _ in H_HOLES]
    c_kv = (_randn(gen, 5), _randn(gen, 5))
    h_positions = [p for s, e, _ in H_HOLES for p in range(s, e)]
    positions = h_positions + list(range(64, 69))
    key_start = [k for s, e, k in H_HOLES for _ in range(s, e)] + [0] * 5
    table = torch.zeros(2, 6, dtype=torch.int32)
    table[0] = torch.tensor(H_TABLE)
    table[1, :3] = torch.tensor(C_TABLE)
    slots = _slots(H_TABLE, h_positions) + _slots(C_TABLE, range(64, 69))
    n_h = len(h_positions)
    query = rope.forward_native(torch.tensor(positions), _randn(gen, n_h + 5, HEADS).flatten(1),
                                None)[0].view(-1, HEADS, HEAD)
    out = attend(query, torch.cat([kv[0] for kv in hole_kv] + [c_kv[0]]),
                 torch.cat([kv[1] for kv in hole_kv] + [c_kv[1]]),
                 torch.tensor([0, n_h, n_h + 5], dtype=torch.int32),
                 torch.tensor([170, 69], dtype=torch.int32), table, torch.tensor(slots),
                 torch.tensor(positions), torch.tensor(key_start))

    # H's logical keys: [head][S][cold span][T][question]
    h_keys = [torch.cat([hole_kv[0][i], s_kv[i], hole_kv[1][i], t_kv[i], hole_kv[2][i]])
              for i in (0, 1)]
    ref_keys = [h_keys[0][:e] for _, e, _ in H_HOLES] + [torch.cat([s_kv[0], c_kv[0]])]
    ref_values = [h_keys[1][:e] for _, e, _ in H_HOLES] + [torch.cat([s_kv[1], c_kv[1]])]
    ref_qsl = torch.tensor([0, 32, 64, 74, 79], dtype=torch.int32)
    ref = dense_attention_ref(query, ref_keys, ref_values, ref_qsl, rope.cos_sin_cache, HEAD,
                              True, HEAD**-0.5, key_start=torch.tensor(key_start))
    check_close(out, ref, atol=tol, rtol=tol, what=what, seed=None)


@pytest.mark.parametrize("path", ["auto", "scratch", "torch"])
def test_cpu_backend_computes_three_holes_in_one_step(path: str, seed: int,
                                                      monkeypatch) -> None:
    from minipic.engine_ext.attention import cpu_backend as rab

    attn = CpuAttention(path, torch.float32, neox_rope(HEAD, torch.float32),
                        rab.KeyShadowIndex(), monkeypatch, heads=HEADS, kv_heads=KV_HEADS,
                        head=HEAD, block=BLOCK)
    plans = []

    def attend(query, key, value, qsl, seq_lens, table, slots, positions, key_start):
        plan = attn.plan(qsl, seq_lens, table, slots, key_start=key_start, positions=positions)
        if positions is not None:
            assert torch.equal(plan.positions, positions)
        plans.append(plan)
        return attn.forward(query, key, value, qsl, seq_lens, table, slots, plan)

    _holed_scenario(attend, torch.Generator().manual_seed(seed), 2e-5,
                    f"path={path}, seed={seed}")
    # the holed request ran as one kernel row per hole (plus C): 4 rows in step 2
    rows = sum(c.seq_lens.numel() for c in plans[1].off_home_chunks)
    rows += plans[1].home.seq_lens.numel() if plans[1].home is not None else 0
    assert rows == 4, f"{rows} kernel rows (seed={seed})"


def test_cuda_backend_computes_three_holes_in_one_step(seed: int) -> None:
    """The CUSTOM backend's rows for a holed step (``hole_rows``) through its Triton kernel,
    run by Triton's interpreter on CPU tensors."""
    pytest.importorskip("triton")
    import minipic.kernels.triton_paged_attention as triton_kernel
    from minipic.engine_ext.attention.cuda_backend import (
        MinipicCudaAttentionImpl,
        MinipicCudaMetadata,
        hole_rows,
    )

    interpreted = "Interpreted" in type(triton_kernel._paged_attention_rope_kernel).__name__
    if not torch.cuda.is_available() and not interpreted:
        pytest.skip("Triton was imported before TRITON_INTERPRET=1 could be set; run this "
                    "file on its own to cover the CUDA backend")
    impl = MinipicCudaAttentionImpl(HEADS, HEAD, HEAD**-0.5, KV_HEADS)
    impl.minipic_rope = neox_rope(HEAD, torch.float32)
    kv_cache = torch.zeros(16, KV_HEADS, BLOCK, 2 * HEAD)

    def attend(query, key, value, qsl, seq_lens, table, slots, positions, key_start):
        max_q = int((qsl[1:] - qsl[:-1]).max())
        if positions is not None:
            qsl, seq_lens, table, max_q, _ = hole_rows(qsl, positions, table, qsl.dtype,
                                                       seq_lens.dtype)
            assert seq_lens.tolist() == [32, 128, 170, 69]
        md = MinipicCudaMetadata(num_actual_tokens=query.shape[0], max_query_len=max_q,
                                 query_start_loc=qsl, seq_lens=seq_lens, block_table=table,
                                 slot_mapping=slots, key_start=key_start)
        out = torch.full_like(query, float("nan"))
        impl.forward(None, query, key, value, kv_cache, md, out)
        return out

    _holed_scenario(attend, torch.Generator().manual_seed(seed), 2e-5,
                    f"CUSTOM backend, seed={seed}")


# ------------------------------------------------------------------------------------------------
# the scheduler side on vLLM's real KVCacheManager and Request

SMALL = 16  # block size of the manager-level tests (no kernel involved)


def _sha(obj: object) -> bytes:
    import hashlib

    return hashlib.sha256(repr(obj).encode()).digest()


def _manager(num_blocks: int, events: bool = False):
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=SMALL, num_kv_heads=1, head_size=8,
                             dtype=torch.float32)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    return KVCacheManager(config, max_model_len=1024, scheduler_block_size=SMALL,
                          hash_block_size=SMALL, enable_kv_cache_events=events)


def _request(rid: str, tokens: list[int]):
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.request import Request

    from minipic.engine_ext.hashing.span_hashing import make_span_block_hasher
    from minipic.span_contract.span_config import SPANS_OPT_IN_KEY, SpanConfig

    init_none_hash(_sha)
    params = SamplingParams(max_tokens=1, extra_args={SPANS_OPT_IN_KEY: True})
    params.update_from_generation_config({}, None)
    config = SpanConfig(block_size=SMALL, ssep_id=5, pdep_id=11, pad_id=16)
    return Request(rid, tokens, params, None,
                   block_hasher=make_span_block_hasher(SMALL, _sha, config))


class _Wrapped:
    """scheduler_lookup's wrappers around the unwrapped vLLM methods (whatever this process
    installed), called on a real ``KVCacheManager``."""

    def __init__(self) -> None:
        import inspect

        from vllm.v1.core.kv_cache_manager import KVCacheManager

        from minipic.engine_ext.holes import scheduler_lookup as hole_lookup

        def stock(name: str):
            return inspect.unwrap(getattr(KVCacheManager, name))

        self.lookup = hole_lookup._wrap_get_computed_blocks(stock("get_computed_blocks"))
        self.allocate = hole_lookup._wrap_allocate_slots(stock("allocate_slots"))
        self.free = hole_lookup._wrap_free(stock("free"))


def _final_prompt(rng: random.Random) -> tuple[list[int], list[list[int]]]:
    """[A][B cold][C][D cold, 2 blocks][PDEP question]; returns (prompt, [A, C] alone)."""
    def span(blocks: int) -> list[int]:
        return [5] + [rng.randrange(100, 30_000) for _ in range(blocks * SMALL - 1)]

    a, b, c, d = span(1), span(1), span(1), span(2)
    question = [11] + [rng.randrange(100, 30_000) for _ in range(rng.randrange(3, SMALL))]
    return a + b + c + d + question, [a, c]


def _admit(kvm, wrapped: _Wrapped, request, budget: int):
    """What the scheduler's waiting path does: lookup, the chunk clip (scheduler_lookup's plan),
    allocation. Returns (new blocks, planned tokens)."""
    from minipic.engine_ext.holes.scheduler_lookup import CachedRuns
    from minipic.engine_ext.holes.scheduler_steps import StepHoles

    blocks, hit, _ = wrapped.lookup(kvm, request)
    # the lookup records runs only when it found some past the hit (none: a stock admission,
    # which an empty record plans the same way)
    pending = request.__dict__.setdefault(CACHED_RUNS_ATTR, CachedRuns(runs=[]))
    request.found_tokens = hit + SMALL * sum(len(run) for _, run in pending.runs)
    holes = plan_holes(pending.runs, hit, budget, request.num_tokens, SMALL)
    pending.step = StepHoles(computed=hit, holes=holes)
    new = wrapped.allocate(kvm, request, pending.step.tokens, num_new_computed_tokens=hit,
                           new_computed_blocks=blocks)
    return new, hit, pending


def _settle(request, scheduled: int, computed: int):
    from minipic.engine_ext.holes.scheduler_steps import HOLES_ATTR, settle

    request.num_computed_tokens = computed  # as the waiting path sets it
    scheduler = types.SimpleNamespace(requests={request.request_id: request})
    output = types.SimpleNamespace(
        num_scheduled_tokens={request.request_id: scheduled},
        total_num_scheduled_tokens=scheduled,
        scheduled_new_reqs=[types.SimpleNamespace(req_id=request.request_id,
                                                  num_computed_tokens=computed)],
        scheduled_cached_reqs=types.SimpleNamespace(req_ids=[], num_computed_tokens=[]))
    settle(scheduler, output)
    return output, getattr(output, HOLES_ATTR, None)


def test_allocation_keeps_table_order_and_settle_moves_over_the_runs(seed: int) -> None:
    rng = random.Random(seed)
    kvm, wrapped = _manager(16), _Wrapped()
    prompt, alone = _final_prompt(rng)
    for i, ids in enumerate(alone):  # warm A and C, then release them (cached, evictable)
        warm = _request(f"warm{i}", ids + [11, 200])
        wrapped.lookup(kvm, warm)
        assert wrapped.allocate(kvm, warm, warm.num_tokens) is not None
        wrapped.free(kvm, warm)
    idle = kvm.block_pool.get_num_free_blocks()
    final = _request("final", prompt)
    new, hit, pending = _admit(kvm, wrapped, final, budget=1000)
    assert hit == SMALL and pending.step.holes == [(16, 32), (48, len(prompt))]
    c_block = kvm.block_pool.get_cached_block(final.block_hashes[2], [0])[0]
    table = kvm.coordinator.single_type_managers[0].req_to_blocks["final"]
    assert table[2] is c_block and len(table) == -(-len(prompt) // SMALL) == 6
    # the worker appends these in order after the request's first blocks: B, C, D, D, question
    assert [b.block_id for b in new.blocks[0]] == [b.block_id for b in table[1:]]
    assert all(table[i].block_hash is not None for i in range(5))  # every full block hashed
    output, holes = _settle(final, pending.step.tokens, hit)
    assert holes == {"final": ((16, 16), (48, len(prompt) - 48))}
    assert final.num_computed_tokens == 32  # C + A: vLLM then adds the scheduled tokens
    assert output.scheduled_new_reqs[0].num_computed_tokens == 32
    assert 32 + output.num_scheduled_tokens["final"] == len(prompt)
    wrapped.free(kvm, final)
    assert kvm.block_pool.get_num_free_blocks() == idle, f"seed={seed}"


def test_holes_that_do_not_fit_wait_for_a_later_step(seed: int) -> None:
    rng = random.Random(seed)
    kvm, wrapped = _manager(8), _Wrapped()  # 7 usable blocks
    prompt, alone = _final_prompt(rng)
    for i, ids in enumerate(alone):
        warm = _request(f"warm{i}", ids + [11, 200])
        wrapped.lookup(kvm, warm)
        assert wrapped.allocate(kvm, warm, warm.num_tokens) is not None
        wrapped.free(kvm, warm)
    idle = kvm.block_pool.get_num_free_blocks()
    filler = _request("filler", [rng.randrange(100, 30_000) for _ in range(2 * SMALL)])
    wrapped.lookup(kvm, filler)
    assert wrapped.allocate(kvm, filler, filler.num_tokens) is not None  # 2 of the free blocks
    final = _request("final", prompt)
    new, hit, pending = _admit(kvm, wrapped, final, budget=1000)
    # B fits; D and the question (3 blocks) do not: only the first hole runs, C stays pinned
    assert pending.step.holes == [(16, 32)] and pending.step.attached == 0, f"seed={seed}"
    assert len(pending.runs) == 1 and pending.runs[0][0] == 2
    assert len(new.blocks[0]) == 1
    output, holes = _settle(final, 1000, hit)
    assert holes is None and output.num_scheduled_tokens["final"] == 16
    assert output.total_num_scheduled_tokens == 16 and final.num_computed_tokens == 16
    wrapped.free(kvm, final)
    wrapped.free(kvm, filler)
    assert kvm.block_pool.get_num_free_blocks() == idle, f"seed={seed}"


def _stored_hashes(kvm) -> set:
    from vllm.distributed.kv_events import BlockStored

    return {h for e in kvm.take_events() if isinstance(e, BlockStored) for h in e.block_hashes}


def test_selective_heads_are_published_only_under_their_prompts_chain(seed: int) -> None:
    """selective@B on vLLM's real block pool with KV events on: the blocks a final recomputes
    (its PDEP-led heads) are stored under hashes chained through that final's whole prefix, never
    under a hash a span prefill publishes; a second final holding the same documents after
    another system prompt finds every body and whole span, and none of the first one's heads."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from minipic.prompt_builder import PromptBuilder

    rng = random.Random(seed)
    builder = PromptBuilder.from_pretrained(None, block_size=SMALL, chat_template=False)
    words = "amber basalt cedar delta ember fjord granite harbor iris juniper kelp".split()
    docs = [" ".join(rng.choice(words) for _ in range(rng.randrange(20, 90))) for _ in range(3)]
    share = rng.choice([0.3, 0.5, 0.7])
    kvm, wrapped = _manager(256, events=True), _Wrapped()

    finals = [builder.build(system=system, spans=docs, question="Which word comes first?",
                            mode=f"selective@{share}")
              for system in ("Answer from the documents.", "Be brief; cite the documents.")]
    assert finals[0].span_prefills[1:] == finals[1].span_prefills[1:]
    for i, ids in enumerate(finals[0].span_prefills):  # nothing cached yet: no holes
        request = _request(f"prefill{i}", ids)
        assert wrapped.allocate(kvm, request, request.num_tokens)
        wrapped.free(kvm, request)
    span_hashes = _stored_hashes(kvm)
    heads_of = []
    for n, built in enumerate(finals):
        request = _request(f"final{n}", built.prompt_token_ids)
        _admit(kvm, wrapped, request, budget=10_000)
        # every whole span; the system prompt only where the prefills warmed it
        warm_system = 0 if n == 0 else built.spans[0].end
        assert request.found_tokens == built.expected_cached_tokens - warm_system, (n, seed)
        head_blocks = sorted({p // SMALL for s in built.segments if s.part == "head"
                              for p in range(s.start, s.end)})
        assert head_blocks, f"share {share} (seed={seed})"
        heads = {maybe_convert_block_hash(request.block_hashes[b]) for b in head_blocks}
        stored = _stored_hashes(kvm)
        assert heads <= stored and not heads & span_hashes, f"seed={seed}"
        heads_of.append(heads)
        wrapped.free(kvm, request)
    assert not heads_of[0] & heads_of[1], f"seed={seed}"
