"""Scheduler logic without an engine: warmth registry, cache checks, slots, retry policy, and the
order in which ISPS / barrier send requests.

``SimulatedEngine`` is an in-test stand-in for the engine (allowed here only: these are pure
scheduling-order tests). It models just what the scheduler relies on — block hashing per DESIGN
§2 (SSEP restarts the chain, PDEP hashes the whole prefix) and vLLM's lookup (consecutive hits
from the first block, never the last prompt token's block). The same behaviour on real engines is
tested in ``test_orchestrator.py`` and ``test_orchestrator_http.py``.
"""

from __future__ import annotations

import asyncio

import pytest

from minipic.orchestrator import (
    Answer,
    BackendInfo,
    BadInputError,
    CacheMismatchError,
    Completion,
    ConfigMismatchError,
    EngineUnreachableError,
    MinipicError,
    Orchestrator,
    RequestTimeoutError,
    RetryPolicy,
    SpanTooLongError,
    SyncOrchestrator,
    WarmthRegistry,
)
from minipic.orchestrator.slots import PrioritySlots
from minipic.orchestrator.warmth import check_cache
from minipic.prompt_builder import PromptBuilder, SpanConfig

pytestmark = pytest.mark.fast
FAST_RETRY = RetryPolicy(max_attempts=4, backoff_s=0.001, max_backoff_s=0.005)


class SimulatedEngine:
    """Prefix cache of full blocks, hashed as the minipic plugin hashes them."""

    def __init__(self, config: SpanConfig, delay: float = 0.005) -> None:
        self.config = config
        self.delay = delay
        self.blocks: set[int] = set()
        self.calls: list[tuple[int, ...]] = []
        self.fail_next = 0  # the next n requests fail as if the server went away (cache lost)
        self.info = BackendInfo(kind="simulated", model="sim", tokenizer="tiny-llama",
                                max_model_len=2048, span_config=config)

    def hashes(self, ids: list[int], salt: str | None) -> list[int]:
        bs, out, prev = self.config.block_size, [], None
        for start in range(0, len(ids) // bs * bs, bs):
            block = tuple(ids[start:start + bs])
            if block[0] == self.config.ssep_id:
                h = hash((salt, "ssep", block))
            elif block[0] == self.config.pdep_id:
                h = hash((salt, "pdep", tuple(ids[:start + bs])))
            else:
                h = hash((salt, prev, block))
            out.append(h)
            prev = h
        return out

    async def generate(self, token_ids, *, sampling, cache_salt=None, request_id=None,
                       route_as=None):
        ids = list(token_ids)
        self.calls.append(tuple(ids))
        if self.fail_next:
            self.fail_next -= 1
            self.blocks.clear()
            raise EngineUnreachableError("simulated: connection refused")
        hashes = self.hashes(ids, cache_salt)
        hit = 0
        for h in hashes[: (len(ids) - 1) // self.config.block_size]:
            if h not in self.blocks:
                break
            hit += 1
        await asyncio.sleep(self.delay)
        self.blocks.update(hashes)
        return Completion(text="ok", token_ids=[1], prompt_tokens=len(ids),
                          cached_tokens=hit * self.config.block_size, ttft_s=self.delay,
                          latency_s=self.delay)

    async def reset_cache(self) -> None:
        self.blocks.clear()

    async def aclose(self) -> None:
        pass


@pytest.fixture(scope="module")
def builder() -> PromptBuilder:
    return PromptBuilder.from_pretrained("tiny-llama", max_model_len=2048)


@pytest.fixture
def engine(builder: PromptBuilder) -> SimulatedEngine:
    return SimulatedEngine(builder.span_config)


def make_orc(engine: SimulatedEngine, builder: PromptBuilder, **options) -> Orchestrator:
    return Orchestrator(engine, builder, options={"retry": FAST_RETRY, **options})


def doc(name: str, words: int = 30) -> str:
    return f"{name}: " + " ".join(f"{name.lower()}{i}" for i in range(words))


def prefill_calls(engine: SimulatedEngine, orc: Orchestrator, docs: list[str]) -> int:
    """How many requests carried exactly the span prefill of one of ``docs``."""
    prompt = orc.build("q?", docs)
    wanted = {tuple(ids) for ids in prompt.span_prefills[1:]}  # [0] is the system span
    return sum(call in wanted for call in engine.calls)


# -- registry, cache check, slots, retry ------------------------------------------------------


def test_registry_lru_and_epochs() -> None:
    reg = WarmthRegistry(capacity=2)
    reg.mark_warm((None, "a"))
    reg.mark_warm((None, "b"))
    assert reg.is_warm((None, "a"))  # touch a: b is now the oldest
    reg.mark_warm((None, "c"))
    assert (None, "b") not in reg and (None, "a") in reg and len(reg) == 2
    assert not reg.is_warm(("salt", "a")), "a salt is a different cache"
    old = reg.epoch
    assert reg.reset(if_epoch=old) and len(reg) == 0
    assert not reg.reset(if_epoch=old), "a second reset for the same loss is a no-op"
    assert not reg.mark_warm((None, "a"), epoch=old), "prefill from before the reset"
    assert (None, "a") not in reg


def test_check_cache_names_the_first_cold_span(builder: PromptBuilder) -> None:
    prompt = builder.build(system="Be brief.", spans=[doc("A"), doc("B")], question="q?")
    sys_end = prompt.spans[1].start
    ok = check_cache(prompt, prompt.expected_cached_tokens)
    assert ok.ok and all(ok.hits.values()) and ok.cold_keys == ()
    cold = check_cache(prompt, sys_end)
    assert not cold.ok and cold.hits == {0: True, 1: False, 2: False}
    assert cold.cold_keys == tuple(prompt.prefill_keys[1:])
    plain = builder.build(system="Be brief.", spans=[doc("A")], question="q?", mode="prefix")
    assert check_cache(plain, 0).hits[1] is None, "prefix-mode documents are not span-cached"


async def test_priority_slots_grant_lowest_first_and_survive_cancellation() -> None:
    slots = PrioritySlots(1)
    order: list[int] = []
    await slots.acquire(0)

    async def take(priority: int) -> None:
        async with slots.hold(priority):
            order.append(priority)

    tasks = [asyncio.create_task(take(p)) for p in (5, 1, 3, 2)]
    await asyncio.sleep(0)
    tasks[3].cancel()  # priority 2 gives up while waiting
    slots.release()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert order == [1, 3, 5] and slots.in_use == 0


def test_retry_policy_bounds() -> None:
    policy = RetryPolicy(max_attempts=3, backoff_s=1, max_backoff_s=4, give_up_after_s=10)
    assert 0.5 <= policy.delay(1) <= 1 and 2 <= policy.delay(3) <= 4 and policy.delay(9) <= 4
    assert policy.should_retry(2, 1) and not policy.should_retry(3, 1)
    assert not policy.should_retry(1, 11)


# -- scheduling order -------------------------------------------------------------------------


async def test_shared_document_is_prefilled_once(engine, builder) -> None:
    orc = make_orc(engine, builder)
    shared = doc("Shared")
    results = await orc.answer_many(
        [(f"question {i}?", [shared, doc(f"Own{i}")]) for i in range(6)])
    assert all(isinstance(r, Answer) and r.cache_ok for r in results)
    assert prefill_calls(engine, orc, [shared]) == 1
    assert sum(r.prefills_sent for r in results) == 1 + 1 + 6  # system + shared + 6 own


async def test_isps_sends_each_final_after_its_own_spans_only(engine, builder) -> None:
    orc = make_orc(engine, builder, max_in_flight=1)
    questions = [(f"q{i}?", [doc(f"D{i}a"), doc(f"D{i}b")]) for i in range(4)]
    with orc.record_events() as log:
        results = await orc.answer_many(questions)
    assert all(r.cache_ok for r in results)
    kinds = [(e.kind, e.job, e.key) for e in log]
    for r, job in zip(results, sorted({e.job for e in log}), strict=True):
        final = kinds.index(("final_sent", job, None))
        for span in r.spans:
            done = [i for i, k in enumerate(kinds) if k[0] == "prefill_done" and k[2] ==
                    span.prefill_key]
            assert done and done[0] < final, "final sent before its span was warm"
    first_final = next(i for i, k in enumerate(kinds) if k[0] == "final_sent")
    last_prefill = max(i for i, k in enumerate(kinds) if k[0] == "prefill_sent")
    assert first_final < last_prefill, "ISPS must not wait for the whole batch's prefills"


async def test_barrier_sends_every_prefill_before_any_final(engine, builder) -> None:
    orc = make_orc(engine, builder, max_in_flight=2, policy="barrier")
    with orc.record_events() as log:
        results = await orc.answer_many([(f"q{i}?", [doc(f"B{i}")]) for i in range(4)])
    assert all(r.cache_ok for r in results)
    kinds = [e.kind for e in log]
    assert max(i for i, k in enumerate(kinds) if k == "prefill_done") < kinds.index("final_sent")


async def test_skip_warm_on_and_off(engine, builder) -> None:
    orc = make_orc(engine, builder)
    batch = [(f"q{i}?", [doc("W1"), doc("W2")]) for i in range(3)]
    first = await orc.answer_many(batch)
    assert {s.status for s in first[0].spans} == {"cold"}
    again = await orc.answer_many(batch, skip_warm=True)
    assert sum(r.prefills_sent for r in again) == 0
    assert {s.status for s in again[0].spans} == {"warm"} and all(r.cache_ok for r in again)
    forced = await orc.answer_many(batch, skip_warm=False)
    assert sum(r.prefills_sent for r in forced) == 3, "once per distinct span, still de-duplicated"


async def test_cold_span_is_rewarmed_reported_or_raised(engine, builder) -> None:
    orc = make_orc(engine, builder)
    orc.configure(on_cold="retry")
    docs = [doc("C1"), doc("C2")]
    await orc.answer("q?", docs)
    await engine.reset_cache()  # the engine forgot; the registry still believes
    with orc.record_events() as log:
        a = await orc.answer("q?", docs)
    assert a.attempts == 2 and a.cache_ok and a.prefills_sent == 3
    assert [e.kind for e in log].count("cold") == 1
    await engine.reset_cache()
    orc.configure(on_cold="report")
    b = await orc.answer("q?", docs)
    assert b.attempts == 1 and not b.cache_ok and b.cold_spans
    await orc.answer("q?", docs)  # warm again (and believed warm)
    await engine.reset_cache()
    orc.configure(on_cold="raise")
    with pytest.raises(CacheMismatchError) as info:
        await orc.answer("q?", docs)
    assert info.value.cached < info.value.expected


async def test_lost_connection_retries_resets_registry_and_loses_nothing(engine, builder) -> None:
    orc = make_orc(engine, builder, max_in_flight=3)
    engine.fail_next = 3
    with orc.record_events() as log:
        results = await orc.answer_many([(f"q{i}?", [doc(f"R{i}"), doc("Rs")]) for i in range(5)])
    assert len(results) == 5 and all(isinstance(r, Answer) and r.cache_ok for r in results)
    kinds = [e.kind for e in log]
    assert "retry" in kinds and "registry_reset" in kinds


async def test_engine_that_stays_down_gives_one_error_per_question(engine, builder) -> None:
    orc = make_orc(engine, builder)
    engine.fail_next = 10**6
    results = await orc.answer_many([(f"q{i}?", [doc("Down")]) for i in range(3)])
    assert [type(r) for r in results] == [EngineUnreachableError] * 3
    assert [r.question_index for r in results] == [0, 1, 2]


async def test_retry_budget_is_counted_per_question(engine, builder) -> None:
    """Issue 14 item 11: ``give_up_after_s`` counts from the question's own first failure. Here
    the connection drops once, well after ``give_up_after_s`` from the batch start; before, the
    questions failing then got no retry at all."""
    engine.delay = 0.03
    policy = RetryPolicy(max_attempts=3, backoff_s=0.001, max_backoff_s=0.005,
                         give_up_after_s=0.2)
    orc = make_orc(engine, builder, retry=policy, max_in_flight=1)
    batch = [(f"q{i}?", [doc(f"Late{i}")]) for i in range(12)]  # ~25 requests, ~0.8 s
    asyncio.get_running_loop().call_later(0.5, setattr, engine, "fail_next", 1)
    with orc.record_events() as log:
        results = await orc.answer_many(batch)
    kinds = [e.kind for e in log]
    assert "retry" in kinds and log[-1].t - log[0].t > 0.5
    assert all(isinstance(r, Answer) for r in results), results
    assert sum(r.attempts for r in results) >= len(batch)


def peak_in_flight(log, kind: str) -> int:
    now = peak = 0
    for e in log:
        if e.kind == f"{kind}_sent":
            now += 1
            peak = max(peak, now)
        elif e.kind in (f"{kind}_done", f"{kind}_failed"):
            now -= 1
    return peak


async def test_default_concurrency_sends_warm_finals_together(engine, builder) -> None:
    """Issue 14 item 8: with the default options a batch over warm spans has all its finals in
    flight at once (the engine decodes them together: +42% samples/s measured in
    results/answer_many_vs_gather.json), while span prefills stay few (8), so the oldest
    questions' finals are not queued behind a crowd of prefills. Before: 8 in flight, 4
    prefills."""
    orc = Orchestrator(engine, builder)  # default options
    pool = [doc(f"Pool{k}") for k in range(12)]
    batch = [(f"q{i}?", [pool[i % 12], pool[(i + 5) % 12]]) for i in range(24)]
    with orc.record_events() as cold:
        results = await orc.answer_many(batch)
    assert all(isinstance(r, Answer) and r.cache_ok for r in results)
    assert 1 < peak_in_flight(cold, "prefill") <= 8
    with orc.record_events() as warm:
        results = await orc.answer_many([(f"again {q}", docs) for q, docs in batch])
    assert all(r.prefills_sent == 0 and r.cache_ok for r in results)
    assert peak_in_flight(warm, "final") == 24


async def test_request_timeout(engine, builder) -> None:
    engine.delay = 2.0
    orc = make_orc(engine, builder, request_timeout_s=0.05)
    with pytest.raises(RequestTimeoutError):
        await orc.answer("q?", [doc("T")])


async def test_bad_input_is_reported_per_question(engine, builder) -> None:
    orc = make_orc(engine, builder)
    for bad in ("", "   "):
        with pytest.raises(BadInputError, match="question is empty"):
            await orc.answer(bad, [doc("X")])
    with pytest.raises(BadInputError, match="no documents"):
        await orc.answer("q?", [])
    with pytest.raises(SpanTooLongError):
        await orc.answer("q?", ["word " * 5000])
    with pytest.raises(BadInputError, match="sampling"):
        await orc.answer("q?", [doc("X")], max_tokenz=3)
    with pytest.raises(BadInputError, match="mode"):
        await orc.answer("q?", [doc("X")], mode="nonsense")
    results = await orc.answer_many([("fine?", [doc("X")]), ("", [doc("X")]), 42,
                                     ("long?", ["word " * 5000])])
    assert isinstance(results[0], Answer)
    assert [type(r) for r in results[1:]] == [BadInputError, BadInputError, SpanTooLongError]
    assert [r.question_index for r in results[1:]] == [1, 2, 3]


def test_config_mismatch_is_refused(builder) -> None:
    other = SpanConfig(block_size=64, ssep_id=builder.span_config.ssep_id,
                       pdep_id=builder.span_config.pdep_id, pad_id=builder.span_config.pad_id)
    with pytest.raises(ConfigMismatchError, match="block_size"):
        Orchestrator(SimulatedEngine(other), builder)


def test_sync_facade_runs_on_its_own_loop(engine, builder) -> None:
    with SyncOrchestrator(lambda: make_orc(engine, builder)) as orc:
        a = orc.answer("q?", [doc("S")])
        assert a.cache_ok and a.text == "ok"
        results = orc.answer_many(["q1?", "q2?"], documents=[doc("S")])
        assert all(isinstance(r, Answer) for r in results)
        assert orc.warm([doc("S2")]) == 1 and orc.warm([doc("S2")]) == 0
        with pytest.raises(MinipicError):
            orc.answer("", [doc("S")])


def test_sync_facade_has_the_async_methods_and_arguments() -> None:
    import inspect

    def public(cls: type) -> set[str]:
        return {name for name in dir(cls) if not name.startswith("_")}

    assert public(Orchestrator) - public(SyncOrchestrator) == {"aclose"}  # sync: close()
    for name in ("build", "answer", "answer_many", "warm"):
        ours = inspect.signature(getattr(SyncOrchestrator, name)).parameters
        theirs = inspect.signature(getattr(Orchestrator, name)).parameters
        assert list(ours) == list(theirs), name
