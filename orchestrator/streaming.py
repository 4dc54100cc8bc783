"""Token streaming for one question: warm its spans, then stream the final prompt's tokens.

Why beside the scheduler and not in it: the scheduler's final step may send the final prompt
again (a cold span with ``on_cold="retry"``, a lost connection), and a stream cannot take back
tokens it has handed out. So a streamed answer warms its spans exactly as ``answer`` does
(``Scheduler.prewarm``: warm spans skipped, prefills in flight joined, de-duplicated), sends the
final prompt once, yields each text delta as the engine produces it, and ends with the
``Answer`` that ``answer`` would have returned (cached tokens, span hits, timings). A failure
raises; nothing is re-sent. Spans the cache check finds cold are marked cold in the registry, so
the next question re-warms them.

Both backends stream (``HttpBackend.stream``: SSE chunks of ``/v1/completions``;
``EmbeddedBackend.stream``: ``AsyncLLM.generate`` deltas); a backend without ``stream`` yields
its whole text as one delta.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol, runtime_checkable

from minipic.orchestrator.backends import Completion, Sampling
from minipic.orchestrator.client import Document, Orchestrator
from minipic.orchestrator.errors import RequestTimeoutError
from minipic.orchestrator.results import Answer, SpanStatus, fallback_reason
from minipic.orchestrator.warmth import CacheCheck, check_cache
from minipic.prompt_builder import BudgetPolicy, BuiltPrompt, Mode


@runtime_checkable
class StreamingBackend(Protocol):
    def stream(self, token_ids: Sequence[int], *, sampling: Sampling,
               cache_salt: str | None = None, request_id: str | None = None,
               ) -> AsyncIterator[str | Completion]:
        """Text deltas as they are produced, then the ``Completion``."""
        ...


async def _final(backend: Any, ids: Sequence[int], sampling: Sampling, salt: str | None,
                 idle_timeout_s: float | None) -> AsyncIterator[str | Completion]:
    """The final prompt's deltas and Completion; ``idle_timeout_s`` bounds the wait for each
    next item (the scheduler's per-request timeout, as time without progress)."""
    items = (backend.stream(ids, sampling=sampling, cache_salt=salt)
             if isinstance(backend, StreamingBackend) else _whole(backend, ids, sampling, salt))
    try:
        while True:
            try:
                async with asyncio.timeout(idle_timeout_s):  # never held across a yield
                    item = await anext(items)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise RequestTimeoutError(
                    f"no output from the engine for {idle_timeout_s} s") from None
            yield item
    finally:
        await items.aclose()  # stops the engine request when the consumer stops early


async def _whole(backend: Any, ids: Sequence[int], sampling: Sampling, salt: str | None
                 ) -> AsyncIterator[str | Completion]:
    """A backend without ``stream``: its whole text as one delta."""
    done = await backend.generate(ids, sampling=sampling, cache_salt=salt)
    if done.text:
        yield done.text
    yield done


def _statuses(prompt: BuiltPrompt, believed_warm: set[str], check: CacheCheck
              ) -> list[SpanStatus]:
    out = []
    for i, span in enumerate(prompt.spans):
        if span.prefill_key is None:
            status = "uncached"
        elif span.prefill_key in believed_warm:
            status = "warm"
        else:
            status = "cold"
        out.append(SpanStatus(kind=span.kind, span_id=span.span_id, index=span.index,
                              tokens=span.token_count, prefill_key=span.prefill_key,
                              status=status, hit=check.hits.get(i)))
    return out


async def stream_answer(
    orc: Orchestrator,
    question: str,
    documents: Sequence[Document] = (),
    system: str | None = None,
    mode: Mode | str = Mode.BLOCK_ATTENTION,
    *,
    cache_salt: str | None = None,
    budget: BudgetPolicy | str = BudgetPolicy.ERROR,
    require_documents: bool = True,
    **sampling: Any,
) -> AsyncIterator[str | Answer]:
    """Like ``Orchestrator.answer``, but yields the answer's text deltas (``str``) as they are
    produced, then the ``Answer``. Raises a ``MinipicError`` subclass on failure; its arguments
    are checked and laid out by ``answer``'s own step (``Orchestrator._prepare``), so they are
    refused exactly as ``answer`` refuses them."""
    await orc.check_model()
    prompt, params = orc._prepare(question, documents, system, mode, cache_salt=cache_salt,
                                  budget=budget, require_documents=require_documents,
                                  sampling=sampling)
    started = time.perf_counter()
    skip = orc.options.skip_warm
    believed = {k for k in prompt.prefill_keys if skip and (cache_salt, k) in orc.registry}
    prefills = await orc.scheduler.prewarm(prompt, cache_salt)
    sent = time.perf_counter()
    done: Completion | None = None
    async for item in _final(orc.backend, prompt.prompt_token_ids, params, cache_salt,
                             orc.options.request_timeout_s):
        if isinstance(item, Completion):
            done = item
        else:
            yield item
    assert done is not None, "a stream ends with its Completion"
    check = check_cache(prompt, done.cached_tokens)
    if not check.ok:
        orc.registry.mark_cold([(cache_salt, key) for key in check.cold_keys])
    yield Answer(
        question=question, text=done.text, token_ids=done.token_ids, mode=prompt.mode,
        ttft_s=done.ttft_s, warm_s=sent - started, total_s=time.perf_counter() - started,
        prompt_tokens=done.prompt_tokens, cached_tokens=done.cached_tokens,
        expected_cached_tokens=check.expected, cache_ok=check.ok,
        spans=_statuses(prompt, believed, check), prefills_sent=prefills, attempts=1,
        finish_reason=done.finish_reason, budget=prompt.budget,
        skipped_spans=prompt.skipped_spans, fallback=fallback_reason(orc.backend),
    )
