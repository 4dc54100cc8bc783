"""The request-body bound (``minipic serve --max-body-mib``), wherever a body enters minipic.

Why one module: a server (``serving.documents.middleware``, in each replica too) and the
cluster's ingress (``serving.ingress``) must refuse the same bodies with the same answer, or a
client would see one limit talking to a server and another talking to a cluster. The limit is
``Limits.body_bytes`` (``serving.documents.bodies``), which reaches every process through the
environment (``Limits.env``: set by ``minipic serve``, and put in the Ray job's environment by
``serving.cluster_app.run_cluster``).

Why before anything else: a body is held in memory whole, then parsed and laid out; without a
bound one request of any size holds the process's memory for as long as the client likes. A
declared ``Content-Length`` over the limit is refused before a byte of the body is read; a body
of unknown length (chunked) is read chunk by chunk and refused as soon as it passes the limit.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from minipic.serving.documents.bodies import Limits

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
TOO_LARGE_TYPE = "RequestTooLargeError"
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class BodyTooLarge(Exception):
    """The request body is over the server's limit."""


def declared_length(scope: Scope) -> int | None:
    """The request's ``Content-Length`` (None when absent or not a number: chunked)."""
    for key, value in scope.get("headers", []):
        if key.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole body, or ``BodyTooLarge`` as soon as it is known to pass ``limit`` bytes (from
    its declared length, before reading; else after the chunk that passed it).
    ``ConnectionError`` when the client leaves while sending it."""
    declared = declared_length(scope)
    if declared is not None and declared > limit:
        raise BodyTooLarge
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionError("client disconnected while sending the body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` for the app behind: the body read here, then the client's own messages
    (its disconnect, which streaming responses wait for)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def error_body(status: int, message: str, kind: str, param: str | None = None) -> bytes:
    """vLLM's OpenAI-format error body, so clients parse minipic's errors as they parse vLLM's."""
    return json.dumps({"error": {"message": message, "type": kind, "param": param,
                                 "code": status}}).encode()


async def send_error(send: Send, status: int, message: str, kind: str,
                     param: str | None = None) -> None:
    payload = error_body(status, message, kind, param)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


def too_large_message(limit: int) -> str:
    return f"the request body is over this server's limit of {limit} bytes (minipic serve " \
           f"--max-body-mib)"


async def send_too_large(send: Send, limit: int) -> None:
    await send_error(send, 413, too_large_message(limit), TOO_LARGE_TYPE)


class BodyLimitMiddleware:
    """Every request with a body (POST, PUT, PATCH) is read here under the limit, then handed
    on with its body replayed; over the limit it gets the 413 and the app behind never runs.

    ``limits`` None: ``Limits.from_env()`` per request, so the process's environment (how the
    limit reaches a cluster's processes) is the one place it is set."""

    def __init__(self, app: ASGIApp, limits: Limits | None = None) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method") not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        limit = (self.limits or Limits.from_env()).body_bytes
        try:
            body = await read_body(scope, receive, limit)
        except ConnectionError:
            return
        except BodyTooLarge:
            await send_too_large(send, limit)
            return
        await self.app(scope, replay(body, receive), send)
