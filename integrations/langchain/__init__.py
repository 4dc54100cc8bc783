"""LangChain: ``SpanRAGRunnable`` (retrieved documents as spans, in any LCEL chain) and
``WikiRetriever`` (the offline corpus as a LangChain retriever).

- ``runnable``: ``SpanRAGRunnable`` and ``documents_to_spans``;
- ``io``: what the runnable accepts and returns, in LangChain's own types;
- ``tracing``: the LLM child run (usage with ``cache_read``) callbacks and tracers see;
- ``wiki_retriever``: ``WikiRetriever``.
"""

from __future__ import annotations

from minipic.integrations.langchain.runnable import SpanRAGRunnable, documents_to_spans
from minipic.integrations.langchain.wiki_retriever import WikiRetriever

__all__ = ["SpanRAGRunnable", "WikiRetriever", "documents_to_spans"]
