"""LangChain integration: ``WikiRetriever`` and ``SpanRAGRunnable`` as a LangChain user writes it.

Fast tests cover input parsing, the document -> span conversion and the retriever. Runnable tests
answer on the module's tiny embedded engine with LangChain's own parts: prompt templates piped
in, ``StrOutputParser`` piped out, ``stream`` / ``astream``, callbacks and
``get_usage_metadata_callback``, ``as_tool``, ``max_concurrency``. One real answer, streamed
too, comes from the default model behind ``minipic serve``. LangChain's standard retriever
suite runs against ``WikiRetriever`` in ``test_langchain_standard.py``.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from langchain_core.callbacks import (
    BaseCallbackHandler,
    CallbackManagerForRetrieverRun,
    get_usage_metadata_callback,
)
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, SystemMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder, PromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableLambda
from support.pic_reference import REFERENCE_TOL, PicReference, greedy_error

from minipic.integrations.langchain.runnable import (
    SpanRAGRunnable,
    documents_to_spans,
    no_documents,
    parse_input,
    question_of,
)
from minipic.integrations.langchain.wiki_retriever import WikiRetriever
from minipic.orchestrator import Answer, BadInputError, Orchestrator, SyncOrchestrator
from minipic.span_contract.models import default_model_dir
from minipic.tune.layout import isolated_runs

pytestmark = pytest.mark.shares("tiny_orchestrator", "smol_server")


class ListRetriever(BaseRetriever):
    """Returns the shared document plus one per question word count (deterministic, no index)."""

    docs: list[Document]

    def _get_relevant_documents(self, query: str, *,
                                run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        if not self.docs:
            return []
        return [self.docs[0], self.docs[1 + len(query.split()) % (len(self.docs) - 1)]]


class Recorder(BaseCallbackHandler):
    def __init__(self) -> None:
        self.events: list[str] = []
        self.prompts: list[str] = []
        self.tokens: list[str] = []
        self.llm_output: Any = None

    def on_chain_start(self, serialized: Any, inputs: Any, **kwargs: Any) -> None:
        self.events.append("chain_start")

    def on_chain_end(self, outputs: Any, **kwargs: Any) -> None:
        self.events.append("chain_end")

    def on_retriever_start(self, serialized: Any, query: str, **kwargs: Any) -> None:
        self.events.append("retriever_start")

    def on_retriever_end(self, documents: Any, **kwargs: Any) -> None:
        self.events.append("retriever_end")

    def on_llm_start(self, serialized: Any, prompts: list[str], **kwargs: Any) -> None:
        self.events.append("llm_start")
        self.prompts += prompts

    def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
        self.tokens.append(token)

    def on_llm_end(self, response: Any, **kwargs: Any) -> None:
        self.events.append("llm_end")
        self.llm_output = response


def text(name: str, words: int = 40) -> str:
    return f"{name}: " + " ".join(f"{name.lower()}{i}" for i in range(words))


DOCS = [Document(page_content=text("Common"), metadata={"span_id": "doc:common"}),
        Document(page_content=text("First"), metadata={"span_id": "doc:first"}),
        Document(page_content=text("Second"), id="doc:second"),
        Document(page_content=text("Third"))]


def rag(orc: Any, **kwargs: Any) -> SpanRAGRunnable:
    answer_kwargs = {"max_tokens": 3, "cache_salt": uuid.uuid4().hex,
                     **kwargs.pop("answer_kwargs", {})}
    return SpanRAGRunnable(retriever=kwargs.pop("retriever", ListRetriever(docs=DOCS)),
                           orchestrator=orc, answer_kwargs=answer_kwargs, **kwargs)


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
    for bad in ("", {"q": "why?"}, 3, {"question": b"why?"}, [SystemMessage("only system")]):
        with pytest.raises(BadInputError):
            question_of(bad)


@pytest.mark.fast
def test_prompt_values_and_messages_are_inputs() -> None:
    string_value = PromptTemplate.from_template("Briefly: {q}").invoke({"q": "K2 height?"})
    assert parse_input(string_value).question == "Briefly: K2 height?"
    chat = ChatPromptTemplate.from_messages([
        ("system", "Answer in French."), MessagesPlaceholder("history"), ("human", "{q}"),
    ]).invoke({"q": "And its height?", "history": [HumanMessage("Where is K2?"),
                                                  AIMessage("In the Karakoram.")]})
    parsed = parse_input(chat)
    assert parsed.system == "Answer in French." and parsed.query == "And its height?"
    assert parsed.question == ("User: Where is K2?\nAssistant: In the Karakoram.\n"
                               "User: And its height?")
    assert parse_input([HumanMessage("hi")]).question == "hi"


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
    assert len(retriever.invoke("K2 height", k=4)) == 4  # per call, as LangChain passes it
    assert len(asyncio.run(retriever.ainvoke("K2 height", k=1))) == 1
    with pytest.raises(ValueError, match="k must be"):
        retriever.invoke("K2 height", k=0)


# -- tiny embedded engine -----------------------------------------------------------------------


@pytest.mark.engine
def test_runnable_invoke_lcel_and_callbacks(tiny_orchestrator: SyncOrchestrator) -> None:
    chain = rag(tiny_orchestrator, output="answer")
    recorder = Recorder()
    answer = chain.invoke({"question": "one two three"}, config={"callbacks": [recorder]})
    assert isinstance(answer, Answer) and answer.cache_ok and not no_documents(answer)
    assert [s.span_id for s in answer.spans if s.kind == "span"] == ["doc:common", "doc:first"]
    # the model call is a child LLM run, between retrieval and the chain's end
    assert recorder.events == ["chain_start", "retriever_start", "retriever_end", "llm_start",
                               "llm_end", "chain_end"]
    assert "Question: one two three" in recorder.prompts[0]
    assert text("Common") in recorder.prompts[0]
    composed = chain | RunnableLambda(lambda a: (a.cache_ok, len(a.token_ids)))
    assert composed.invoke("one two") == (True, 3)


@pytest.mark.engine
def test_default_output_is_text_for_parsers_and_tools(tiny_orchestrator: SyncOrchestrator
                                                      ) -> None:
    chain = rag(tiny_orchestrator)
    assert isinstance(chain.invoke("one"), str)
    assert isinstance((chain | StrOutputParser()).invoke("one"), str)
    tool = chain.as_tool(name="docs_qa", description="answers from the documents",
                         arg_types={"question": str})
    assert isinstance(tool.invoke({"question": "one"}), str)
    message = rag(tiny_orchestrator, output="message").invoke("one two")
    assert isinstance(message, AIMessage) and isinstance(message.content, str)
    usage = message.usage_metadata
    assert usage is not None and usage["output_tokens"] == 3
    assert usage["input_token_details"]["cache_read"] == message.response_metadata[
        "cached_tokens"] > 0
    assert (rag(tiny_orchestrator, output="message") | StrOutputParser()).invoke("x") != ""


@pytest.mark.engine
def test_typed_schemas(tiny_orchestrator: SyncOrchestrator) -> None:
    chain = rag(tiny_orchestrator)
    schema = chain.get_input_jsonschema()
    kinds = [s.get("type") for s in schema["anyOf"]]
    assert "string" in kinds and "array" in kinds
    assert "question" in str(schema)
    assert chain.get_output_jsonschema()["type"] == "string"
    answer_schema = rag(tiny_orchestrator, output="answer").get_output_jsonschema()
    assert "cached_tokens" in answer_schema["properties"]


@pytest.mark.engine
def test_prompt_templates_pipe_into_rag(tiny_orchestrator: SyncOrchestrator) -> None:
    recorder = Recorder()
    chain = (PromptTemplate.from_template("{topic} one two") | rag(tiny_orchestrator)
             | StrOutputParser())
    assert isinstance(chain.invoke({"topic": "Tell"}), str)
    chat = ChatPromptTemplate.from_messages([("system", "You are terse."), ("human", "{q}")])
    out = (chat | rag(tiny_orchestrator, output="answer", system="default system")).invoke(
        {"q": "one two"}, config={"callbacks": [recorder]})
    assert isinstance(out, Answer) and out.spans[0].kind == "system"
    assert recorder.prompts[0].startswith("System: You are terse.")  # the chat's system wins


@pytest.mark.engine
def test_stream_yields_tokens_as_they_come(tiny_orchestrator: SyncOrchestrator) -> None:
    chain = rag(tiny_orchestrator, answer_kwargs={"max_tokens": 8})
    whole = chain.invoke("stream one")
    recorder = Recorder()
    chunks = list(chain.stream("stream one", config={"callbacks": [recorder]}))
    assert len(chunks) > 1 and all(isinstance(c, str) for c in chunks)
    assert "".join(chunks) == whole  # greedy: the same text, in pieces
    assert recorder.tokens == chunks and recorder.events[-2:] == ["llm_end", "chain_end"]
    # through LCEL: the parser streams too
    piped = list((PromptTemplate.from_template("{q}") | chain | StrOutputParser()).stream(
        {"q": "stream one"}))
    assert len(piped) > 1 and "".join(piped) == whole
    messages = list(rag(tiny_orchestrator, output="message",
                        answer_kwargs={"max_tokens": 8}).stream("stream one"))
    assert all(isinstance(m, AIMessageChunk) for m in messages) and len(messages) > 2
    merged = sum(messages[1:], messages[0])
    assert merged.content == whole and 0 < merged.usage_metadata["output_tokens"] <= 8
    assert merged.usage_metadata["input_token_details"]["cache_read"] > 0
    # a consumer that stops early stops the engine request; the engine goes on serving
    long = rag(tiny_orchestrator, answer_kwargs={"max_tokens": 200}).stream("stop early")
    assert isinstance(next(long), str)
    long.close()
    assert chain.invoke("stream one") == whole


@pytest.mark.engine
async def test_astream_and_usage_callback(tiny_orchestrator: SyncOrchestrator) -> None:
    chain = rag(tiny_orchestrator, answer_kwargs={"max_tokens": 6})
    chunks = [c async for c in chain.astream("async stream")]
    assert len(chunks) > 1 and "".join(chunks) == await chain.ainvoke("async stream")
    with get_usage_metadata_callback() as usage:
        answers = await rag(tiny_orchestrator, output="answer").abatch(["x", "x y"])
    ((model, total),) = usage.usage_metadata.items()
    assert model == tiny_orchestrator.aio.backend.info.model
    assert total["input_tokens"] == sum(a.prompt_tokens for a in answers)
    assert total["input_token_details"]["cache_read"] == sum(a.cached_tokens for a in answers)


@pytest.mark.engine
def test_runnable_batch_is_one_isps_batch(tiny_orchestrator: SyncOrchestrator) -> None:
    chain = rag(tiny_orchestrator, output="answer", answer_kwargs={"max_tokens": 2})
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
def test_batch_honours_max_concurrency(tiny_orchestrator: SyncOrchestrator) -> None:
    chain = rag(tiny_orchestrator, answer_kwargs={"max_tokens": 2})
    with tiny_orchestrator.record_events() as log:
        out = chain.batch(["a", "a b", "a b c", "a b c d"], config={"max_concurrency": 1})
    assert len(out) == 4 and all(isinstance(o, str) for o in out)
    jobs = [e.job for e in log if e.job is not None]
    order = list(dict.fromkeys(jobs))
    assert len(order) == 4
    # one question at a time: each one's requests all come before the next one's
    assert jobs == sorted(jobs, key=order.index)


@pytest.mark.engine
async def test_empty_retrieval_still_answers(tiny_orchestrator: SyncOrchestrator) -> None:
    empty = ListRetriever(docs=[])
    answer = rag(tiny_orchestrator, retriever=empty, output="answer").invoke("anything?")
    assert isinstance(answer, Answer) and no_documents(answer) and answer.text is not None
    message = await rag(tiny_orchestrator, retriever=empty, output="message").ainvoke("x?")
    assert message.response_metadata["no_documents"] is True
    assert not rag(tiny_orchestrator, output="message").invoke("x").response_metadata[
        "no_documents"]


@pytest.mark.engine
async def test_runnable_async_paths(tiny_orchestrator: SyncOrchestrator) -> None:
    chain = rag(tiny_orchestrator, answer_kwargs={"max_tokens": 2})
    assert isinstance(await chain.ainvoke("async one"), str)
    outs = await chain.abatch(["x", "x y"], config={"max_concurrency": 1})
    assert len(outs) == 2 and all(isinstance(o, str) for o in outs)


# -- real answer over HTTP ------------------------------------------------------------------------


@pytest.mark.server
async def test_wiki_rag_chain_answers_with_the_default_model(smol_server) -> None:
    async with Orchestrator.connect(smol_server.base_url) as orc:
        chain = SpanRAGRunnable(
            retriever=WikiRetriever(k=3), orchestrator=orc, output="answer",
            system="You are a concise assistant. Answer the question using only the documents "
                   "provided. Reply with a short phrase, not a sentence.",
            answer_kwargs={"max_tokens": 24},
        )
        question = "What is the height of K2?"
        answer = await chain.ainvoke(question)
        assert answer.cache_ok and answer.cached_tokens > 0, answer
        assert "wiki:K2" in [s.span_id for s in answer.spans]
        # the engine decoded, over HTTP, what the layout rule's reference decodes for the prompt
        # the chain sent (block_attention's fidelity to the plain prompt: results/fidelity)
        spans = documents_to_spans(await chain.retriever.ainvoke(question), chain.format_document)
        built = orc.builder.build(question=question, system=chain.system, spans=spans,
                                  mode=chain.mode, max_tokens=24)
        assert built.num_prompt_tokens == answer.prompt_tokens
        err = greedy_error(built.prompt_token_ids, [(a, b) for a, b, _ in isolated_runs(built)],
                           answer.token_ids, PicReference(default_model_dir()))
        assert err < 2 * REFERENCE_TOL, f"{answer.text!r}: off the reference by {err:.2e}"
        # streamed over HTTP (SSE from /v1/completions): the same answer, token by token
        as_text = chain.model_copy(update={"output": "text"})
        chunks = [c async for c in as_text.astream("What is the height of K2?")]
        assert len(chunks) > 1 and "".join(chunks) == answer.text
        with pytest.raises(Exception, match="ainvoke"):
            chain.invoke("What is the height of K2?")  # sync call inside a running loop
