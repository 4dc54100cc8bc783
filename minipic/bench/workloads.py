"""Benchmark workloads shaped like the paper's, built from offline data.

2WikiMultihopQA-shaped RAG: per question ~10 passages of 45–150 tokens (2–4 of them relevant),
passages shared across questions in different orders and positions, a few system prompts that
vary across "clients", and questions of 10–20 tokens. The questions are real (fanoutqa dev
sub-questions answerable from the offline Wikipedia corpus), so answer accuracy can be scored
by normalised substring match like Block-Attention does. Everything is derived from a seed, so
the same ``--seed`` gives the same workload and different seeds give fresh ones.
"""

from __future__ import annotations

import random
import re
import string
import unicodedata
from collections.abc import Callable

from pydantic import BaseModel

from minipic.orchestrator.corpus import Passage, WikiCorpus, load_passages, load_qa_items

CLIENT_SYSTEM_PROMPTS = (
    "You are a careful research assistant. Use only the documents below to answer. "
    "Answer with a short phrase.",
    "You answer trivia questions for a quiz app. Read the passages and reply with just the "
    "answer, no explanation.",
    "You are a helpful assistant for a library help desk. Base your answer strictly on the "
    "provided encyclopedia extracts and keep it brief.",
)


class RagItem(BaseModel):
    question: str
    answer: str
    system: str
    documents: list[str]
    relevant: list[int]


def normalize_answer(text: str) -> str:
    """Lower-case, strip accents, punctuation, articles and extra whitespace (SQuAD style)."""
    text = unicodedata.normalize("NFKD", text)
    text = "".join(c for c in text if not unicodedata.combining(c)).lower()
    text = "".join(" " if c in string.punctuation else c for c in text)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def is_correct(prediction: str, gold: str) -> bool:
    return normalize_answer(gold) in normalize_answer(prediction)


def clip_passage(passage: Passage, count: Callable[[str], int], rng: random.Random,
                 lo: int = 45, hi: int = 150) -> str:
    """Cut a lead section to a 2Wiki-like passage length, on a sentence boundary when possible."""
    target = rng.randint(lo, hi)
    text = passage.as_document
    if count(text) <= target:
        return text
    sentences = re.split(r"(?<=[.!?])\s+", text)
    out = ""
    for sentence in sentences:
        candidate = f"{out} {sentence}".strip()
        if count(candidate) > target and out:
            break
        out = candidate
    return out


def rag_workload(n_questions: int, count: Callable[[str], int], *, seed: int = 0,
                 passages_per_question: int = 10, relevant: int = 3,
                 pool_factor: float = 2.0, corpus: WikiCorpus | None = None) -> list[RagItem]:
    """``n_questions`` RAG items; distractors come from a shared pool so passages recur across
    questions at different positions (what makes span reuse pay off)."""
    rng = random.Random(seed)
    corpus = corpus or WikiCorpus()
    qa = list(load_qa_items())
    rng.shuffle(qa)
    qa = (qa * (n_questions // max(1, len(qa)) + 1))[:n_questions]
    all_passages = load_passages()
    pool_size = max(passages_per_question, int(pool_factor * n_questions))
    pool = rng.sample(all_passages, pool_size)
    clipped: dict[str, str] = {}

    def clip(p: Passage) -> str:
        if p.title not in clipped:
            clipped[p.title] = clip_passage(p, count, random.Random(f"{seed}:{p.title}"))
        return clipped[p.title]

    items = []
    for i, item in enumerate(qa):
        hits = corpus.search(item.question, relevant)
        chosen = {p.title: p for p in hits}
        while len(chosen) < passages_per_question:
            p = rng.choice(pool)
            chosen.setdefault(p.title, p)
        docs = list(chosen.values())
        rng.shuffle(docs)
        items.append(RagItem(
            question=item.question, answer=item.answer,
            system=CLIENT_SYSTEM_PROMPTS[i % len(CLIENT_SYSTEM_PROMPTS)],
            documents=[clip(p) for p in docs],
            relevant=[j for j, p in enumerate(docs) if p.title in {h.title for h in hits}],
        ))
    return items


TOOLS = (
    "search(query): full-text search over the company wiki; returns the 5 best page titles.",
    "read_page(title): returns the text of a wiki page, at most 2,000 words.",
    "calculator(expression): evaluates an arithmetic expression exactly.",
    "calendar(date_range): lists meetings of the current user in the range.",
    "send_email(to, subject, body): sends an email from the user's account.",
    "file_search(pattern): finds files in the shared drive whose names match the pattern.",
)


def agent_workload(turns: int, *, seed: int = 0) -> list[RagItem]:
    """Agent tool memory: tool descriptions and a growing memory reused across turns, in a
    changing order (the agent re-ranks tools and memories every turn)."""
    rng = random.Random(seed)
    memory: list[str] = []
    items = []
    qa = list(load_qa_items())
    for turn in range(turns):
        tools = list(TOOLS)
        rng.shuffle(tools)
        memory.append(f"Memory {turn}: the user asked about {qa[turn % len(qa)].question}")
        recent = memory[-4:]
        rng.shuffle(recent)
        item = qa[(turn + 1) % len(qa)]
        items.append(RagItem(
            question=item.question, answer=item.answer,
            system="You are an agent. Pick a tool or answer directly, briefly.",
            documents=[*tools, *recent], relevant=[],
        ))
    return items
