"""LlamaIndex's token counting sees minipic's calls both ways LlamaIndex documents callbacks:
``Settings.callback_manager``, and a ``callback_manager`` given to the LLM itself -- which
LlamaIndex's own glue replaces with the index's (``resolve_llm`` in
``index.as_query_engine(llm=...)``) and which ``MinipicLLM`` must keep. A ``SummaryIndex`` over
fresh random documents, ``SpanSynthesizer`` as the synthesizer, on the shared tiny engine; the
second query of each way finds its spans cached."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.shares("tiny_orchestrator")

WORDS = ("river", "stone", "lamp", "north", "copper", "valley", "harbor", "signal", "garden",
         "winter", "market", "tower", "meadow", "engine", "paper", "silver")


@pytest.fixture
def settings_manager() -> Iterator[None]:
    """Put LlamaIndex's global callback manager back after the test."""
    from llama_index.core import Settings

    before = Settings.callback_manager
    yield
    Settings.callback_manager = before


def _documents(rng: random.Random) -> list[Any]:
    from llama_index.core import Document

    return [Document(text=" ".join(rng.choice(WORDS) for _ in range(rng.randrange(30, 60))))
            for _ in range(3)]


@pytest.mark.parametrize("way", ["settings", "llm"])
def test_token_counting_sees_every_call_both_ways(tiny_orchestrator, settings_manager, seed,
                                                  way) -> None:
    from llama_index.core import Settings, SummaryIndex
    from llama_index.core.callbacks import CallbackManager, TokenCountingHandler

    from minipic.integrations.llamaindex import MinipicLLM, SpanSynthesizer

    rng = random.Random(seed)
    counter = TokenCountingHandler()
    answer_kwargs = {"max_tokens": 4}
    if way == "settings":
        Settings.callback_manager = CallbackManager([counter])
        llm = MinipicLLM(orchestrator=tiny_orchestrator, answer_kwargs=answer_kwargs)
    else:
        Settings.callback_manager = CallbackManager([])
        llm = MinipicLLM(orchestrator=tiny_orchestrator, answer_kwargs=answer_kwargs,
                         callback_manager=CallbackManager([counter]))
    global_handlers = list(Settings.callback_manager.handlers)
    index = SummaryIndex.from_documents(_documents(rng))
    engine = index.as_query_engine(llm=llm, response_synthesizer=SpanSynthesizer(llm=llm))
    question = " ".join(rng.choice(WORDS) for _ in range(5)) + "?"
    usages = []
    for _ in range(2):
        response = engine.query(question)
        usages.append(response.metadata["minipic"]["usage"])
    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    assert prompt_tokens > 0
    assert counter.prompt_llm_token_count == prompt_tokens, (way, usages)
    assert counter.completion_llm_token_count == sum(u["completion_tokens"] for u in usages)
    assert len(counter.llm_token_counts) == 2  # one event per call, not twice
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] > 0  # the spans were reused
    # the global manager was not changed in place to carry the LLM's handler
    assert Settings.callback_manager.handlers == global_handlers
