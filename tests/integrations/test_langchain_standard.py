"""LangChain's own standard test suite (``langchain-tests``) run against ``WikiRetriever``.

Written by LangChain, not here: ``RetrieversIntegrationTests`` checks the retriever contract a
LangChain user relies on (``k`` at construction and per ``invoke``, ``invoke`` / ``ainvoke``
returning ``Document`` lists). BM25 over the offline corpus: no engine, no network.
"""

from __future__ import annotations

import pytest
from langchain_tests.integration_tests import RetrieversIntegrationTests

from minipic.integrations.langchain.wiki_retriever import WikiRetriever

pytestmark = pytest.mark.fast


class TestWikiRetrieverStandard(RetrieversIntegrationTests):
    @property
    def retriever_constructor(self) -> type[WikiRetriever]:
        return WikiRetriever

    @property
    def retriever_constructor_params(self) -> dict:
        return {"k": 2}

    @property
    def retriever_query_example(self) -> str:
        return "What is the height of K2?"
