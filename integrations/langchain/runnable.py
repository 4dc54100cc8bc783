"""LangChain: any ``BaseRetriever`` + the orchestrator as one LCEL ``Runnable``.

``SpanRAGRunnable`` takes what a LangChain model takes (a string, a prompt value from
``PromptTemplate`` / ``ChatPromptTemplate``, messages) or a dict with ``"question"``; retrieves
documents with the retriever, turns each ``Document`` into a span (``documents_to_spans``) and
answers through the orchestrator. By default it returns the answer's text, so
``prompt | rag | StrOutputParser()`` and ``rag.as_tool(...)`` work as with any model;
``output="message"`` gives an ``AIMessage`` with usage metadata, ``output="answer"`` the full
``Answer`` (``integrations.langchain.io`` describes all three).

What LangChain machinery sees: the retriever's run, then the model call as a child LLM run
(``on_llm_start`` / ``on_llm_new_token`` / ``on_llm_end`` with ``usage_metadata`` including
``input_token_details.cache_read``; ``integrations.langchain.tracing``). ``stream`` / ``astream``
yield tokens as the engine produces them (``orchestrator.streaming``). ``batch`` / ``abatch``
answer the whole batch with one ``answer_many`` call, so span prefills are de-duplicated and
pipelined across it (ISPS); with ``max_concurrency`` in the config, at most that many questions
are in flight at once instead. A retriever that finds nothing does not fail the question: the
model answers alone, and ``no_documents`` says so (``response_metadata`` of a message,
``integrations.langchain.io.no_documents(answer)``).

Span identity: ``metadata["span_id"]`` when the retriever sets one, else ``Document.id``, else
the content address of the text (same text, same span).

Sync vs async: with a ``SyncOrchestrator`` every method works anywhere. With an async
``Orchestrator``, ``ainvoke`` / ``abatch`` / ``astream`` run on the caller's loop; the sync
methods work only where no loop is running (``orchestrator.loop_bridge``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

from langchain_core.callbacks import (
    AsyncCallbackManagerForChainRun,
    CallbackManagerForChainRun,
)
from langchain_core.documents import Document
from langchain_core.messages import AIMessageChunk
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableConfig, RunnableSerializable
from pydantic import ConfigDict, Field, field_validator

from minipic.integrations.langchain.io import (
    QUESTION_KEYS,
    ChainInput,
    Output,
    RAGInput,
    document_to_span,
    documents_to_spans,
    final_chunk,
    no_documents,
    output_type,
    parse_input,
    question_of,
    render_prompt,
    shape,
)
from minipic.integrations.langchain.tracing import LLMRun
from minipic.orchestrator.client import Orchestrator, Question
from minipic.orchestrator.errors import BadInputError, MinipicError
from minipic.orchestrator.loop_bridge import (
    async_side,
    check_orchestrator,
    iterate_async,
    iterate_sync,
    run_async,
    run_sync,
)
from minipic.orchestrator.results import Answer
from minipic.orchestrator.streaming import stream_answer
from minipic.prompt_builder import Span

__all__ = ["QUESTION_KEYS", "SpanRAGRunnable", "document_to_span", "documents_to_spans",
           "no_documents", "parse_input", "question_of"]


@dataclass(frozen=True)
class _Prepared:
    """One input after parsing and retrieval: what to ask, with which spans and system."""

    parsed: ChainInput
    spans: list[Span]
    system: str | None

    @property
    def prompt(self) -> str:
        return render_prompt(self.system, self.spans, self.parsed.question)


class SpanRAGRunnable(RunnableSerializable[RAGInput, Any]):
    """Retrieve, then answer with span-aware caching. ``output``: ``"text"`` (default),
    ``"message"`` or ``"answer"``. ``answer_kwargs`` go to ``answer`` / ``answer_many``
    (``max_tokens``, ``temperature``, ``cache_salt``, ``budget``, ...). A chat prompt's system
    messages replace ``system`` for that call."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    retriever: BaseRetriever
    orchestrator: Any = Field(description="an Orchestrator or a SyncOrchestrator")
    system: str | None = None
    mode: str = "block_attention"
    output: Output = "text"
    answer_kwargs: dict[str, Any] = Field(default_factory=dict)
    format_document: Callable[[Document], str] | None = None

    @field_validator("orchestrator")
    @classmethod
    def _check_orchestrator(cls, value: Any) -> Any:
        return check_orchestrator(value)

    # -- types ----------------------------------------------------------------------------------

    @property
    def InputType(self) -> Any:  # noqa: N802 - LangChain's name
        return RAGInput

    @property
    def OutputType(self) -> Any:  # noqa: N802 - LangChain's name
        return output_type(self.output)

    # -- helpers --------------------------------------------------------------------------------

    @property
    def _aio(self) -> Orchestrator:
        return async_side(self.orchestrator)

    @property
    def _model_name(self) -> str:
        return self._aio.backend.info.model

    @property
    def _kwargs(self) -> dict[str, Any]:
        """``answer_kwargs``, where a retriever's empty result is answered, not refused."""
        return {"require_documents": False, **self.answer_kwargs}

    def _params(self) -> dict[str, Any]:
        return {"mode": self.mode, "output": self.output, **self.answer_kwargs}

    def _prepare(self, parsed: ChainInput, docs: list[Document]) -> _Prepared:
        return _Prepared(parsed, documents_to_spans(docs, self.format_document),
                         parsed.system or self.system)

    def _answer(self, p: _Prepared) -> Coroutine[Any, Any, Answer]:
        return self._aio.answer(p.parsed.question, p.spans, p.system, self.mode, **self._kwargs)

    def _stream(self, p: _Prepared) -> Callable[[], AsyncIterator[str | Answer]]:
        return lambda: stream_answer(self._aio, p.parsed.question, p.spans, p.system,
                                     self.mode, **self._kwargs)

    def _start(self, run_manager: CallbackManagerForChainRun, p: _Prepared) -> LLMRun:
        return LLMRun.start(run_manager, p.prompt, self._model_name, self._params())

    async def _astart(self, run_manager: AsyncCallbackManagerForChainRun,
                      p: _Prepared) -> LLMRun:
        return await LLMRun.astart(run_manager, p.prompt, self._model_name, self._params())

    def _shape(self, result: Any) -> Any:
        return shape(result, self.output, self._model_name)

    # -- single ---------------------------------------------------------------------------------

    def _invoke(self, value: Any, run_manager: CallbackManagerForChainRun,
                config: RunnableConfig) -> Any:
        parsed = parse_input(value)
        p = self._prepare(parsed, self.retriever.invoke(parsed.query, config=config))
        llm = self._start(run_manager, p)
        try:
            answer = run_sync(self.orchestrator, self._answer(p))
        except BaseException as exc:
            llm.end(exc)
            raise
        llm.end(answer)
        return self._shape(answer)

    async def _ainvoke(self, value: Any, run_manager: AsyncCallbackManagerForChainRun,
                       config: RunnableConfig) -> Any:
        parsed = parse_input(value)
        p = self._prepare(parsed, await self.retriever.ainvoke(parsed.query, config=config))
        llm = await self._astart(run_manager, p)
        try:
            answer = await run_async(self.orchestrator, self._answer(p))
        except BaseException as exc:
            await llm.aend(exc)
            raise
        await llm.aend(answer)
        return self._shape(answer)

    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        return self._call_with_config(self._invoke, input, config, **kwargs)

    async def ainvoke(self, input: Any, config: RunnableConfig | None = None,
                      **kwargs: Any) -> Any:
        return await self._acall_with_config(self._ainvoke, input, config, **kwargs)

    # -- stream: tokens as the engine produces them ---------------------------------------------

    def _chunks(self, text: str) -> list[Any]:
        if self.output == "text":
            return [text]
        return [AIMessageChunk(content=text)] if self.output == "message" else []

    def _last(self, answer: Answer, streamed: bool) -> list[Any]:
        if self.output == "answer":
            return [answer]
        if self.output == "message":
            return [final_chunk(answer, self._model_name)]
        return [] if streamed else [answer.text]  # an empty answer is still one chunk

    def _transform(self, inputs: Iterator[Any], run_manager: CallbackManagerForChainRun,
                   config: RunnableConfig) -> Iterator[Any]:
        parsed = parse_input(_only(inputs))
        p = self._prepare(parsed, self.retriever.invoke(parsed.query, config=config))
        llm = self._start(run_manager, p)
        streamed = False
        answer: Answer | None = None
        try:
            for item in iterate_sync(self.orchestrator, self._stream(p)):
                if isinstance(item, str):
                    llm.token(item)
                    streamed = True
                    yield from self._chunks(item)
                else:
                    answer = item
        except BaseException as exc:
            llm.end(exc)
            raise
        assert answer is not None, "a stream ends with its Answer"
        llm.end(answer)
        yield from self._last(answer, streamed)

    async def _atransform(self, inputs: AsyncIterator[Any],
                          run_manager: AsyncCallbackManagerForChainRun,
                          config: RunnableConfig) -> AsyncIterator[Any]:
        parsed = parse_input(await _aonly(inputs))
        p = self._prepare(parsed, await self.retriever.ainvoke(parsed.query, config=config))
        llm = await self._astart(run_manager, p)
        streamed = False
        answer: Answer | None = None
        try:
            async for item in iterate_async(self.orchestrator, self._stream(p)):
                if isinstance(item, str):
                    await llm.atoken(item)
                    streamed = True
                    for chunk in self._chunks(item):
                        yield chunk
                else:
                    answer = item
        except BaseException as exc:
            await llm.aend(exc)
            raise
        assert answer is not None, "a stream ends with its Answer"
        await llm.aend(answer)
        for chunk in self._last(answer, streamed):
            yield chunk

    def stream(self, input: Any, config: RunnableConfig | None = None,
               **kwargs: Any) -> Iterator[Any]:
        yield from self._transform_stream_with_config(iter([input]), self._transform, config,
                                                      **kwargs)

    async def astream(self, input: Any, config: RunnableConfig | None = None,
                      **kwargs: Any) -> AsyncIterator[Any]:
        async for chunk in self._atransform_stream_with_config(_aiter([input]),
                                                               self._atransform, config,
                                                               **kwargs):
            yield chunk

    # -- batch: one answer_many for the whole batch ----------------------------------------------

    def _parse_all(self, inputs: list[Any]) -> list[ChainInput | Exception]:
        parsed: list[ChainInput | Exception] = []
        for value in inputs:
            try:
                parsed.append(parse_input(value))
            except BadInputError as exc:
                parsed.append(exc)
        return parsed

    def _prepare_all(self, parsed: list[ChainInput | Exception], found: list[Any]
                     ) -> list[_Prepared | Exception]:
        it = iter(found)
        out: list[_Prepared | Exception] = []
        for item in parsed:
            if isinstance(item, Exception):
                out.append(item)
                continue
            docs = next(it)
            out.append(docs if isinstance(docs, Exception) else self._prepare(item, docs))
        return out

    async def _answer_all(self, todo: list[_Prepared], limit: int | None) -> list[Any]:
        """One ``answer_many`` for all, or at most ``limit`` questions in flight at once."""
        kwargs = {"mode": self.mode, **self._kwargs}
        items = [Question(question=p.parsed.question, documents=p.spans, system=p.system)
                 for p in todo]
        if limit is None:
            return await self._aio.answer_many(items, **kwargs)
        gate = asyncio.Semaphore(limit)

        async def one(item: Question) -> Any:
            async with gate:
                return (await self._aio.answer_many([item], **kwargs))[0]

        return list(await asyncio.gather(*(one(item) for item in items)))

    @staticmethod
    def _merge(prepared: list[_Prepared | Exception], answers: list[Any]) -> list[Any]:
        """One result per input, in order; errors name their position in this batch."""
        it = iter(answers)
        results: list[Any] = []
        for i, p in enumerate(prepared):
            result = next(it) if isinstance(p, _Prepared) else p
            if isinstance(result, MinipicError):
                result.question_index = i
            results.append(result)
        return results

    @staticmethod
    def _limit(config: list[RunnableConfig]) -> int | None:
        return config[0].get("max_concurrency") if config else None

    def _batch(self, inputs: list[Any], run_manager: list[CallbackManagerForChainRun],
               config: list[RunnableConfig], **kwargs: Any) -> list[Any]:
        parsed = self._parse_all(inputs)
        ok = [p for p in parsed if isinstance(p, ChainInput)]
        found = self.retriever.batch([p.query for p in ok],
                                     [c for c, p in zip(config, parsed, strict=True)
                                      if isinstance(p, ChainInput)], return_exceptions=True)
        prepared = self._prepare_all(parsed, found)
        todo = [(i, p) for i, p in enumerate(prepared) if isinstance(p, _Prepared)]
        runs = [self._start(run_manager[i], p) for i, p in todo]
        try:
            answers = (run_sync(self.orchestrator, self._answer_all([p for _, p in todo],
                                                                    self._limit(config)))
                       if todo else [])
        except BaseException as exc:
            for run in runs:
                run.end(exc)
            raise
        for run, answer in zip(runs, answers, strict=True):
            run.end(answer)
        return [self._shape(r) for r in self._merge(prepared, answers)]

    async def _abatch(self, inputs: list[Any], run_manager: list[AsyncCallbackManagerForChainRun],
                      config: list[RunnableConfig], **kwargs: Any) -> list[Any]:
        parsed = self._parse_all(inputs)
        ok = [p for p in parsed if isinstance(p, ChainInput)]
        found = await self.retriever.abatch([p.query for p in ok],
                                            [c for c, p in zip(config, parsed, strict=True)
                                             if isinstance(p, ChainInput)],
                                            return_exceptions=True)
        prepared = self._prepare_all(parsed, found)
        todo = [(i, p) for i, p in enumerate(prepared) if isinstance(p, _Prepared)]
        runs = [await self._astart(run_manager[i], p) for i, p in todo]
        try:
            answers = (await run_async(self.orchestrator, self._answer_all(
                [p for _, p in todo], self._limit(config))) if todo else [])
        except BaseException as exc:
            for run in runs:
                await run.aend(exc)
            raise
        for run, answer in zip(runs, answers, strict=True):
            await run.aend(answer)
        return [self._shape(r) for r in self._merge(prepared, answers)]

    def batch(self, inputs: list[Any], config: RunnableConfig | list[RunnableConfig] | None = None,
              *, return_exceptions: bool = False, **kwargs: Any) -> list[Any]:
        return self._batch_with_config(self._batch, inputs, config,
                                       return_exceptions=return_exceptions, **kwargs)

    async def abatch(self, inputs: list[Any],
                     config: RunnableConfig | list[RunnableConfig] | None = None,
                     *, return_exceptions: bool = False, **kwargs: Any) -> list[Any]:
        return await self._abatch_with_config(self._abatch, inputs, config,
                                              return_exceptions=return_exceptions, **kwargs)


def _only(inputs: Iterator[Any]) -> Any:
    """The input of a stream: ``stream`` passes exactly one (``transform`` gathers first)."""
    items = list(inputs)
    if len(items) != 1:
        raise BadInputError(f"stream takes one input, got {len(items)}")
    return items[0]


async def _aonly(inputs: AsyncIterator[Any]) -> Any:
    return _only(iter([item async for item in inputs]))


async def _aiter(items: list[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item
