"""What a request with documents may carry, checked before anything runs.

``/v1/chat/completions``: vLLM's ``documents`` field, a list of ``{"text", "title"?, "id"?}``
(a bare string is accepted as ``{"text": ...}``); options in ``minipic: {mode, budget}``. The
system messages are the system span; the last message must be the user's question; earlier
user / assistant turns go before it as a transcript (``User: ...`` / ``Assistant: ...``), in
the PDEP-led part with the question.

``/v1/completions``: ``minipic: {question, documents, system?, mode?, budget?}`` in place of
``prompt``.

A document with a title becomes the span text ``"<title>: <text>"`` (the form ``minipic index``
and the offline corpus use). Every problem is a
:class:`BodyError` naming the item (``documents[2].text``), which the server answers with an
OpenAI-format 400; nothing is sent to the engine for such a request.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from minipic.orchestrator.errors import BadInputError
from minipic.prompt_builder import BudgetPolicy, InvalidInputError, Mode, parse_mode
from minipic.span_contract.env import MAX_BODY_MIB_ENV, MAX_DOCUMENT_CHARS_ENV, MAX_DOCUMENTS_ENV

Route = Literal["chat", "completions"]
ROUTES: dict[str, Route] = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
MINIPIC_KEY = "minipic"
DOCUMENTS_KEY = "documents"
CHAT_OPTIONS = frozenset({"mode", "budget"})
COMPLETION_OPTIONS = frozenset({"question", "documents", "system", "mode", "budget"})
DOCUMENT_KEYS = frozenset({"text", "title", "id"})
SYSTEM_ROLES = frozenset({"system", "developer"})
# chat fields whose meaning a server-side layout cannot keep: refused with documents, not dropped
CHAT_REFUSED = {
    "tools": "tool definitions are rendered by the chat template, which the span layout replaces",
    "functions": "function definitions are rendered by the chat template",
    "chat_template": "the span layout uses the model's own chat template",
    "chat_template_kwargs": "the span layout renders the model's template without extra kwargs",
    "continue_final_message": "the question is always the last user turn",
    "prompt_embeds": "documents are laid out as token ids",
}
# vLLM's default when a completions request sets no max_tokens (room kept for the answer)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class Limits:
    """What one request may carry (``minipic serve --max-body-mib / --max-documents /
    --max-document-chars``, through the server's environment).

    Why limits at all: the body is read whole and every document is tokenized before anything
    runs; without a bound one request of 50 MB or 10,000 documents holds a tokenizer thread and
    the server's memory for as long as it likes. The defaults are far above any context a
    served model takes (a 1M-character document is ~250k tokens)."""

    BODY_ENV = MAX_BODY_MIB_ENV
    DOCUMENTS_ENV = MAX_DOCUMENTS_ENV
    DOCUMENT_CHARS_ENV = MAX_DOCUMENT_CHARS_ENV

    def __init__(self, body_bytes: int = 32 << 20, documents: int = 1024,
                 document_chars: int = 1_000_000) -> None:
        self.body_bytes = body_bytes
        self.documents = documents
        self.document_chars = document_chars

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Limits:
        env = os.environ if environ is None else environ
        default = cls()

        def number(name: str, fallback: float) -> float:
            try:
                value = float(env.get(name, fallback))
            except ValueError:
                return fallback
            return value if value > 0 else fallback

        return cls(body_bytes=int(number(cls.BODY_ENV, default.body_bytes / 2**20) * 2**20),
                   documents=int(number(cls.DOCUMENTS_ENV, default.documents)),
                   document_chars=int(number(cls.DOCUMENT_CHARS_ENV, default.document_chars)))

    def env(self) -> dict[str, str]:
        return {self.BODY_ENV: f"{self.body_bytes / 2**20:g}",
                self.DOCUMENTS_ENV: str(self.documents),
                self.DOCUMENT_CHARS_ENV: str(self.document_chars)}


class BodyError(BadInputError):
    """A request body that asks for documents but cannot be laid out; ``param`` names the item."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class DocumentsRequest:
    """One request's layout inputs, as the SDK's ``Orchestrator.build`` takes them."""

    route: Route
    question: str
    documents: list[dict[str, str]]  # Span fields: text, id?
    system: str | None
    mode: str
    budget: str
    cache_salt: str | None
    max_tokens: int  # reserved for the answer when the budget policy fits the prompt


def wants_documents(route: Route, body: Any) -> bool:
    """Whether a request asks for the server-side layout (else it is passed on untouched)."""
    if not isinstance(body, dict):
        return False
    if route == "chat":
        return body.get(DOCUMENTS_KEY) is not None or MINIPIC_KEY in body
    return MINIPIC_KEY in body


def _text(value: Any, where: str, *, required: bool = True) -> str | None:
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise BodyError(f"{where} must be a string, got {type(value).__name__}", where)
    return value


def _documents(value: Any, where: str, limits: Limits) -> list[dict[str, str]]:
    if not isinstance(value, list):
        raise BodyError(f"{where} must be a list of documents ({{\"text\": ...}}), got "
                        f"{type(value).__name__}", where)
    if not value:
        raise BodyError(f"{where} is empty: send at least one document, or leave the field out "
                        f"for a request without documents", where)
    if len(value) > limits.documents:
        raise BodyError(f"{where} has {len(value)} documents; this server takes at most "
                        f"{limits.documents} per request (minipic serve --max-documents)", where)
    out = []
    for i, doc in enumerate(value):
        item = f"{where}[{i}]"
        if isinstance(doc, str):
            doc = {"text": doc}
        if not isinstance(doc, Mapping):
            raise BodyError(f"{item} must be an object with a \"text\" string (or a string), "
                            f"got {type(doc).__name__}", item)
        unknown = sorted(set(doc) - DOCUMENT_KEYS)
        if unknown:
            raise BodyError(f"{item} has unknown field(s) {unknown}; a document takes "
                            f"{sorted(DOCUMENT_KEYS)}", f"{item}.{unknown[0]}")
        if "text" not in doc:
            raise BodyError(f"{item} has no \"text\"", f"{item}.text")
        text = _text(doc["text"], f"{item}.text")
        title = _text(doc.get("title"), f"{item}.title", required=False)
        size = len(str(text)) + len(title or "")
        if size > limits.document_chars:
            raise BodyError(f"{item} has {size} characters; this server takes at most "
                            f"{limits.document_chars} per document (minipic serve "
                            f"--max-document-chars)", f"{item}.text")
        span: dict[str, str] = {"text": f"{title}: {text}" if title else str(text)}
        if doc.get("id") is not None:
            span_id = _text(doc["id"], f"{item}.id")
            if not span_id:
                raise BodyError(f"{item}.id is empty", f"{item}.id")
            span["id"] = span_id
        out.append(span)
    return out


def _options(value: Any, allowed: frozenset[str]) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BodyError(f"{MINIPIC_KEY} must be an object, got {type(value).__name__}",
                        MINIPIC_KEY)
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise BodyError(f"{MINIPIC_KEY} has unknown field(s) {unknown}; known: {sorted(allowed)}",
                        f"{MINIPIC_KEY}.{unknown[0]}")
    for key in ("mode", "budget"):
        if key in value and not isinstance(value[key], str):
            raise BodyError(f"{MINIPIC_KEY}.{key} must be a string", f"{MINIPIC_KEY}.{key}")
    return value


def _content(message: Mapping[str, Any], where: str) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                raise BodyError(f"{where}.content[{j}]: only text parts can go with documents",
                                f"{where}.content[{j}]")
            parts.append(part["text"])
        return "".join(parts)
    raise BodyError(f"{where}.content must be a string or a list of text parts",
                    f"{where}.content")


def _conversation(messages: Any) -> tuple[str | None, str]:
    """``(system, question)`` of a chat: system messages joined, earlier turns as a transcript
    before the last user message."""
    if not isinstance(messages, list) or not messages:
        raise BodyError("messages must be a non-empty list", "messages")
    system: list[str] = []
    turns: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise BodyError(f"{where} must be an object", where)
        role = message.get("role")
        if not isinstance(role, str):
            raise BodyError(f"{where}.role must be a string, got {type(role).__name__}",
                            f"{where}.role")
        if role in SYSTEM_ROLES:
            system.append(_content(message, where))
        elif role in ("user", "assistant"):
            turns.append((str(role), _content(message, where)))
        else:
            raise BodyError(f"{where}.role {role!r} cannot go with documents (system, "
                            f"developer, user and assistant can)", f"{where}.role")
    if not turns or turns[-1][0] != "user":
        raise BodyError("the last non-system message must be the user's question",
                        f"messages[{len(messages) - 1}]")
    *earlier, (_, question) = turns
    transcript = [f"{'User' if role == 'user' else 'Assistant'}: {text}"
                  for role, text in earlier if text.strip()]
    if transcript:
        question = "\n".join([*transcript, f"User: {question}"])
    return ("\n".join(system) if system else None), question


def _max_tokens(body: Mapping[str, Any], keys: tuple[str, ...], default: int) -> int:
    for key in keys:
        value = body.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise BodyError(f"{key} must be a non-negative integer", key)
            return value
    return default


def _salt(body: Mapping[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise BodyError("cache_salt must be a non-empty string", "cache_salt")
    return salt


def parse(route: Route, body: dict[str, Any], limits: Limits | None = None) -> DocumentsRequest:
    """The layout inputs of a request that ``wants_documents``; raises :class:`BodyError`."""
    limits = limits or Limits()
    if route == "chat":
        for key, why in CHAT_REFUSED.items():
            if body.get(key) not in (None, [], {}, False):
                raise BodyError(f"{key} cannot be combined with documents: {why}", key)
        options = _options(body.get(MINIPIC_KEY), CHAT_OPTIONS)
        if DOCUMENTS_KEY not in body or body[DOCUMENTS_KEY] is None:
            raise BodyError(f"a {MINIPIC_KEY} object on /v1/chat/completions needs documents "
                            f"in the \"{DOCUMENTS_KEY}\" field", DOCUMENTS_KEY)
        documents = _documents(body[DOCUMENTS_KEY], DOCUMENTS_KEY, limits)
        system, question = _conversation(body.get("messages"))
        max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), 1)
    else:
        options = _options(body.get(MINIPIC_KEY), COMPLETION_OPTIONS)
        if body.get("prompt") not in (None, "", []):
            raise BodyError(f"send either prompt or {MINIPIC_KEY}.question, not both", "prompt")
        if "question" not in options:
            raise BodyError(f"{MINIPIC_KEY}.question is required", f"{MINIPIC_KEY}.question")
        question = str(_text(options["question"], f"{MINIPIC_KEY}.question"))
        if "documents" not in options:
            raise BodyError(f"{MINIPIC_KEY}.documents is required", f"{MINIPIC_KEY}.documents")
        documents = _documents(options["documents"], f"{MINIPIC_KEY}.documents", limits)
        system = _text(options.get("system"), f"{MINIPIC_KEY}.system", required=False)
        max_tokens = _max_tokens(body, ("max_tokens",), COMPLETIONS_DEFAULT_MAX_TOKENS)
    if not question.strip():
        raise BodyError("the question is empty", "messages" if route == "chat" else
                        f"{MINIPIC_KEY}.question")
    mode = options.get("mode", Mode.BLOCK_ATTENTION.value)
    budget = options.get("budget", BudgetPolicy.ERROR.value)
    try:
        mode = str(parse_mode(mode))
    except InvalidInputError as exc:
        raise BodyError(str(exc), f"{MINIPIC_KEY}.mode") from None
    if budget not in {p.value for p in BudgetPolicy}:
        raise BodyError(f"unknown budget policy {budget!r}; known: "
                        f"{', '.join(p.value for p in BudgetPolicy)}", f"{MINIPIC_KEY}.budget")
    return DocumentsRequest(route=route, question=question, documents=documents, system=system,
                            mode=mode, budget=budget, cache_salt=_salt(body),
                            max_tokens=max_tokens)
