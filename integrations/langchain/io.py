"""What ``SpanRAGRunnable`` accepts and returns, in LangChain's own types.

Input: whatever a LangChain user pipes into a model-like runnable — a string, a prompt value
(``PromptTemplate | rag``, ``ChatPromptTemplate | rag``), a message or a list of messages, or a
dict with ``question`` / ``query`` / ``input``. A chat prompt's system messages become the
prompt's system span, its last human message is the question (and the retrieval query), and
earlier turns are kept in the question as a transcript.

Output, by ``output=``: ``"text"`` (default) — the answer's text, what ``StrOutputParser``, an
agent's tool message and string formatting expect; ``"message"`` — an ``AIMessage`` with
``usage_metadata`` (``input_token_details.cache_read`` = prompt tokens served from the KV cache)
and the cache evidence in ``response_metadata``, as a chat model returns it; ``"answer"`` — the
full ``Answer`` (span statuses, token ids, timings).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from langchain_core.documents import Document
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    AnyMessage,
    BaseMessage,
    HumanMessage,
    SystemMessage,
)
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from langchain_core.prompt_values import ChatPromptValueConcrete, PromptValue, StringPromptValue
from typing_extensions import TypedDict  # pydantic needs this one for schemas on Python < 3.12

from minipic.orchestrator.errors import BadInputError
from minipic.orchestrator.results import Answer
from minipic.prompt_builder import Span

QUESTION_KEYS = ("question", "query", "input")
Output = Literal["text", "message", "answer"]


class RAGQuestion(TypedDict, total=False):
    """The dict form of the input: one of these keys holds the question."""

    question: str
    query: str
    input: str


# what ``SpanRAGRunnable.InputType`` reports (``get_input_schema`` makes the JSON schema of it);
# a chat model's input types plus the dict form
RAGInput = str | RAGQuestion | StringPromptValue | ChatPromptValueConcrete | list[AnyMessage]


@dataclass(frozen=True)
class ChainInput:
    question: str  # what the model is asked
    query: str  # what the retriever searches for
    system: str | None = None  # system messages of a chat prompt (override the runnable's)


def _from_messages(messages: Sequence[BaseMessage]) -> ChainInput:
    system = [str(m.text) for m in messages if isinstance(m, SystemMessage)]
    turns = [m for m in messages if not isinstance(m, SystemMessage)]
    human = [i for i, m in enumerate(turns) if isinstance(m, HumanMessage)]
    if not human:
        raise BadInputError("the messages hold no human message to answer")
    last = human[-1]
    query = str(turns[last].text)
    earlier = [f"{'User' if isinstance(m, HumanMessage) else 'Assistant'}: {m.text}"
               for m in turns[:last] if str(m.text).strip()]
    question = "\n".join([*earlier, f"User: {query}"]) if earlier else query
    return ChainInput(question=question, query=query,
                      system="\n".join(system) if system else None)


def parse_input(value: Any) -> ChainInput:
    """The question, retrieval query and optional system text of one chain input."""
    if isinstance(value, StringPromptValue):
        value = value.to_string()
    if isinstance(value, str):
        parsed = ChainInput(question=value, query=value)
    elif isinstance(value, PromptValue):
        parsed = _from_messages(value.to_messages())
    elif isinstance(value, BaseMessage):
        parsed = _from_messages([value])
    elif isinstance(value, list) and value and all(isinstance(m, BaseMessage) for m in value):
        parsed = _from_messages(value)
    elif isinstance(value, dict):
        found = [value[k] for k in QUESTION_KEYS if k in value]
        if not found:
            raise BadInputError(f"input dict has none of the keys {QUESTION_KEYS}")
        if not isinstance(found[0], str):
            raise BadInputError(f"the question must be a str, got {type(found[0]).__name__}")
        parsed = ChainInput(question=found[0], query=found[0])
    else:
        raise BadInputError(f"input must be a str, a prompt value, messages or a dict with one "
                            f"of {QUESTION_KEYS}, got {type(value).__name__}")
    if not parsed.question.strip():
        raise BadInputError("question is empty")
    return parsed


def question_of(value: Any) -> str:
    """The question in a chain input (see ``parse_input``)."""
    return parse_input(value).question


# -- documents --------------------------------------------------------------------------------


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


def render_prompt(system: str | None, spans: Sequence[Span], question: str) -> str:
    """The prompt as a trace shows it: the text the model reads, without span markers."""
    parts = [f"System: {system}"] if system else []
    parts += [f"Document {s.id or i}: {s.text}" for i, s in enumerate(spans)]
    parts.append(f"Question: {question}")
    return "\n\n".join(parts)


# -- output -----------------------------------------------------------------------------------


def no_documents(answer: Answer) -> bool:
    """Whether the answer came from the model alone (the retriever found nothing usable)."""
    return not any(s.kind == "span" for s in answer.spans)


def usage_metadata(answer: Answer) -> UsageMetadata:
    """Token usage as LangChain reports it; ``cache_read`` = prompt tokens from the KV cache."""
    output = len(answer.token_ids)
    return UsageMetadata(
        input_tokens=answer.prompt_tokens, output_tokens=output,
        total_tokens=answer.prompt_tokens + output,
        input_token_details=InputTokenDetails(cache_read=answer.cached_tokens),
    )


def response_metadata(answer: Answer, model_name: str) -> dict[str, Any]:
    """The cache evidence of an answer, JSON-friendly (no token ids)."""
    return {
        "model_name": model_name,
        "finish_reason": answer.finish_reason,
        "mode": answer.mode.value,
        "cache_ok": answer.cache_ok,
        "cached_tokens": answer.cached_tokens,
        "expected_cached_tokens": answer.expected_cached_tokens,
        "ttft_s": answer.ttft_s,
        "total_s": answer.total_s,
        "prefills_sent": answer.prefills_sent,
        "no_documents": no_documents(answer),
        "spans": [s.model_dump(mode="json") for s in answer.spans],
    }


def to_message(answer: Answer, model_name: str) -> AIMessage:
    return AIMessage(content=answer.text, usage_metadata=usage_metadata(answer),
                     response_metadata=response_metadata(answer, model_name))


def final_chunk(answer: Answer, model_name: str) -> AIMessageChunk:
    """The last chunk of a streamed message: no text, the usage and cache evidence."""
    return AIMessageChunk(content="", usage_metadata=usage_metadata(answer),
                          response_metadata=response_metadata(answer, model_name),
                          chunk_position="last")


def shape(result: Any, output: Output, model_name: str) -> Any:
    """One result in the runnable's output form (errors pass through unchanged)."""
    if not isinstance(result, Answer) or output == "answer":
        return result
    return to_message(result, model_name) if output == "message" else result.text


def output_type(output: Output) -> type:
    return {"text": str, "message": AIMessage, "answer": Answer}[output]
