"""LangChain integration: ``WikiRetriever`` and ``SpanRAGRunnable`` (LCEL, invoke/batch, async).

Fast tests cover the document -> span conversion and the retriever. Runnable tests answer on the
session's tiny embedded engine (mechanics: span ids, one ``answer_many`` per batch, callbacks)
and one real answer comes from the default model behind ``minipic serve``.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from typing import Any

import pytest
from langchain_core.callbacks import BaseCallbackHandler, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableLambda

from orchestrator import Answer, BadInputError, Orchestrator, SyncOrchestrator
from orchestrator.langchain_adapter import SpanRAGRunnable, documents_to_spans, question_of
from orchestrator.wiki_retriever import WikiRetriever

os.environ.setdefault("MINIPIC_CACHE_DIR", "/tmp/mpcache")


class ListRetriever(BaseRetriever):
    """Returns the shared document plus one per question word count (deterministic, no index)."""

    docs: list[Document]

    def _get_relevant_documents(self, query: str, *,
                                run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        return [self.docs[0], self.docs[1 + len(query.split()) % (len(self.docs) - 1)]]


class Recorder(BaseCallbackHandler):
    def __init__(self) -> None:
        self.events: list[str] = []

    def on_chain_start(self, serialized: Any, inputs: Any, **kwargs: Any) -> None:
        self.events.append("chain_start")

    def on_chain_end(self, outputs: Any, **kwargs: Any) -> None:
        self.events.append("chain_end")

    def on_retriever_start(self, serialized: Any, query: str, **kwargs: Any) -> None:
        self.events.append("retriever_start")

    def on_retriever_end(self, documents: Any, **kwargs: Any) -> None:
        self.events.append("retriever_end")


def text(name: str, words: int = 40) -> str:
    return f"{name}: " + " ".join(f"{name.lower()}{i}" for i in range(words))


DOCS = [Document(page_content=text("Common"), metadata={"span_id": "doc:common"}),
        Document(page_content=text("First"), metadata={"span_id": "doc:first"}),
        Document(page_content=text("Second"), id="doc:second"),
        Document(page_content=text("Third"))]


# -- fast ---------------------------------------------------------------------------------------


@pytest.mark.fast
def test_documents_become_spans_with_stable_ids() -> None:
    spans = documents_to_spans([*DOCS, Document(page_content="  "),
                                Document(page_content="x", metadata={"score": 0.5})])
    assert [s.id for s in spans] == ["doc:common", "doc:first", "doc:second", None, None]
    assert spans[-1].score == 0.5 and spans[0].text == DOCS[0].page_content
    titled = documents_to_spans(DOCS[:1], lambda d: "T: " + d.page_content)
    assert titled[0].text.startswith("T: Common")


@pytest.mark.fast
def test_question_of_inputs() -> None:
    assert question_of("why?") == "why?"
    assert question_of({"question": "why?"}) == question_of({"input": "why?"}) == "why?"
    for bad in ("", {"q": "why?"}, 3):
        with pytest.raises(BadInputError):
            question_of(bad)


@pytest.mark.fast
def test_wiki_retriever_contract() -> None:
    retriever = WikiRetriever(k=2)
    recorder = Recorder()
    docs = retriever.invoke("Who wrote Hamlet?", config={"callbacks": [recorder]})
    assert len(docs) == 2 and docs[0].metadata["span_id"] == "wiki:Hamlet"
    assert docs[0].page_content.startswith("Hamlet: ")
    assert recorder.events == ["retriever_start", "retriever_end"]
    again = asyncio.run(retriever.ainvoke("Who wrote Hamlet?"))
    assert [d.id for d in again] == [d.id for d in docs]
    assert [len(b) for b in retriever.batch(["K2 height", "Apple headquarters"])] == [2, 2]


# -- tiny embedded engine -----------------------------------------------------------------------


@pytest.mark.engine
def test_runnable_invoke_lcel_and_callbacks(tiny_orchestrator: SyncOrchestrator) -> None:
    chain = SpanRAGRunnable(retriever=ListRetriever(docs=DOCS), orchestrator=tiny_orchestrator,
                            answer_kwargs={"max_tokens": 3, "cache_salt": uuid.uuid4().hex})
    recorder = Recorder()
    answer = chain.invoke({"question": "one two three"}, config={"callbacks": [recorder]})
    assert isinstance(answer, Answer) and answer.cache_ok
    assert [s.span_id for s in answer.spans if s.kind == "span"] == ["doc:common", "doc:first"]
    assert recorder.events == ["chain_start", "retriever_start", "retriever_end", "chain_end"]
    composed = chain | RunnableLambda(lambda a: (a.cache_ok, len(a.token_ids)))
    assert composed.invoke("one two") == (True, 3)
    as_text = chain.model_copy(update={"output": "text"})
    assert isinstance(as_text.invoke("one"), str)


@pytest.mark.engine
def test_runnable_batch_is_one_isps_batch(tiny_orchestrator: SyncOrchestrator) -> None:
    chain = SpanRAGRunnable(retriever=ListRetriever(docs=DOCS), orchestrator=tiny_orchestrator,
                            answer_kwargs={"max_tokens": 2, "cache_salt": uuid.uuid4().hex})
    with tiny_orchestrator.record_events() as log:
        results = chain.batch(["a", "a b", "a b c", ""], return_exceptions=True)
    assert [type(r) for r in results] == [Answer, Answer, Answer, BadInputError]
    common = results[0].spans[1].prefill_key
    sent = [e for e in log if e.kind == "prefill_sent"]
    assert [e.key for e in sent].count(common) == 1, "shared document prefilled once"
    assert len({e.job for e in log if e.kind == "final_sent"}) == 3
    with pytest.raises(BadInputError):
        chain.batch(["a", ""])


@pytest.mark.engine
async def test_runnable_async_paths(tiny_orchestrator: SyncOrchestrator) -> None:
    chain = SpanRAGRunnable(retriever=ListRetriever(docs=DOCS), orchestrator=tiny_orchestrator,
                            output="text", answer_kwargs={"max_tokens": 2})
    assert isinstance(await chain.ainvoke("async one"), str)
    outs = await chain.abatch(["x", "x y"])
    assert len(outs) == 2 and all(isinstance(o, str) for o in outs)


# -- real answer over HTTP ------------------------------------------------------------------------


@pytest.mark.server
async def test_wiki_rag_chain_answers_with_the_default_model(smol_server) -> None:
    async with Orchestrator.connect(smol_server.base_url) as orc:
        chain = SpanRAGRunnable(
            retriever=WikiRetriever(k=3), orchestrator=orc,
            system="You are a concise assistant. Answer the question using only the documents "
                   "provided. Reply with a short phrase, not a sentence.",
            answer_kwargs={"max_tokens": 24},
        )
        answer = await chain.ainvoke("What is the height of K2?")
        assert "8,611" in answer.text and answer.cache_ok
        assert "wiki:K2" in [s.span_id for s in answer.spans]
        with pytest.raises(Exception, match="ainvoke"):
            chain.invoke("What is the height of K2?")  # sync call inside a running loop
