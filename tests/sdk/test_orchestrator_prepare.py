"""``stream_answer`` and ``answer`` check their arguments in one prepare step (issue 36):
``stream_answer`` refuses a bad ``cache_salt`` (it used to skip that check) and bad sampling
arguments exactly as ``answer`` does — same type, same message — before anything is sent.

Real parts only: an ``HttpBackend`` pointed at a closed port (as when ``minipic serve`` is
down), so a question that got past the checks would end as ``EngineUnreachableError``, not as
the ``BadInputError`` asserted here; the good-salt test shows that it does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from support.counting_backend import CountingBackend
from support.servers import free_port

from minipic.orchestrator import (
    BackendInfo,
    BadInputError,
    EngineUnreachableError,
    Orchestrator,
    RetryPolicy,
)
from minipic.orchestrator.http_backend import HttpBackend
from minipic.orchestrator.streaming import stream_answer
from minipic.prompt_builder import PromptBuilder

pytestmark = pytest.mark.fast

DOCS = ["Alpha: " + " ".join(f"alpha{i}" for i in range(30))]
BAD = {
    "empty salt": {"cache_salt": ""},
    "lone surrogate salt": {"cache_salt": "\ud800"},
    "int salt": {"cache_salt": 42},
    "bytes salt": {"cache_salt": b"tenant"},
    "unknown sampling argument": {"max_tokenz": 3},
    "bad sampling value": {"max_tokens": 0},
}


@pytest.fixture(scope="module")
def builder() -> PromptBuilder:
    return PromptBuilder.from_pretrained("tiny-llama", max_model_len=2048)


@pytest.fixture
async def orc(builder: PromptBuilder) -> AsyncIterator[Orchestrator]:
    info = BackendInfo(kind="http", model="tiny", tokenizer="tiny-llama", max_model_len=2048,
                       span_config=builder.span_config)
    backend = CountingBackend(HttpBackend(f"http://127.0.0.1:{free_port()}", info),
                              owns_inner=True)
    orc = Orchestrator(backend, builder, options={"retry": RetryPolicy(max_attempts=1)})
    yield orc
    await orc.aclose()


async def streamed(orc: Orchestrator, **kwargs: Any) -> list[Any]:
    async with asyncio.timeout(30):
        return [item async for item in stream_answer(orc, "q?", DOCS, **kwargs)]


@pytest.mark.parametrize("bad", list(BAD.values()), ids=list(BAD))
async def test_stream_answer_refuses_what_answer_refuses(orc: Orchestrator,
                                                         bad: dict[str, Any]) -> None:
    with pytest.raises(BadInputError) as answered:
        await orc.answer("q?", DOCS, **bad)
    with pytest.raises(BadInputError) as refused:
        await streamed(orc, **bad)
    assert type(refused.value) is type(answered.value)
    assert str(refused.value) == str(answered.value)
    if "cache_salt" in bad:
        assert str(refused.value).startswith("cache_salt ")
    backend = orc.backend
    assert isinstance(backend, CountingBackend)
    assert backend.calls == [] and backend.health_checks == 0, "refused before any send"


async def test_a_good_salt_reaches_the_engine(orc: Orchestrator) -> None:
    """The control: with a valid salt the question is sent, and meets the closed port."""
    with pytest.raises(EngineUnreachableError):
        await streamed(orc, cache_salt="tenant-a", max_tokens=2)
    backend = orc.backend
    assert isinstance(backend, CountingBackend) and backend.calls, "a prefill was sent"
