"""The span store on real vLLM (CPU, fp32): span KV that outlives the pool and the engine.

Fresh random token ids every run, against the transformers block-mask reference
(``tests/support/pic_reference.py``), as in ``tests/engine/test_span_reuse.py``:

* store-loaded finals: spans prefilled (saved), the pool reset (the spans stay in the store),
  then the final reports the span tokens cached, the store counts them by tier, and its greedy
  tokens and logprobs equal the reference;
* replicas: an engine started on the directory another engine writes, as its shared tier,
  hits every span of its first final (the SIGKILL restart of a real server:
  ``tests/span_store/test_span_store_http.py``); a corpus 4x the pool, with and without the store;
* other weights on the same directory load nothing, and answer as their own reference; nor does
  an engine on the same folder whose spans a ``--load-format dummy`` (random weights) engine
  stored;
* tenants: a salted span is never loaded under another salt or unsalted, at any position;
* tensor parallelism (2 ranks, one core each): each rank stores its part of every block, a
  store-loaded final equals the reference, and a block one rank cannot find is computed;
* faults: corrupt / truncated / foreign entries and a store deleted under the running engine
  give misses (the output still equals the reference), never wrong KV or a crash.

One engine for the single-engine tests (disk only, so every load reads and verifies a file);
the replica, other-weights, dummy-weights, tensor-parallel and corpus tests start one more
each.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.pic_engine import generate, pic_sampling, prefill, random_prompt, selective_prompt
from support.pic_reference import (
    REFERENCE_TOL,
    PicPrompt,
    PicReference,
    build_pic_prompt,
    max_logprob_error,
    pad_span,
    prompt_error,
    random_ordinary_ids,
)

pytestmark = pytest.mark.engine


def _start(store_dir: Path, ram_mib: int) -> object:
    from minipic.span_contract.engine_config import EngineSettings, build_llm
    from minipic.span_contract.span_store_config import SpanStoreConfig

    settings = EngineSettings(model="tiny-llama", pic=True, max_model_len=2048,
                              span_store=SpanStoreConfig(dir=str(store_dir), ram_mib=ram_mib))
    return build_llm(settings)


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("span-store")


@pytest.fixture(scope="module")
def disk_llm(store_dir: Path) -> Iterator[object]:
    """An engine whose store is the local disk only (RAM tier off)."""
    from minipic.span_contract.engine_config import close_llm

    llm = _start(store_dir, ram_mib=0)
    yield llm
    close_llm(llm)


@pytest.fixture(scope="module")
def ref(disk_llm) -> PicReference:
    return PicReference(disk_llm.minipic_settings.model)


def _stats(llm) -> dict:
    from minipic.engine_ext.recurrent.checkpoints import call_engine
    from minipic.span_contract.engine_utilities import SPAN_STORE_STATS_UTILITY

    stats = call_engine(llm, SPAN_STORE_STATS_UTILITY)
    assert stats is not None, "the engine runs no span store"
    return stats


def _counts(llm) -> dict:
    return dict(_stats(llm)["counts"])


def _delta(after: dict, before: dict, key: str) -> int:
    return int(after.get(key, 0)) - int(before.get(key, 0))


def _saved(llm, prompt: PicPrompt, salt: str | None = None) -> None:
    """Prefill the prompt's spans and wait until the store has them on disk."""
    store_dir = Path(llm.minipic_settings.span_store.dir)
    files = len(_entries(store_dir)) if store_dir.exists() else 0
    before = _counts(llm).get("saved_blocks", 0)
    prefill(llm, prompt.span_prefills, salt)
    blocks = prompt.span_tokens // llm.minipic_settings.block_size
    assert _counts(llm).get("saved_blocks", 0) - before == blocks
    deadline = time.monotonic() + 60
    while len(_entries(store_dir)) < files + blocks:  # written off the engine's thread
        assert time.monotonic() < deadline, "the store did not write its entries in 60 s"
        time.sleep(0.05)


def _same_logprobs(a: object, b: object) -> bool:
    """Every returned logprob of two completions equal (the same KV bytes, the same step)."""
    steps_a, steps_b = a.outputs[0].logprobs, b.outputs[0].logprobs  # type: ignore[attr-defined]
    return len(steps_a) == len(steps_b) and all(
        {t: lp.logprob for t, lp in x.items()} == {t: lp.logprob for t, lp in y.items()}
        for x, y in zip(steps_a, steps_b, strict=True))


def _entries_under_current_secret(store_dir: Path) -> list[Path]:
    """Entry files whose header names the key id of the store's secret now."""
    from minipic.engine_ext.span_store.tiers.files import SECRET_NAME, key_id
    from minipic.engine_ext.span_store.tiers.format import HEADER, unpack_header

    kid = key_id((store_dir / SECRET_NAME).read_bytes())
    found = []
    for path in _entries(store_dir):
        with contextlib.suppress(OSError), path.open("rb") as fh:
            header = unpack_header(fh.read(HEADER.size))
            if not isinstance(header, str) and header.key_id == kid:
                found.append(path)
    return found


def _entries(store_dir: Path) -> list[Path]:
    return [p for p in store_dir.rglob("*") if p.is_file() and not p.name.startswith(".")
            and ".tmp" not in p.name]


def test_store_loaded_final_equals_reference(disk_llm, ref, store_dir, seed) -> None:
    llm = disk_llm
    rng = random.Random(seed)
    prompt = random_prompt(llm, rng, ref.vocab_size, [40, 25, 60])
    _saved(llm, prompt)
    assert llm.reset_prefix_cache()  # the pool forgets the spans; the store keeps them
    before = _counts(llm)
    out = generate(llm, [prompt.token_ids], pic_sampling())[0]
    after = _counts(llm)
    assert out.num_cached_tokens == prompt.span_tokens, f"seed={seed}"
    assert _delta(after, before, "tokens_disk") == prompt.span_tokens, (before, after)
    err = prompt_error(out, prompt, ref)
    assert err < REFERENCE_TOL, f"off the reference by {err:.2e} (seed={seed})"
    assert _entries(store_dir), "nothing was written to the disk tier"


def test_store_loaded_selective_final_equals_the_reference(disk_llm, ref, seed) -> None:
    """selective@B over spans the pool forgot: the whole spans come from the store, the heads
    are recomputed in context, and the output is the layout rule's reference."""
    from types import SimpleNamespace

    llm = disk_llm
    rng = random.Random(seed)
    share = rng.choice([0.25, 0.5])
    built, runs = selective_prompt(llm, rng, share, "Which word comes first?")
    prefills = [built.span_prefills[i.prefill_index] for i in built.spans
                if i.kind == "span" and i.prefill_index is not None]  # the whole spans
    saved_tokens = sum(len(p) for p in prefills)
    _saved(llm, SimpleNamespace(span_prefills=prefills, span_tokens=saved_tokens))
    assert llm.reset_prefix_cache()
    before = _counts(llm)
    out = generate(llm, [built.prompt_token_ids], pic_sampling())[0]
    assert _delta(_counts(llm), before, "tokens_disk") == saved_tokens, f"seed={seed}"
    assert out.num_cached_tokens == saved_tokens, f"seed={seed}"
    full = built.prompt_token_ids + list(out.outputs[0].token_ids)
    err = max_logprob_error(out.outputs[0], len(built.prompt_token_ids),
                            ref.logprobs(full, runs, prompt_len=len(built.prompt_token_ids)))
    assert err < REFERENCE_TOL, f"off the reference by {err:.2e} (seed={seed})"


def test_tenants_never_load_each_others_spans(disk_llm, ref, seed) -> None:
    """A salted span is not loadable under another salt or unsalted, first or later in the
    prompt; under its own salt it is."""
    llm = disk_llm
    rng = random.Random(seed)
    prompt = random_prompt(llm, rng, ref.vocab_size, [33, 50])
    _saved(llm, prompt, salt=f"tenant-a-{seed}")
    cfg = llm.minipic_settings.span_config
    bodies = [p[1:] for p in prompt.span_prefills]
    question = random_ordinary_ids(rng, 7, ref.vocab_size, (cfg.ssep_id, cfg.pdep_id))
    later = build_pic_prompt(cfg, [random_ordinary_ids(rng, 20, ref.vocab_size,
                                                       (cfg.ssep_id, cfg.pdep_id)), *bodies],
                             question)
    # every check under a salt of its own (a tenant's cold spans are saved for that tenant)
    for salt, final in ((f"tenant-b-{seed}", prompt), (f"tenant-c-{seed}", later),
                        (None, later)):
        assert llm.reset_prefix_cache()
        before = _counts(llm)
        out = generate(llm, [final.token_ids], pic_sampling(), salt)[0]
        loaded = sum(_delta(_counts(llm), before, k) for k in ("tokens_disk", "tokens_ram"))
        assert loaded == 0 and out.num_cached_tokens == 0, (salt, seed)
        assert prompt_error(out, final, ref) < REFERENCE_TOL, f"seed={seed}"
    assert llm.reset_prefix_cache()
    out = generate(llm, [later.token_ids], pic_sampling(), f"tenant-a-{seed}")[0]
    assert out.num_cached_tokens == prompt.span_tokens, f"seed={seed}"


def test_corrupt_truncated_foreign_forged_and_special_entries_are_misses(
        disk_llm, ref, store_dir, tmp_path, seed) -> None:
    import os
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from store_faults import _forge

    from minipic.engine_ext.span_store.tiers import Entry

    llm = disk_llm
    rng = random.Random(seed)
    prompt = random_prompt(llm, rng, ref.vocab_size, [30] * 6)  # one block each
    before_files = set(_entries(store_dir))
    _saved(llm, prompt)
    mine = sorted(set(_entries(store_dir)) - before_files)
    assert len(mine) >= 6, mine
    # forged: a well-formed entry MAC-ed under a secret that is not the store's; a symlink to
    # a valid copy of the very entry kept outside the store; a FIFO (must not hang the step)
    fp = _stats(llm)["fingerprint"]
    key = mine[3].name[:-len(".kvb")]
    mine[3].write_bytes(_forge(key, Entry(os.urandom(mine[3].stat().st_size // 2), {"home": 0}),
                               os.urandom(32), fp))
    (tmp_path / mine[4].name).write_bytes(mine[4].read_bytes())
    mine[4].unlink()
    mine[4].symlink_to(tmp_path / mine[4].name)
    mine[5].unlink()
    os.mkfifo(mine[5], 0o600)
    # one entry bit-flipped in its payload, one truncated, one with another fingerprint
    data = bytearray(mine[0].read_bytes())
    data[-7] ^= 0xFF
    mine[0].write_bytes(bytes(data))
    mine[1].write_bytes(mine[1].read_bytes()[: len(mine[1].read_bytes()) // 2])
    damaged = [mine[0].read_bytes(), mine[1].read_bytes()]
    foreign = bytearray(mine[2].read_bytes())
    fp = _stats(llm)["fingerprint"].encode()
    at = foreign.find(fp)
    assert at >= 0, "the entry header names the fingerprint"
    foreign[at:at + len(fp)] = b"0" * len(fp)
    mine[2].write_bytes(bytes(foreign))
    assert llm.reset_prefix_cache()
    before = _counts(llm)
    out = generate(llm, [prompt.token_ids], pic_sampling())[0]
    after = _counts(llm)
    assert _delta(after, before, "failed_loads") >= 6, (before, after)
    assert out.num_cached_tokens < prompt.span_tokens
    err = prompt_error(out, prompt, ref)
    assert err < REFERENCE_TOL, f"a bad entry changed the output: {err:.2e} (seed={seed})"
    # the damaged entries were removed; the final recomputed those blocks and saved them anew
    for path, bad in zip(mine[:2], damaged, strict=True):
        assert not path.exists() or path.read_bytes() != bad, f"{path.name} still damaged"
    for path in mine[4:6]:  # the symlink and the FIFO are gone (or replaced by a real entry)
        assert not path.is_symlink() and (not path.exists() or path.is_file()), path


def test_store_deleted_under_a_running_engine(disk_llm, ref, store_dir, seed) -> None:
    llm = disk_llm
    rng = random.Random(seed)
    prompt = random_prompt(llm, rng, ref.vocab_size, [45, 20])
    _saved(llm, prompt)
    shutil.rmtree(store_dir)
    assert llm.reset_prefix_cache()
    out = generate(llm, [prompt.token_ids], pic_sampling())[0]
    assert prompt_error(out, prompt, ref) < REFERENCE_TOL, f"seed={seed}"
    # the engine keeps serving, and saves again once it can
    again = random_prompt(llm, rng, ref.vocab_size, [20])
    generate(llm, [again.token_ids], pic_sampling())
    assert prompt_error(generate(llm, [prompt.token_ids], pic_sampling())[0], prompt, ref) < (
        REFERENCE_TOL)


# -- replicas on one shared tier; a corpus bigger than the pool -----------------------------


def test_other_weights_on_the_same_store_load_nothing(disk_llm, ref, store_dir, tmp_path,
                                                      seed) -> None:
    """A second engine on the same store directory, with the same model files but other
    weights (one tensor perturbed): the spans the first engine stored are never loaded, and its
    output equals the block-mask reference of its own weights (a fresh engine's)."""
    import torch
    from safetensors.torch import load_file, save_file

    from minipic.span_contract.engine_config import close_llm
    from minipic.span_contract.span_store_config import SpanStoreConfig

    rng = random.Random(seed)
    prompt = random_prompt(disk_llm, rng, ref.vocab_size, [40, 30])
    _saved(disk_llm, prompt)
    model = Path(disk_llm.minipic_settings.model)
    other = tmp_path / "other-weights"
    shutil.copytree(model, other)
    weights = next(other.glob("*.safetensors"))
    tensors = load_file(weights)
    name = sorted(n for n in tensors if "layers.0" in n and n.endswith("weight"))[0]
    generator = torch.Generator().manual_seed(seed)
    tensors[name] = tensors[name] + 0.05 * torch.randn(tensors[name].shape,
                                                        generator=generator)
    save_file(tensors, weights, metadata={"format": "pt"})
    llm = _start_with(SpanStoreConfig(dir=str(store_dir), ram_mib=0), model=str(other))
    try:
        before = _counts(llm)
        out = generate(llm, [prompt.token_ids], pic_sampling())[0]
        after = _counts(llm)
        assert out.num_cached_tokens == 0 and _delta(after, before, "loaded_blocks") == 0
        assert _stats(llm)["fingerprint"] != _stats(disk_llm)["fingerprint"]
        err = prompt_error(out, prompt, PicReference(str(other)))
        assert err < REFERENCE_TOL, f"off its own weights' reference by {err:.2e} (seed={seed})"
    finally:
        close_llm(llm)


def test_spans_of_random_weights_from_the_same_folder_are_never_loaded(disk_llm, ref, store_dir,
                                                                       seed) -> None:
    """The issue's sequence: a ``--load-format dummy`` engine (random weights, the same model
    folder and store) prefills spans; the real-weights engine then runs the final: it loads
    none of them and answers as its own block-mask reference (a storeless engine's)."""
    from minipic.span_contract.engine_config import close_llm
    from minipic.span_contract.span_store_config import SpanStoreConfig

    rng = random.Random(seed)
    prompt = random_prompt(disk_llm, rng, ref.vocab_size, [40, 30, 20])
    dummy = _start_with(SpanStoreConfig(dir=str(store_dir), ram_mib=0),
                        extra={"load_format": "dummy"})
    try:
        _saved(dummy, prompt)  # on disk, under the dummy engine's fingerprint
        assert _stats(dummy)["fingerprint"] != _stats(disk_llm)["fingerprint"]
    finally:
        close_llm(dummy)
    before = _counts(disk_llm)
    out = generate(disk_llm, [prompt.token_ids], pic_sampling())[0]
    after = _counts(disk_llm)
    assert _delta(after, before, "loaded_blocks") == 0 and out.num_cached_tokens == 0
    err = prompt_error(out, prompt, ref)
    assert err < REFERENCE_TOL, f"off the reference by {err:.2e} (seed={seed})"


def test_tensor_parallel_store_loads_a_block_only_when_every_rank_has_its_part(
        ref, tmp_path, seed) -> None:
    """TP = 2 (tiny Llama: 4 KV heads split 2 / 2; SmolLM2's 3 do not split): each rank writes
    its own part of every span block. After a pool reset the final loads every span block from
    the store and equals the block-mask reference (the transformers model, one device: the
    same tolerance as TP = 1, since fp32 all-reduce sums two partial products in another
    order, ~1e-6 here against 1e-4). With one rank's part of one block deleted, that block is
    computed (never half-loaded) and the answer still equals the reference."""
    from minipic.span_contract.engine_config import close_llm
    from minipic.span_contract.span_store_config import SpanStoreConfig

    store = tmp_path / "tp-store"
    llm = _start_with(SpanStoreConfig(dir=str(store), ram_mib=0),
                      extra={"tensor_parallel_size": 2})
    try:
        rng = random.Random(seed)
        block = llm.minipic_settings.block_size
        for damaged in (False, True):
            prompt = random_prompt(llm, rng, ref.vocab_size, [40, 25, 60])
            blocks = prompt.span_tokens // block
            files = len(_entries(store)) if store.exists() else 0
            before = _counts(llm)
            prefill(llm, prompt.span_prefills)
            assert _delta(_counts(llm), before, "saved_blocks") == blocks
            deadline = time.monotonic() + 60
            while len(_entries(store)) < files + 2 * blocks:  # one part per rank
                assert time.monotonic() < deadline, "the ranks did not write their parts"
                time.sleep(0.05)
            parts = sorted(p.name for p in _entries(store))
            assert {n.rsplit("-r", 1)[1] for n in parts} == {"0.kvb", "1.kvb"}
            if damaged:  # the newest block's rank-1 part goes missing
                newest = max(_entries(store), key=lambda p: p.stat().st_mtime_ns)
                rank1 = newest.with_name(newest.name.replace("-r0.kvb", "-r1.kvb"))
                rank1.unlink()
            pooled = generate(llm, [prompt.token_ids], pic_sampling())[0]  # spans in the pool
            assert llm.reset_prefix_cache()
            before = _counts(llm)
            out = generate(llm, [prompt.token_ids], pic_sampling())[0]
            after = _counts(llm)
            expected = blocks - 1 if damaged else blocks
            assert _delta(after, before, "loaded_blocks") == expected, (damaged, before, after)
            assert out.num_cached_tokens == expected * block, f"seed={seed}"
            err = prompt_error(out, prompt, ref)
            assert err < REFERENCE_TOL, f"TP=2 off the reference by {err:.2e} (seed={seed})"
            if not damaged:
                # against the same TP = 2 engine without the store (the spans it computed, in
                # its pool): the loaded parts are the bytes each rank wrote, so the same answer
                assert out.outputs[0].token_ids == pooled.outputs[0].token_ids, f"seed={seed}"
                assert _same_logprobs(out, pooled), f"seed={seed}"
    finally:
        close_llm(llm)


def _start_with(store, pool_blocks: int | None = None, max_model_len: int = 2048,
                model: str = "tiny-llama", extra: dict | None = None) -> object:
    """An engine with ``store`` (a SpanStoreConfig or None), optionally a pool of
    ``pool_blocks`` KV blocks (vLLM's ``num_gpu_blocks_override``) and other engine args."""
    from minipic.span_contract.engine_config import EngineSettings, build_llm

    extra = dict(extra or {})
    if pool_blocks is not None:
        extra["num_gpu_blocks_override"] = pool_blocks
    return build_llm(EngineSettings(model=model, pic=True, max_model_len=max_model_len,
                                    span_store=store, extra=extra))


def test_two_engines_share_one_tier(disk_llm, ref, store_dir, seed) -> None:
    """Replicas on one directory: what the module's engine saves into it (its disk tier), a
    second engine started on the same directory as its *shared* tier loads (the two never talk;
    what one saves, the other finds under the same key, verified under the same secret). Its
    first final is warm and equals the reference; a block it loaded from the shared tier is
    then in its own RAM tier too. (A restart after a SIGKILL: ``test_span_store_http.py``.)"""
    from minipic.span_contract.engine_config import close_llm
    from minipic.span_contract.span_store_config import SpanStoreConfig

    rng = random.Random(seed)
    prompt = random_prompt(disk_llm, rng, ref.vocab_size, [40, 60, 27])
    _saved(disk_llm, prompt)
    other = _start_with(SpanStoreConfig(shared_dir=str(store_dir), ram_mib=16))
    try:
        out = generate(other, [prompt.token_ids], pic_sampling())[0]
        assert out.num_cached_tokens == prompt.span_tokens, f"seed={seed}"
        assert _counts(other).get("tokens_shared", 0) == prompt.span_tokens
        assert prompt_error(out, prompt, ref) < REFERENCE_TOL, f"seed={seed}"
        assert other.reset_prefix_cache()
        ram_before = _counts(other).get("tokens_ram", 0)
        again = generate(other, [prompt.token_ids], pic_sampling())[0]
        assert _counts(other).get("tokens_ram", 0) - ram_before == prompt.span_tokens
        assert again.outputs[0].token_ids == out.outputs[0].token_ids
        # the store's secret is deleted under both (a rotation): the first to write creates a
        # new one, the other adopts it when it meets an entry under it; both keep answering
        # right, and the first prompt's entries, now under the old secret, are recomputed and
        # stored again rather than loaded or deleted as damage
        changes = _counts(disk_llm).get("key_changes_disk", 0)  # a deleted store is one too
        (store_dir / ".store-key").unlink()
        time.sleep(1.1)  # past the tiers' once-a-second look at the secret
        fresh = random_prompt(disk_llm, rng, ref.vocab_size, [35, 50])
        _saved(disk_llm, fresh)
        assert (store_dir / ".store-key").exists()
        out = generate(other, [fresh.token_ids], pic_sampling())[0]
        assert out.num_cached_tokens == fresh.span_tokens, f"seed={seed}"
        assert prompt_error(out, fresh, ref) < REFERENCE_TOL, f"seed={seed}"
        blocks = prompt.span_tokens // disk_llm.minipic_settings.block_size
        under_new = len(_entries_under_current_secret(store_dir))
        for expect_loaded in (False, True):  # old secret: computed and re-stored; then loaded
            assert disk_llm.reset_prefix_cache()
            before = _counts(disk_llm)
            out = generate(disk_llm, [prompt.token_ids], pic_sampling())[0]
            after = _counts(disk_llm)
            assert _delta(after, before, "loaded_blocks") == (blocks if expect_loaded else 0)
            assert prompt_error(out, prompt, ref) < REFERENCE_TOL, f"seed={seed}"
            deadline = time.monotonic() + 60
            while len(_entries_under_current_secret(store_dir)) < under_new + blocks:
                assert time.monotonic() < deadline, "the recomputed blocks were not re-stored"
                time.sleep(0.05)
        assert _counts(disk_llm).get("key_changes_disk", 0) - changes == 1
        assert _counts(other).get("key_changes_shared", 0) == 1
    finally:
        close_llm(other)


def test_corpus_bigger_than_the_pool(ref, tmp_path, seed) -> None:
    """A corpus of 4x the pool's blocks, random questions over 4 of its documents each: with
    the store nearly every span token is cached (the pool alone keeps about a quarter), and
    every answer is the same with and without the store."""
    from minipic.span_contract.engine_config import close_llm
    from minipic.span_contract.span_store_config import SpanStoreConfig

    rng = random.Random(seed)
    engines = {"store": _start_with(SpanStoreConfig(dir=str(tmp_path / "corpus"), ram_mib=64),
                                    pool_blocks=96, max_model_len=512),
               "none": _start_with(None, pool_blocks=96, max_model_len=512)}
    try:
        llm = engines["store"]
        cfg = llm.minipic_settings.span_config
        pool = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
        avoid = (cfg.ssep_id, cfg.pdep_id, cfg.pad_id)
        per_doc = 3  # SSEP + 95 tokens = 3 blocks of 32
        docs = [random_ordinary_ids(rng, 95, ref.vocab_size, avoid)
                for _ in range(4 * pool // per_doc + 1)]
        questions = [(rng.sample(range(len(docs)), 4),
                      random_ordinary_ids(rng, 10, ref.vocab_size, avoid)) for _ in range(16)]
        finals = [build_pic_prompt(cfg, [docs[i] for i in picked], q) for picked, q in questions]
        cached: dict[str, int] = {}
        answers: dict[str, list] = {}
        for name, engine in engines.items():
            for start in range(0, len(docs), 32):  # the corpus, prefilled once
                prefill(engine, [pad_span(cfg, d) for d in docs[start:start + 32]])
            outs = [generate(engine, [f.token_ids], pic_sampling(max_tokens=3, logprobs=0))[0]
                    for f in finals]
            cached[name] = sum(o.num_cached_tokens for o in outs)
            answers[name] = [o.outputs[0].token_ids for o in outs]
        span_tokens = sum(f.span_tokens for f in finals)
        assert cached["store"] >= 0.9 * span_tokens, (cached, span_tokens, pool)
        assert cached["none"] <= 0.6 * span_tokens, (cached, span_tokens, pool)
        assert answers["store"] == answers["none"], f"seed={seed}"
    finally:
        for engine in engines.values():
            close_llm(engine)
