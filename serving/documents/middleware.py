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
first event of a stream. Bad bodies get an OpenAI-format 400 naming the item.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from orchestrator.errors import MinipicError
from serving.documents import chat_render
from serving.documents.bodies import (
    DOCUMENTS_KEY,
    MINIPIC_KEY,
    ROUTES,
    BodyError,
    parse,
    wants_documents,
)
from span_contract.span_config import SPANS_OPT_IN_KEY

logger = logging.getLogger("minipic.documents")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
STATE_ATTR = "minipic_documents"  # app.state: the ServerSide, set by the endpoint plugin


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionError("client disconnected while sending the body")
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # later: the client's disconnect, as vLLM expects to see it

    return replay


def _with_length(scope: Scope, length: int) -> Scope:
    headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
    return {**scope, "headers": [*headers, (b"content-length", str(length).encode())]}


async def _error(send: Send, status: int, message: str, param: str | None,
                 kind: str = "BadRequestError") -> None:
    payload = json.dumps({"error": {"message": message, "type": kind, "param": param,
                                    "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


def _rewrite(route: str, body: dict[str, Any], ids: list[int], key: str) -> dict[str, Any]:
    out = {k: v for k, v in body.items() if k not in (MINIPIC_KEY, DOCUMENTS_KEY)}
    xargs = dict(out.get("vllm_xargs") or {})
    xargs[SPANS_OPT_IN_KEY] = True
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

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = ROUTES.get(scope.get("path", "")) if scope.get("type") == "http" else None
        if route is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        try:
            raw = await _read_body(receive)
        except ConnectionError:
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
            await self.app(scope, _replay(raw, receive), send)
            return
        side = getattr(scope["app"].state, STATE_ATTR, None) if "app" in scope else None
        if side is None:
            await _error(send, 400, "documents need the minipic plugin, and this server runs "
                                    "without it (started with --no-pic?); send a plain prompt",
                         DOCUMENTS_KEY if route == "chat" else MINIPIC_KEY)
            return
        try:
            request = parse(route, body)
            prepared = await side.prepare(request)
        except MinipicError as exc:
            await _error(send, 400, str(exc), getattr(exc, "param", None))
            return
        key = uuid.uuid4().hex
        new_body = json.dumps(_rewrite(route, body, prepared.prompt.prompt_token_ids,
                                       key)).encode()
        if route == "chat":
            chat_render.LAYOUTS[key] = prepared.prompt.prompt_token_ids
        try:
            await self.app(_with_length(scope, len(new_body)), _replay(new_body, receive),
                           EvidenceSend(send, prepared.evidence))
        finally:
            chat_render.LAYOUTS.pop(key, None)


__all__ = ["BodyError", "DocumentsMiddleware", "STATE_ATTR"]
