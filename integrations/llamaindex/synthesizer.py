"""``SpanSynthesizer``: a LlamaIndex response synthesizer whose nodes are the prompt's spans.

Why a synthesizer: it is where LlamaIndex hands the retrieved nodes and the query to the model,
so every query engine (``RetrieverQueryEngine``, ``index.as_query_engine``) takes it without
changing anything else of the pipeline. Stock synthesizers pack the nodes' text into one prompt
template, which no cache can reuse at another position; this one sends each node as a span
(``MinipicLLM.complete(query, documents=...)``), so a node cached by any earlier query is reused
wherever it lands. Node order is the retriever's (its rank).

The response is LlamaIndex's own ``Response`` (or ``StreamingResponse`` with ``streaming=True``);
its ``metadata["minipic"]`` holds the usage (with cached tokens) and the cache evidence. For a
stream they appear once the stream is drained.
"""

from __future__ import annotations

import contextvars
from collections.abc import AsyncGenerator, Generator, Sequence
from typing import Any

from llama_index.core.base.response.schema import RESPONSE_TYPE
from llama_index.core.callbacks import CallbackManager
from llama_index.core.prompts.mixin import PromptDictType
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.response_synthesizers import BaseSynthesizer
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore

from minipic.integrations.llamaindex.llm import MinipicLLM

# the usage and evidence of the call being synthesized (one per query, also when concurrent)
_LAST: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "minipic_llamaindex_last", default=None)


def _record(extra: dict[str, Any], response: Any) -> None:
    extra.update(usage=response.raw.get("usage"), **response.additional_kwargs.get("minipic", {}))


class SpanSynthesizer(BaseSynthesizer):
    """Answer a query from its nodes with span-aware caching.

    ``orchestrator``: an ``Orchestrator`` or ``SyncOrchestrator``; or pass ``llm`` (a
    ``MinipicLLM``) to share one. ``system``, ``mode`` and ``answer_kwargs`` as for
    ``MinipicLLM``.
    """

    def __init__(self, orchestrator: Any = None, *, llm: MinipicLLM | None = None,
                 system: str | None = None, mode: str = "block_attention",
                 answer_kwargs: dict[str, Any] | None = None, streaming: bool = False,
                 callback_manager: CallbackManager | None = None) -> None:
        if llm is None:
            if orchestrator is None:
                raise TypeError("SpanSynthesizer needs an orchestrator or a MinipicLLM")
            llm = MinipicLLM(orchestrator=orchestrator, system=system, mode=mode,
                             answer_kwargs=dict(answer_kwargs or {}))
        super().__init__(llm=llm, callback_manager=callback_manager, streaming=streaming)
        self._minipic_llm = llm

    def _get_prompts(self) -> PromptDictType:
        return {}  # no prompt template: the layout is the prompt

    def _update_prompts(self, prompts: PromptDictType) -> None:
        return None

    def _begin(self) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        _LAST.set(extra)
        return extra

    def get_response(self, query_str: str, text_chunks: Sequence[str],
                     **response_kwargs: Any) -> str | Generator[str, None, None]:
        extra = self._begin()
        llm = self._minipic_llm
        if not self._streaming:
            response = llm.complete(query_str, documents=list(text_chunks), **response_kwargs)
            _record(extra, response)
            return response.text

        def deltas() -> Generator[str, None, None]:
            for response in llm.stream_complete(query_str, documents=list(text_chunks),
                                                **response_kwargs):
                if response.raw:
                    _record(extra, response)
                if response.delta:
                    yield response.delta

        return deltas()

    async def aget_response(self, query_str: str, text_chunks: Sequence[str],
                            **response_kwargs: Any) -> str | AsyncGenerator[str, None]:
        extra = self._begin()
        llm = self._minipic_llm
        if not self._streaming:
            response = await llm.acomplete(query_str, documents=list(text_chunks),
                                           **response_kwargs)
            _record(extra, response)
            return response.text
        stream = await llm.astream_complete(query_str, documents=list(text_chunks),
                                            **response_kwargs)

        async def deltas() -> AsyncGenerator[str, None]:
            async for response in stream:
                if response.raw:
                    _record(extra, response)
                if response.delta:
                    yield response.delta

        return deltas()

    def _prepare_response_output(self, response_str: Any,
                                 source_nodes: list[NodeWithScore]) -> RESPONSE_TYPE:
        response = super()._prepare_response_output(response_str, source_nodes)
        extra = _LAST.get()
        if extra is not None:
            metadata = response.metadata if response.metadata is not None else {}
            metadata["minipic"] = extra  # filled in place as a stream ends
            response.metadata = metadata
        return response


def span_query_engine(retriever: BaseRetriever, orchestrator: Any = None, *,
                      streaming: bool = False, **synthesizer_kwargs: Any) -> RetrieverQueryEngine:
    """``RetrieverQueryEngine`` over ``retriever`` whose answers use spans."""
    return RetrieverQueryEngine(retriever=retriever, response_synthesizer=SpanSynthesizer(
        orchestrator, streaming=streaming, **synthesizer_kwargs))
