"""The orchestrator on a real in-process vLLM engine (``AsyncLLM`` + the minipic plugin).

One tiny-Llama orchestrator serves the session (``tiny_orchestrator`` in conftest); answer
quality does not matter there, cache behaviour does. One test starts the default model for a
real answer. Tests isolate themselves with a fresh ``cache_salt`` (a salted span is a different
cache entry), so they do not depend on each other's warm spans.

Where a test needs other scheduler options or must count requests, it builds a second
``Orchestrator`` over the same engine through ``CountingBackend``, which forwards every call to
the real backend and records the token ids it sent.
"""

from __future__ import annotations

import uuid
from collections.abc import Coroutine, Iterator
from typing import Any

import pytest
from support.counting_backend import CountingBackend
from support.documents import SYSTEM, doc
from support.pic_reference import REFERENCE_TOL, PicReference, greedy_error

from minipic.engine_ext.attention.key_shadow.pool import DEFAULT_SHARE
from minipic.orchestrator import (
    Answer,
    BadInputError,
    Orchestrator,
    RequestTimeoutError,
    Sampling,
    SpanTooLongError,
    SyncOrchestrator,
)
from minipic.orchestrator.corpus import default_corpus
from minipic.span_contract.models import default_model_dir
from minipic.tune.layout import isolated_runs

pytestmark = [pytest.mark.engine, pytest.mark.shares("tiny_orchestrator")]

def run(orc: SyncOrchestrator, coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine on the orchestrator's own loop (where its engine lives)."""
    return orc.submit(coro).result(timeout=300)


def sibling(orc: SyncOrchestrator, **options: Any) -> tuple[Orchestrator, CountingBackend]:
    counting = CountingBackend(orc.aio.backend)
    return Orchestrator(counting, orc.aio.builder, options=options or None), counting


def salt() -> str:
    return uuid.uuid4().hex


def test_answer_reports_cached_tokens_ttft_and_span_status(tiny_orchestrator) -> None:
    orc, s = tiny_orchestrator, salt()
    docs = [doc("Alpha"), doc("Beta"), doc("Gamma")]
    first = orc.answer("What is alpha3?", docs, system="Be brief.", cache_salt=s, max_tokens=4)
    prompt = orc.build("What is alpha3?", docs, "Be brief.", max_tokens=4)
    assert first.prompt_tokens == len(prompt.prompt_token_ids)
    assert first.expected_cached_tokens == prompt.expected_cached_tokens > 0
    assert first.cache_ok and first.cached_tokens >= first.expected_cached_tokens
    assert first.prefills_sent == len(prompt.span_prefills) == 4  # system + 3 documents
    assert [s.status for s in first.spans] == ["cold"] * 4 and all(s.hit for s in first.spans)
    assert 0 < first.ttft_s <= first.total_s and len(first.token_ids) == 4

    # other question, documents in another order: every span is reused where it now sits
    second = orc.answer("And gamma7?", docs[::-1], system="Be brief.", cache_salt=s,
                        max_tokens=4)
    assert second.prefills_sent == 0 and second.attempts == 1
    assert [s.status for s in second.spans] == ["warm"] * 4 and second.cache_ok
    assert second.cached_tokens == second.expected_cached_tokens

    # the baseline layout caches only the system prompt's full blocks
    plain = orc.answer("And gamma7?", docs, system="Be brief.", mode="prefix", cache_salt=s,
                       max_tokens=4)
    assert plain.cached_tokens < second.cached_tokens
    assert {s.status for s in plain.spans if s.kind == "span"} == {"uncached"}


def test_shared_document_is_prefilled_once_across_the_batch(tiny_orchestrator) -> None:
    custom, counting = sibling(tiny_orchestrator)
    s, shared = salt(), doc("Shared")
    batch = [(f"question {i}?", [shared, doc(f"Own{i}")]) for i in range(5)]
    results = run(tiny_orchestrator, custom.answer_many(batch, cache_salt=s, max_tokens=2))
    assert all(isinstance(r, Answer) and r.cache_ok for r in results)
    shared_prefill = tuple(custom.build("q?", [shared]).span_prefills[1])
    assert counting.calls.count(shared_prefill) == 1
    # system span once, shared once, one per own document, one final per question
    assert len(counting.calls) == 1 + 1 + 5 + 5


def test_isps_sends_finals_when_their_own_spans_are_warm(tiny_orchestrator) -> None:
    custom, _ = sibling(tiny_orchestrator, max_in_flight=2)
    batch = [(f"q{i}?", [doc(f"I{i}a"), doc(f"I{i}b")]) for i in range(4)]
    with custom.record_events() as log:
        results = run(tiny_orchestrator, custom.answer_many(batch, cache_salt=salt(),
                                                            max_tokens=2))
    assert all(r.cache_ok for r in results)
    steps = [(e.kind, e.job, e.key) for e in log]
    jobs = sorted({e.job for e in log if e.kind == "final_sent"})
    for job, answer in zip(jobs, results, strict=True):
        final = steps.index(("final_sent", job, None))
        for span in answer.spans:
            warmed = [i for i, (k, _, key) in enumerate(steps)
                      if k == "prefill_done" and key == span.prefill_key]
            assert warmed and warmed[0] < final, "a final went out before its span was warm"
    first_final = next(i for i, st in enumerate(steps) if st[0] == "final_sent")
    last_prefill = max(i for i, st in enumerate(steps) if st[0] == "prefill_sent")
    assert first_final < last_prefill, "no global barrier: early finals overlap later prefills"


def test_barrier_policy_waits_for_every_prefill(tiny_orchestrator) -> None:
    custom, _ = sibling(tiny_orchestrator, max_in_flight=2, policy="barrier")
    batch = [(f"q{i}?", [doc(f"Bar{i}")]) for i in range(4)]
    with custom.record_events() as log:
        results = run(tiny_orchestrator, custom.answer_many(batch, cache_salt=salt(),
                                                            max_tokens=2))
    assert all(r.cache_ok for r in results)
    kinds = [e.kind for e in log]
    assert max(i for i, k in enumerate(kinds) if k == "prefill_done") < kinds.index("final_sent")


def test_skip_warm_on_and_off(tiny_orchestrator) -> None:
    custom, counting = sibling(tiny_orchestrator)
    s = salt()
    batch = [(f"q{i}?", [doc("Keep1"), doc("Keep2")]) for i in range(3)]
    run(tiny_orchestrator, custom.answer_many(batch, cache_salt=s, max_tokens=2))
    before = len(counting.calls)
    warm = run(tiny_orchestrator, custom.answer_many(batch, cache_salt=s, skip_warm=True,
                                                     max_tokens=2))
    assert len(counting.calls) - before == 3 and sum(r.prefills_sent for r in warm) == 0
    before = len(counting.calls)
    forced = run(tiny_orchestrator, custom.answer_many(batch, cache_salt=s, skip_warm=False,
                                                       max_tokens=2))
    assert sum(r.prefills_sent for r in forced) == 3  # system + 2 documents, de-duplicated
    assert len(counting.calls) - before == 3 + 3
    assert all(r.cache_ok for r in warm + forced)


def test_prefix_cache_reset_is_detected_and_spans_rewarmed(tiny_orchestrator) -> None:
    orc, s = tiny_orchestrator, salt()
    docs = [doc("Reset1"), doc("Reset2")]
    first = orc.answer("q?", docs, cache_salt=s, max_tokens=2)
    run(orc, orc.aio.backend.reset_cache())  # AsyncLLM.reset_prefix_cache(); registry unaware
    with orc.record_events() as log:
        reported = orc.answer("q?", docs, cache_salt=s, max_tokens=2)
    # default on_cold="report": one final; the engine computed the cold spans in isolation, so
    # the answer is the warm one, and the spans are cached now
    assert "cold" in [e.kind for e in log] and reported.attempts == 1 and not reported.cache_ok
    assert reported.token_ids == first.token_ids
    # the registry now knows those spans were cold: the next answer warms them itself
    warm = orc.answer("q?", docs, cache_salt=s, max_tokens=2)
    assert warm.cache_ok and warm.attempts == 1 and warm.token_ids == first.token_ids
    run(orc, orc.aio.backend.reset_cache())
    orc.configure(on_cold="retry")
    try:
        with orc.record_events() as log:
            again = orc.answer("q?", docs, cache_salt=s, max_tokens=2)
    finally:
        orc.configure(on_cold="report")
    assert "cold" in [e.kind for e in log] and again.token_ids == first.token_ids
    assert again.attempts == 2 and again.cache_ok and again.prefills_sent == 3
    orc.reset_cache()  # engine and registry together: no surprise, no second attempt
    assert len(orc.registry) == 0
    fresh = orc.answer("q?", docs, cache_salt=s, max_tokens=2)
    assert fresh.attempts == 1 and fresh.prefills_sent == 3 and fresh.cache_ok


def test_cache_salt_scopes_spans(tiny_orchestrator) -> None:
    orc = tiny_orchestrator
    docs = [doc("Tenant")]
    a = orc.answer("q?", docs, cache_salt=salt(), max_tokens=2)
    b = orc.answer("q?", docs, cache_salt=salt(), max_tokens=2)
    assert a.prefills_sent == b.prefills_sent == 2, "another salt must warm its own copy"
    assert a.cache_ok and b.cache_ok


def test_bad_input_and_engine_rejections(tiny_orchestrator) -> None:
    orc = tiny_orchestrator
    with pytest.raises(BadInputError, match="question is empty"):
        orc.answer(" ", [doc("X")])
    with pytest.raises(BadInputError, match="no documents"):
        orc.answer("q?", [])
    with pytest.raises(SpanTooLongError, match="max_model_len 2048"):
        orc.answer("q?", [doc("Huge", 3000)])
    with pytest.raises(BadInputError, match="max_tokens"):
        orc.answer("q?", [doc("X")], max_tokens=0)
    # the engine's own check, reached by sending ids past the engine's context directly
    with pytest.raises(BadInputError, match="maximum context length"):
        run(orc, orc.aio.backend.generate([100] * 3000, sampling=Sampling(max_tokens=1)))
    results = orc.answer_many([("fine?", [doc("Ok")]), ("", [doc("Ok")]),
                               ("long?", [doc("Huge", 3000)])], max_tokens=2)
    assert isinstance(results[0], Answer)
    assert [type(r) for r in results[1:]] == [BadInputError, SpanTooLongError]


def test_timeout_aborts_and_engine_keeps_serving(tiny_orchestrator) -> None:
    custom, _ = sibling(tiny_orchestrator, request_timeout_s=0.001)
    with pytest.raises(RequestTimeoutError):
        run(tiny_orchestrator, custom.answer("q?", [doc("Slow")], cache_salt=salt(),
                                             max_tokens=64))
    assert tiny_orchestrator.answer("q?", [doc("Slow")], max_tokens=2).cache_ok


@pytest.fixture(scope="module")
def smol_orchestrator() -> Iterator[SyncOrchestrator]:
    orc = SyncOrchestrator.embedded()  # the default model, SmolLM2-135M-Instruct
    yield orc
    orc.close()


def test_real_answer_with_the_default_model(smol_orchestrator) -> None:
    question = "What is the height of K2?"
    docs = [p.as_document for p in default_corpus().search(question, 3)]
    plain = smol_orchestrator.answer(question, docs, SYSTEM, "prefix", max_tokens=24)
    assert plain.cache_ok and "8,611" in plain.text, f"prefix: {plain.text!r}"
    # block_attention approximates that answer (its fidelity is measured over 300 items,
    # results/fidelity/sink); what must hold here is that the engine, answering from the cache,
    # decodes what the layout rule's reference decodes for the same prompt
    spans = smol_orchestrator.answer(question, docs, SYSTEM, "block_attention", max_tokens=24)
    assert spans.cache_ok and spans.cached_tokens > 0, spans
    built = smol_orchestrator.aio.builder.build(question=question, system=SYSTEM, spans=docs,
                                                mode="block_attention", max_tokens=24)
    assert built.num_prompt_tokens == spans.prompt_tokens
    err = greedy_error(built.prompt_token_ids, [(a, b) for a, b, _ in isolated_runs(built)],
                       spans.token_ids, PicReference(default_model_dir()))
    assert err < 2 * REFERENCE_TOL, f"{spans.text!r}: off the reference's greedy by {err:.2e}"


def test_kv_memory_in_use_is_reported(tiny_orchestrator) -> None:
    """The embedded backend's KV monitor: block bytes agree with how the CPU worker sized its
    cache (vLLM's stock page, K and V of head size per token, with the position-free backend
    on), and a batch's peak holds at least
    the blocks of its largest request while it runs."""
    backend = tiny_orchestrator.aio.backend
    monitor = backend.kv_usage
    space = int(float(backend.settings.plugin_env()["VLLM_CPU_KVCACHE_SPACE"]) * (1 << 30))
    assert monitor.position_free and monitor.block_bytes > 0
    # the key shadow takes its share of the configured space; the KV blocks the rest
    pool_budget = int(space * DEFAULT_SHARE)
    assert monitor.blocks_total == (space - pool_budget) // monitor.block_bytes
    monitor.reset()
    docs = [doc(f"Kv{i}", words=60) for i in range(3)]
    answers = tiny_orchestrator.answer_many(
        [(f"question {i}?", docs[i:] + docs[:i]) for i in range(3)], cache_salt=salt(),
        max_tokens=4)
    usage = monitor.snapshot()
    block = backend.settings.block_size
    largest = max(-(-a.prompt_tokens // block) for a in answers)
    assert usage.samples > 0 and largest <= usage.peak_blocks <= usage.blocks_total
    assert 0 < usage.mean_blocks <= usage.peak_blocks
    assert usage.peak_mib == usage.peak_blocks * usage.block_bytes / (1 << 20)
    # the key shadow's pool is reported with its budget; span requests never fill it: rule 1
    # (docs/design.md §2) attends every request holding layout tokens on the masked path, whose
    # keys come from the cache itself (the shadow has no key mask)
    pool = run(tiny_orchestrator, backend.rotated_pool_stats())
    assert pool["budget_bytes"] == pool_budget and pool["pools"] >= 1
    assert pool["peak_bytes"] == 0 and pool["cap_bytes"] <= pool_budget
    # the scheduler counted the prefill steps of those prompts (finals and span prefills)
    steps = run(tiny_orchestrator, backend.prefill_step_stats())
    finals = [e for e in steps["recent"] if e["prompt_tokens"] in
              {a.prompt_tokens for a in answers}]
    assert len(finals) >= 3 and all(e["steps"] >= 1 for e in finals), steps
