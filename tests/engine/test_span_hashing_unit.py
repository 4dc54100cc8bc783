"""Span hashing against vLLM's own hasher, on real vLLM ``Request`` objects (no engine).

The engine tests show the behaviour end to end; these pin the hash algebra itself on fresh
random token sequences: no special token -> byte-identical to stock vLLM; SSEP -> independent of
what precedes; PDEP -> dependent on everything before; salt -> part of every reset block; a block
holding a layout token (whose KV rule 1 computes differently) -> never a plain request's hash.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipic.engine_ext.hashing.span_hashing import make_span_block_hasher
from minipic.span_contract.span_config import SPANS_OPT_IN_KEY, SpanConfig

pytestmark = pytest.mark.fast

BS = 32
CFG = SpanConfig(block_size=BS, ssep_id=5, pdep_id=11, pad_id=16)


@pytest.fixture(scope="module")
def hashers():
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu

    fn = get_hash_fn_by_name("sha256")
    kcu.init_none_hash(fn)
    stock = kcu.get_request_block_hasher
    stock = getattr(stock, "_stock", stock)  # in case the plugin patched this process
    return stock(BS, fn), make_span_block_hasher(BS, fn, CFG)


def make_request(ids: list[int], hasher, salt: str | None = None, opt_in: bool = True):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    extra = {SPANS_OPT_IN_KEY: True} if opt_in else None
    return Request(
        request_id=str(random.random()), prompt_token_ids=list(ids),
        sampling_params=SamplingParams(max_tokens=1, extra_args=extra), pooling_params=None,
        cache_salt=salt, block_hasher=hasher,
    )


def plain_tokens(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(100, 49000) for _ in range(n)]


def span(n_blocks: int, rng: random.Random) -> list[int]:
    return [CFG.ssep_id] + plain_tokens(n_blocks * BS - 1, rng)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 8 * BS), salt=st.sampled_from([None, "tenant-a"]), seed=st.integers())
def test_without_special_tokens_hashes_equal_stock(hashers, n, salt, seed):
    stock, pic = hashers
    ids = plain_tokens(n, random.Random(seed))
    assert make_request(ids, pic, salt).block_hashes == make_request(ids, stock, salt).block_hashes


def test_ssep_restarts_chain_at_any_offset(hashers):
    _, pic = hashers
    rng = random.Random()
    doc = span(2, rng)
    alone = make_request(doc, pic).block_hashes
    for prefix_blocks in (1, 2, 5):
        prefix = span(prefix_blocks, rng)
        inside = make_request(prefix + doc + plain_tokens(7, rng), pic).block_hashes
        assert inside[prefix_blocks:prefix_blocks + 2] == alone


def test_pdep_depends_on_whole_prefix_and_plain_block_does_not(hashers):
    _, pic = hashers
    rng = random.Random()
    doc, question = span(1, rng), plain_tokens(BS, rng)
    sys_a, sys_b = span(1, rng), span(1, rng)
    with_pdep = [CFG.pdep_id] + question[1:]
    a = make_request(sys_a + doc + with_pdep, pic).block_hashes
    b = make_request(sys_b + doc + with_pdep, pic).block_hashes
    assert a[1] == b[1] and a[2] != b[2]
    a = make_request(sys_a + doc + question, pic).block_hashes
    b = make_request(sys_b + doc + question, pic).block_hashes
    assert a[2] == b[2]  # without PDEP the question block would be shared


def test_blocks_with_layout_tokens_never_hash_like_a_plain_requests(hashers):
    """Rule 1 hides an opted-in request's SSEP, PDEP and PAD from attention, so a block holding
    one has other KV than a plain request computes for the same tokens: no shared hash. Blocks
    before the first layout token keep the stock hash (same KV, shared prefix cache)."""
    stock, pic = hashers
    rng = random.Random()
    system = plain_tokens(BS + 20, rng) + [CFG.pad_id] * (BS - 20)  # 2 blocks, pads in the 2nd
    ids = system + span(1, rng) + plain_tokens(BS, rng)
    opted = make_request(ids, pic).block_hashes
    plain = make_request(ids, stock).block_hashes
    assert opted[0] == plain[0]
    assert not set(opted[1:]) & set(plain)
    # a span at offset 0 (SSEP first) is not a plain request's first block either
    doc = span(2, rng)
    assert not set(make_request(doc, pic).block_hashes) & set(make_request(doc, stock).block_hashes)
    assert make_request(ids, pic, opt_in=False).block_hashes == plain


def test_salt_is_part_of_every_reset_block(hashers):
    _, pic = hashers
    rng = random.Random()
    sys_, doc = span(1, rng), span(2, rng)
    t1 = make_request(sys_ + doc, pic, "t1").block_hashes
    t2 = make_request(sys_ + doc, pic, "t2").block_hashes
    none = make_request(sys_ + doc, pic).block_hashes
    assert not set(t1) & set(t2) and not set(t1) & set(none)
    # the same salt still reuses the span at a new offset (span prefill is warmed alone)
    assert make_request(doc, pic, "t1").block_hashes == t1[1:]


def test_incremental_hashing_matches_one_shot(hashers):
    """vLLM extends block hashes after every output token; the extra chain must keep up."""
    _, pic = hashers
    rng = random.Random()
    ids = span(1, rng) + [CFG.pdep_id] + plain_tokens(BS + 5, rng)
    req = make_request(ids[: BS + 3], pic)
    for tok in ids[BS + 3:]:
        req.append_output_token_ids(tok)
    assert req.block_hashes == make_request(ids, pic).block_hashes


def _rewrite_tail(req, keep_tokens: int, new_tail: list[int]) -> None:
    """What vLLM's scheduler does to a streaming-input session (``_update_request_as_session``):
    cut tokens and ``block_hashes`` back to the computed prefix, append the update, rehash."""
    del req._all_token_ids[keep_tokens:]
    del req.block_hashes[keep_tokens // BS:]
    del req.prompt_token_ids[keep_tokens:]
    req._all_token_ids.extend(new_tail)
    req.prompt_token_ids.extend(new_tail)
    req.update_block_hashes()


@pytest.mark.parametrize("opt_in", [False, True])
def test_truncated_block_hashes_rechain_on_the_current_tokens(hashers, opt_in):
    """After vLLM truncates ``block_hashes`` and appends new tokens, every hash names the
    current token sequence: equal to a fresh request of the same tokens (and, without opt-in or
    markers, to stock vLLM's). Before the fix the span hasher chained onto its stale full chain.
    """
    stock, pic = hashers
    rng = random.Random()
    first = span(1, rng) + [CFG.pdep_id] + plain_tokens(4 * BS, rng)
    keep = rng.randrange(BS, 3 * BS)
    tail = [CFG.pdep_id] + plain_tokens(rng.randrange(2 * BS, 4 * BS), rng)
    current = first[:keep] + tail
    for hasher in (pic, stock):
        req = make_request(first, hasher, opt_in=opt_in)
        _rewrite_tail(req, keep, tail)
        assert req.block_hashes == make_request(current, hasher, opt_in=opt_in).block_hashes
    plain = plain_tokens(5 * BS, rng)
    req = make_request(plain, pic, opt_in=opt_in)
    _rewrite_tail(req, keep, plain_tokens(3 * BS, rng))
    assert req.block_hashes == make_request(req.all_token_ids, stock).block_hashes
    # reset to nothing (a multi-turn rewrite from token 0)
    req = make_request(first, pic, opt_in=opt_in)
    _rewrite_tail(req, 0, tail)
    assert req.block_hashes == make_request(tail, pic, opt_in=opt_in).block_hashes


def test_block_hashes_set_without_the_full_chain_rebuild_it(hashers):
    """A request whose ``block_hashes`` came from elsewhere (no full chain kept next to them)
    still chains its next PDEP block over the true full prefix."""
    from minipic.engine_ext.hashing.span_hashing import FULL_CHAIN_ATTR

    _, pic = hashers
    rng = random.Random()
    ids = span(2, rng) + [CFG.pdep_id] + plain_tokens(2 * BS, rng)
    req = make_request(ids[: 2 * BS + 5], pic)
    del req.__dict__[FULL_CHAIN_ATTR]
    for tok in ids[2 * BS + 5:]:
        req.append_output_token_ids(tok)
    assert req.block_hashes == make_request(ids, pic).block_hashes


def _decoded(prompt: list[int], output: list[int], hasher):
    """A request over ``prompt`` that then generated ``output`` (vLLM's decode path: each
    output token appended, block hashes extended as blocks fill)."""
    req = make_request(prompt, hasher)
    for tok in output:
        req.append_output_token_ids(tok)
    return req


def test_generated_markers_never_restart_the_chain(hashers):
    """Markers are prompt tokens only (docs/design.md §2): an SSEP the model generates at a
    block start does not restart the chain (its block's KV depends on the whole prompt, so a
    span-local hash would let another prompt that merely ends in the same tokens hit it), and
    a generated PDEP is no PDEP block. Blocks of generated tokens never hash like the same
    tokens laid out in a prompt (there a PAD / SSEP / PDEP is hidden, or the tokens isolated)."""
    from minipic.engine_ext.hashing.span_hashing import span_chained_blocks

    _, pic = hashers
    rng = random.Random()
    prompt = span(1, rng) + [CFG.pdep_id] + plain_tokens(BS - 1, rng)  # ends at a block end
    for marker in (CFG.ssep_id, CFG.pdep_id):
        out = [marker] + plain_tokens(BS - 1, rng)
        other = span(2, rng) + [CFG.pdep_id] + plain_tokens(BS - 1, rng)  # another prompt
        mine, theirs = (_decoded(p, out, pic).block_hashes for p in (prompt, other))
        assert len(mine) == 3 and mine[2] != theirs[3], marker  # no span-local hash
        as_prompt = make_request(prompt + out, pic).block_hashes
        assert mine[:2] == as_prompt[:2] and mine[2] != as_prompt[2], marker
        flags = span_chained_blocks(_decoded(prompt, out, pic), BS, CFG)
        assert flags == [True, False, False], marker
    # a generated PAD in the question's segment: a real token there, hidden in a prompt
    out = plain_tokens(5, rng) + [CFG.pad_id] + plain_tokens(BS - 6, rng)
    clean = plain_tokens(BS, rng)
    assert _decoded(prompt, out, pic).block_hashes[2] != make_request(
        prompt + out, pic).block_hashes[2]
    # generated tokens without layout ids keep the prompt's hash (a next turn reuses them)
    assert _decoded(prompt, clean, pic).block_hashes == make_request(
        prompt + clean, pic).block_hashes


def test_generation_after_an_open_span_leaves_the_span_chain(hashers):
    """A prompt that ends inside a span (no question): what the model generates attends to
    every real key of the prompt, not only the span's, so the block that holds it (the span's
    last, partly generated, and every later one) hashes over the whole prefix; the span's
    prompt-only blocks keep their span-local hash."""
    from minipic.engine_ext.hashing.span_hashing import span_chained_blocks

    _, pic = hashers
    rng = random.Random()
    doc = span(1, rng) + plain_tokens(10, rng)  # a span's full block, then 10 of its tokens
    out = plain_tokens(2 * BS - 10, rng)
    systems = {"a": span(1, rng), "b": span(1, rng)}
    hashes = {}
    for name, system in systems.items():
        req = _decoded(system + doc, out, pic)
        hashes[name] = req.block_hashes
        assert span_chained_blocks(req, BS, CFG) == [True, True, False, False], name
    assert hashes["a"][1] == hashes["b"][1]  # the span's own block: span-local, shared
    assert not set(hashes["a"][2:]) & set(hashes["b"][2:])  # the decoded ones: never
    # and the same tokens laid out as a prompt (isolated in the span) hash otherwise
    as_prompt = make_request(systems["a"] + doc + out, pic).block_hashes
    assert as_prompt[:2] == hashes["a"][:2] and not set(hashes["a"][2:]) & set(as_prompt)
