"""``WikiRetriever``: the offline Wikipedia corpus (``orchestrator.corpus``) as a LlamaIndex
``BaseRetriever``, so a query engine over it runs with no network and no embedding model."""

from __future__ import annotations

from typing import Any

from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from minipic.orchestrator.corpus import WikiCorpus, default_corpus


class WikiRetriever(BaseRetriever):
    """BM25 over the offline corpus; each passage a ``TextNode`` whose id is its title and whose
    text is ``"<title>: <text>"`` (the document form ``minipic index`` stores)."""

    def __init__(self, k: int = 3, corpus: WikiCorpus | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.k = k
        self._corpus = corpus

    @property
    def corpus(self) -> WikiCorpus:
        if self._corpus is None:
            self._corpus = default_corpus()
        return self._corpus

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        hits = self.corpus.search(query_bundle.query_str, k=self.k)
        # the corpus ranks but does not score: rank order as 1, 1/2, 1/3, ...
        return [NodeWithScore(node=TextNode(id_=p.title, text=p.as_document,
                                            metadata={"title": p.title}), score=1 / (rank + 1))
                for rank, p in enumerate(hits)]
