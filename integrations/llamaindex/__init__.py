"""LlamaIndex: retrieved nodes go to minipic as spans, through LlamaIndex's own abstractions.

- ``synthesizer``: ``SpanSynthesizer``, a response synthesizer: the query engine's nodes become
  the prompt's spans (cached on their own, reused at any position), the query its question;
  ``span_query_engine(retriever, orchestrator)`` builds the ``RetrieverQueryEngine``, and any
  index takes it: ``index.as_query_engine(response_synthesizer=SpanSynthesizer(orc))``;
- ``llm``: ``MinipicLLM``, the LLM LlamaIndex calls (the synthesizer's, and any component that
  asks an LLM directly); each call is LlamaIndex's own LLM event, with the usage in
  ``CompletionResponse.raw["usage"]`` (``prompt_tokens_details.cached_tokens`` included), which
  LlamaIndex's ``TokenCountingHandler`` and instrumentation handlers read;
- ``retriever``: ``WikiRetriever``, the offline corpus as a LlamaIndex ``BaseRetriever``.
"""

from __future__ import annotations

from minipic.integrations.llamaindex.llm import MinipicLLM
from minipic.integrations.llamaindex.retriever import WikiRetriever
from minipic.integrations.llamaindex.synthesizer import SpanSynthesizer, span_query_engine

__all__ = ["MinipicLLM", "SpanSynthesizer", "WikiRetriever", "span_query_engine"]
