"""LangChain: any ``BaseRetriever`` + the orchestrator as one LCEL ``Runnable``.

``SpanRAGRunnable`` takes a question (a string, or a dict with ``"question"``), retrieves
documents with the retriever, turns each ``Document`` into a span (``documents_to_spans``) and
answers through the orchestrator. ``batch`` / ``abatch`` answer the whole batch with one
``answer_many`` call, so span prefills are de-duplicated and pipelined across it (ISPS) instead
of running as independent chains.

Span identity: ``metadata["span_id"]`` when the retriever sets one, else ``Document.id``, else
the content address of the text (same text, same span). Stable ids let the warmth registry and
reports name documents as the retriever does.

Sync vs async: with a ``SyncOrchestrator`` every method works anywhere. With an async
``Orchestrator``, ``ainvoke`` / ``abatch`` run on the caller's loop; ``invoke`` / ``batch`` work
only where no loop is running (they use ``asyncio.run``; an embedded engine needs one loop for
its lifetime, so pair it with ``SyncOrchestrator`` for sync chains).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Literal

from langchain_core.callbacks import CallbackManagerForChainRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableConfig, RunnableSerializable
from pydantic import ConfigDict, Field, field_validator

from orchestrator.client import Orchestrator, Question
from orchestrator.errors import BadInputError, MinipicError
from orchestrator.results import Answer
from orchestrator.sync_client import SyncOrchestrator
from prompt_builder import Span

QUESTION_KEYS = ("question", "query", "input")


def document_to_span(doc: Document, format_document: Callable[[Document], str] | None = None
                     ) -> Span | None:
    """A span for one retrieved document (None for an empty one: nothing to cache)."""
    text = format_document(doc) if format_document else doc.page_content
    if not text or not text.strip():
        return None
    span_id = doc.metadata.get("span_id") or doc.id
    score = doc.metadata.get("score")
    if not (isinstance(score, (int, float)) and not isinstance(score, bool)
            and math.isfinite(score)):
        score = None
    return Span(text=text, id=str(span_id) if span_id else None, score=score)


def documents_to_spans(docs: Sequence[Document],
                       format_document: Callable[[Document], str] | None = None) -> list[Span]:
    """Spans for retrieved documents, in retrieval order; empty documents are left out."""
    spans = (document_to_span(d, format_document) for d in docs)
    return [s for s in spans if s is not None]


def question_of(value: Any) -> str:
    """The question in a chain input: a string, or a dict with one of ``QUESTION_KEYS``."""
    if isinstance(value, str):
        question = value
    elif isinstance(value, dict):
        found = [value[k] for k in QUESTION_KEYS if k in value]
        if not found:
            raise BadInputError(f"input dict has none of the keys {QUESTION_KEYS}")
        question = found[0]
    else:
        raise BadInputError(f"input must be a str or a dict, got {type(value).__name__}")
    if not isinstance(question, str) or not question.strip():
        raise BadInputError("question is empty")
    return question


class SpanRAGRunnable(RunnableSerializable[Any, Any]):
    """Retrieve, then answer with span-aware caching. Output: the ``Answer`` (``output="answer"``)
    or just its text (``output="text"``). ``answer_kwargs`` go to ``answer`` / ``answer_many``
    (``max_tokens``, ``temperature``, ``cache_salt``, ``budget``, ...)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    retriever: BaseRetriever
    orchestrator: Any = Field(description="an Orchestrator or a SyncOrchestrator")
    system: str | None = None
    mode: str = "block_attention"
    output: Literal["answer", "text"] = "answer"
    answer_kwargs: dict[str, Any] = Field(default_factory=dict)
    format_document: Callable[[Document], str] | None = None

    @field_validator("orchestrator")
    @classmethod
    def _check_orchestrator(cls, value: Any) -> Any:
        if not isinstance(value, (Orchestrator, SyncOrchestrator)):
            raise TypeError(f"orchestrator must be an Orchestrator or SyncOrchestrator, got "
                            f"{type(value).__name__}")
        return value

    # -- helpers --------------------------------------------------------------------------------

    @property
    def _aio(self) -> Orchestrator:
        orc = self.orchestrator
        return orc.aio if isinstance(orc, SyncOrchestrator) else orc

    def _run_sync(self, coro: Coroutine[Any, Any, Any]) -> Any:
        if isinstance(self.orchestrator, SyncOrchestrator):
            return self.orchestrator.submit(coro).result()
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(coro)
        coro.close()
        raise MinipicError("sync invoke/batch inside a running event loop: use ainvoke/abatch, "
                           "or give the runnable a SyncOrchestrator")

    async def _run_async(self, coro: Coroutine[Any, Any, Any]) -> Any:
        if isinstance(self.orchestrator, SyncOrchestrator):
            return await asyncio.wrap_future(self.orchestrator.submit(coro))
        return await coro

    def _answer(self, question: str, docs: list[Document]) -> Coroutine[Any, Any, Answer]:
        return self._aio.answer(question, documents_to_spans(docs, self.format_document),
                                self.system, self.mode, **self.answer_kwargs)

    def _answer_many(self, items: list[Question]) -> Coroutine[Any, Any, list[Any]]:
        return self._aio.answer_many(items, system=self.system, mode=self.mode,
                                     **self.answer_kwargs)

    def _shape(self, result: Any) -> Any:
        if isinstance(result, Answer) and self.output == "text":
            return result.text
        return result

    def _questions(self, inputs: list[Any], docs: list[Any]) -> tuple[list[Question], list[Any]]:
        """Questions for answer_many, and the slots already decided (input or retrieval errors)."""
        results: list[Any] = [None] * len(inputs)
        items: list[Question] = []
        for i, (value, found) in enumerate(zip(inputs, docs, strict=True)):
            if isinstance(found, Exception):
                results[i] = found
                continue
            items.append(Question(question=question_of(value),
                                  documents=documents_to_spans(found, self.format_document)))
        return items, results

    @staticmethod
    def _merge(results: list[Any], answers: list[Any]) -> list[Any]:
        it = iter(answers)
        return [next(it) if r is None else r for r in results]

    # -- single ---------------------------------------------------------------------------------

    def _invoke(self, value: Any, run_manager: CallbackManagerForChainRun,
                config: RunnableConfig) -> Any:
        question = question_of(value)
        docs = self.retriever.invoke(question, config=config)
        return self._shape(self._run_sync(self._answer(question, docs)))

    async def _ainvoke(self, value: Any, run_manager: Any, config: RunnableConfig) -> Any:
        question = question_of(value)
        docs = await self.retriever.ainvoke(question, config=config)
        return self._shape(await self._run_async(self._answer(question, docs)))

    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        return self._call_with_config(self._invoke, input, config, **kwargs)

    async def ainvoke(self, input: Any, config: RunnableConfig | None = None,
                      **kwargs: Any) -> Any:
        return await self._acall_with_config(self._ainvoke, input, config, **kwargs)

    # -- batch: one answer_many for the whole batch ----------------------------------------------

    def _retrieval_input(self, inputs: list[Any]) -> tuple[list[str], list[Any]]:
        questions: list[str] = []
        docs: list[Any] = []
        for value in inputs:
            try:
                questions.append(question_of(value))
                docs.append(None)
            except BadInputError as exc:
                questions.append("")
                docs.append(exc)
        return questions, docs

    def _batch(self, inputs: list[Any], run_manager: list[Any],
               config: list[RunnableConfig], **kwargs: Any) -> list[Any]:
        questions, docs = self._retrieval_input(inputs)
        todo = [i for i, d in enumerate(docs) if d is None]
        found = self.retriever.batch([questions[i] for i in todo],
                                     [config[i] for i in todo], return_exceptions=True)
        for i, d in zip(todo, found, strict=True):
            docs[i] = d
        items, results = self._questions(inputs, docs)
        answers = self._run_sync(self._answer_many(items)) if items else []
        return [self._shape(r) for r in self._merge(results, answers)]

    async def _abatch(self, inputs: list[Any], run_manager: list[Any],
                      config: list[RunnableConfig], **kwargs: Any) -> list[Any]:
        questions, docs = self._retrieval_input(inputs)
        todo = [i for i, d in enumerate(docs) if d is None]
        found = await self.retriever.abatch([questions[i] for i in todo],
                                            [config[i] for i in todo], return_exceptions=True)
        for i, d in zip(todo, found, strict=True):
            docs[i] = d
        items, results = self._questions(inputs, docs)
        answers = await self._run_async(self._answer_many(items)) if items else []
        return [self._shape(r) for r in self._merge(results, answers)]

    def batch(self, inputs: list[Any], config: RunnableConfig | list[RunnableConfig] | None = None,
              *, return_exceptions: bool = False, **kwargs: Any) -> list[Any]:
        return self._batch_with_config(self._batch, inputs, config,
                                       return_exceptions=return_exceptions, **kwargs)

    async def abatch(self, inputs: list[Any],
                     config: RunnableConfig | list[RunnableConfig] | None = None,
                     *, return_exceptions: bool = False, **kwargs: Any) -> list[Any]:
        return await self._abatch_with_config(self._abatch, inputs, config,
                                              return_exceptions=return_exceptions, **kwargs)
