"""The ASGI layer on ``/v1/chat/completions`` and ``/v1/completions`` for documents requests.

Why a middleware and not new routes: clients keep the URLs they know, and vLLM's own handlers
(validation, sampling, streaming, usage) answer the laid-out request. The middleware reads the
body; a request that does not ask for documents is replayed untouched (stock semantics). One
that does is checked (``bodies``), laid out and prefilled (``server_side``), rewritten:

* completions: ``prompt`` becomes the laid-out ids, ``minipic`` is removed;
* chat: ``documents`` / ``minipic`` are removed and the layout is parked for the render hook
  (``chat_render``);

both with ``vllm_xargs.minipic_spans = true``. The response gets a ``minipic`` object (layout,
span statuses, expected cached tokens, skipped documents): at the top of a JSON response, in the
first event of a stream. Bad bodies get an OpenAI-format 400 naming the item; a body over
``Limits.body_bytes`` gets a 413 before it is read further (plain requests too: the middleware
would otherwise hold any size in memory); a documents request naming a LoRA adapter or an
unknown model is refused before any span is prefilled (spans are prefilled on the base model,
whose KV an adapter's final would never hit).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from minipic.orchestrator.errors import MinipicError
from minipic.serving.body_limit import BodyTooLarge, read_body, replay, send_error, send_too_large
from minipic.serving.documents import chat_render
from minipic.serving.documents.bodies import (
    DOCUMENTS_KEY,
    MINIPIC_KEY,
    ROUTES,
    BodyError,
    Limits,
    parse,
    wants_documents,
)
from minipic.span_contract.span_config import SPANS_OPT_IN_KEY

logger = logging.getLogger("minipic.documents")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
STATE_ATTR = "minipic_documents"  # app.state: the ServerSide, set by the endpoint plugin


def _model_problem(scope: Scope, body: dict[str, Any]) -> tuple[int, str, str] | None:
    """A documents request must run on the base model: ``(status, message, type)`` if not."""
    name = body.get("model")
    models = getattr(scope["app"].state, "openai_serving_models", None) if "app" in scope else None
    if name is None or models is None or models.is_base_model(name):
        return None
    if name in getattr(models, "lora_requests", {}):
        return (400, f"documents run on the base model, not on the LoRA adapter {name!r}: the "
                     f"spans are prefilled and cached with the base model's KV, which the "
                     f"adapter's final would never hit; send documents with model "
                     f"{models.model_name()!r}", "BadRequestError")
    return 404, f"The model `{name}` does not exist.", "NotFoundError"


def _with_length(scope: Scope, length: int) -> Scope:
    headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
    return {**scope, "headers": [*headers, (b"content-length", str(length).encode())]}


async def _error(send: Send, status: int, message: str, param: str | None,
                 kind: str = "BadRequestError") -> None:
    await send_error(send, status, message, kind, param)


def _rewrite(route: str, body: dict[str, Any], ids: list[int], key: str,
             opt_in: bool = True) -> dict[str, Any]:
    """The body vLLM answers: the laid-out ids in place of the documents, opted in to span
    semantics unless the layout is the plain prompt (a model that is not position-free)."""
    out = {k: v for k, v in body.items() if k not in (MINIPIC_KEY, DOCUMENTS_KEY)}
    xargs = dict(out.get("vllm_xargs") or {})
    if opt_in:
        xargs[SPANS_OPT_IN_KEY] = True
    else:
        xargs.pop(SPANS_OPT_IN_KEY, None)
    if route == "chat":
        xargs[chat_render.LAYOUT_KEY] = key
    else:
        out["prompt"] = ids
    out["vllm_xargs"] = xargs
    return out


class EvidenceSend:
    """``send`` that adds the ``minipic`` object to a 200 response, JSON or event stream."""

    def __init__(self, send: Send, evidence: dict[str, Any]) -> None:
        self.send = send
        self.evidence = evidence
        self.start: Message | None = None
        self.kind = "other"
        self.buffer: list[bytes] = []
        self.injected = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = dict(message.get("headers", []))
            ctype = headers.get(b"content-type", b"").decode().lower()
            if message.get("status") == 200 and "application/json" in ctype:
                self.kind, self.start = "json", message  # held until the body is complete
                return
            if message.get("status") == 200 and "text/event-stream" in ctype:
                self.kind = "stream"
            await self.send(message)
            return
        if message["type"] != "http.response.body" or self.kind == "other":
            await self.send(message)
            return
        if self.kind == "json":
            self.buffer.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = self._json(b"".join(self.buffer))
            assert self.start is not None
            headers = [(k, v) for k, v in self.start.get("headers", [])
                       if k.lower() != b"content-length"]
            await self.send({**self.start,
                             "headers": [*headers, (b"content-length", str(len(body)).encode())]})
            await self.send({"type": "http.response.body", "body": body})
            return
        if not self.injected:
            message = {**message, "body": self._first_event(message.get("body", b""))}
        await self.send(message)

    def _json(self, body: bytes) -> bytes:
        try:
            payload = json.loads(body)
        except ValueError:
            return body
        if isinstance(payload, dict):
            payload[MINIPIC_KEY] = self.evidence
        return json.dumps(payload).encode()

    def _first_event(self, chunk: bytes) -> bytes:
        text = chunk.decode("utf-8", errors="surrogateescape")
        start = text.find("data: {")
        if start < 0:
            return chunk
        end = text.find("\n", start)
        end = len(text) if end < 0 else end
        try:
            payload = json.loads(text[start + 6:end])
        except ValueError:
            return chunk
        payload[MINIPIC_KEY] = self.evidence
        self.injected = True
        text = text[:start] + "data: " + json.dumps(payload) + text[end:]
        return text.encode("utf-8", errors="surrogateescape")


class DocumentsMiddleware:
    """Documents requests on the standard routes (see the module docstring)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]],
                 limits: Limits | None = None) -> None:
        self.app = app
        self.limits = limits or Limits.from_env()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = ROUTES.get(scope.get("path", "")) if scope.get("type") == "http" else None
        if route is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        try:
            raw = await read_body(scope, receive, self.limits.body_bytes)
        except ConnectionError:
            return
        except BodyTooLarge:
            await send_too_large(send, self.limits.body_bytes)
            return
        body = None
        # only a body naming one of the two fields can ask for documents: plain requests skip
        # the JSON parse (vLLM parses them again anyway)
        if raw and (b'"' + DOCUMENTS_KEY.encode() in raw or b'"' + MINIPIC_KEY.encode() in raw):
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError):
                body = None  # not JSON: vLLM's own 400 for it
        if not wants_documents(route, body):
            await self.app(scope, replay(raw, receive), send)
            return
        side = getattr(scope["app"].state, STATE_ATTR, None) if "app" in scope else None
        if side is None:
            await _error(send, 400, "documents need the minipic plugin, and this server runs "
                                    "without it (started with --no-pic?); send a plain prompt",
                         DOCUMENTS_KEY if route == "chat" else MINIPIC_KEY)
            return
        problem = _model_problem(scope, body)
        if problem is not None:
            status, message, kind = problem
            await _error(send, status, message, "model", kind)
            return
        try:
            request = parse(route, body, self.limits)
            prepared = await side.prepare(request)
        except MinipicError as exc:
            await _error(send, 400, str(exc), getattr(exc, "param", None))
            return
        key = uuid.uuid4().hex
        new_body = json.dumps(_rewrite(route, body, prepared.prompt.prompt_token_ids,
                                       key, prepared.opt_in)).encode()
        if route == "chat":
            chat_render.LAYOUTS[key] = prepared.prompt.prompt_token_ids
        try:
            await self.app(_with_length(scope, len(new_body)), replay(new_body, receive),
                           EvidenceSend(send, prepared.evidence))
        finally:
            chat_render.LAYOUTS.pop(key, None)


__all__ = ["BodyError", "DocumentsMiddleware", "STATE_ATTR"]
