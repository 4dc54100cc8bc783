"""The one interface the scheduler talks to, whatever runs the model.

Why a protocol this small: the scheduler only ever needs "run these token ids, tell me the text,
how many prompt tokens were cached and when the first token came", plus "forget the cache". An
in-process ``AsyncLLM`` (``embedded_backend``) and ``minipic serve`` over HTTP (``http_backend``)
both fit it, and so does a test's counting wrapper around either. Everything span-aware — which
prefills to send, when, and what a cached-token count means — stays above this line.

Backends raise ``orchestrator.errors`` types only: ``EngineUnreachableError`` when the engine
cannot be reached (retryable), ``EngineError`` with ``retryable`` set for engine-side failures,
``BadInputError`` when the engine rejects the request itself.

``generate`` and ``stream`` are written once, in ``TransportBackend``: both real backends derive
from it and supply only their transport (how a request is made and sent, and how its output
arrives), so timing, text assembly and the ``Completion`` are the same code for both.
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from minipic.span_contract.model_support import ModelSupport
from minipic.span_contract.span_config import SpanConfig


class Sampling(BaseModel):
    """Generation settings shared by both backends (greedy by default: answers are comparable)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = Field(64, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: tuple[str, ...] = ()


class Completion(BaseModel):
    """What one engine request returned."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int  # prompt tokens the engine took from its prefix cache
    ttft_s: float  # request sent -> first output token received
    latency_s: float  # request sent -> last output received
    finish_reason: str | None = None


class BackendInfo(BaseModel):
    """What the orchestrator must know about the engine behind a backend."""

    kind: str  # "embedded" | "http"
    model: str  # model folder (embedded) or served model name (http)
    tokenizer: str  # local folder the prompt builder loads its tokenizer from
    max_model_len: int
    span_config: SpanConfig | None  # None: the minipic plugin is off (stock vLLM caching)
    # whether the engine's model is position-free (None: not asked yet); a model that is not
    # gets its documents as the plain prompt, never opted in (span_contract.model_support)
    model_support: ModelSupport | None = None

    @property
    def spans_served(self) -> bool:
        """Whether requests may opt in to span semantics on this engine."""
        return self.span_config is not None and (
            self.model_support is None or self.model_support.position_free)


@runtime_checkable
class EngineBackend(Protocol):
    """An engine that runs token-id prompts with prefix caching."""

    info: BackendInfo

    async def generate(
        self,
        token_ids: Sequence[int],
        *,
        sampling: Sampling,
        cache_salt: str | None = None,
        request_id: str | None = None,
        route_as: Sequence[int] | None = None,
    ) -> Completion:
        """Run one prompt to completion; ``ttft_s`` is measured from the moment it is sent.

        ``route_as``: for a span prefill, the final prompt it serves; a cluster routes the
        prefill where that final will go (one engine has nowhere else to send it: ignored)."""
        ...

    async def reset_cache(self) -> None:
        """Drop every cached block (tests, benchmarks, and recovering from a known-stale cache)."""
        ...

    async def aclose(self) -> None:
        """Release the engine or connections. Idempotent."""
        ...


async def final_completion(stream: AsyncIterator[str | Completion]) -> Completion:
    """Drain a backend's ``stream()`` (text deltas, then the ``Completion``) to its Completion:
    what ``generate`` returns, so both backends answer through one code path."""
    done: Completion | None = None
    async for item in stream:
        if isinstance(item, Completion):
            done = item
    assert done is not None, "stream() ends with its Completion"
    return done


@dataclass(frozen=True)
class Delta:
    """One output step of a transport: new text and token ids (either may be empty). Its arrival
    is an output event: the first one is the request's first token (``ttft_s``)."""

    text: str = ""
    token_ids: Sequence[int] = ()
    finish_reason: str | None = None


@dataclass(frozen=True)
class Usage:
    """A transport's last item: the prompt's token count and how many of them were cached."""

    prompt_tokens: int
    cached_tokens: int


class TransportBackend(ABC):
    """``generate`` and ``stream`` over a transport a subclass supplies: ``_request`` (the
    request, made before the clock starts) and ``_send`` (its output as ``Delta`` items, then
    one ``Usage``; the transport's own failures mapped to ``orchestrator.errors`` types)."""

    @abstractmethod
    def _request(self, token_ids: Sequence[int], sampling: Sampling, cache_salt: str | None,
                 request_id: str | None, route_as: Sequence[int] | None) -> Any:
        """The request to send (checks that need no sending happen here)."""

    @abstractmethod
    def _send(self, request: Any, token_ids: Sequence[int]) -> AsyncIterator[Delta | Usage]:
        """Send ``request``: a ``Delta`` per output event, then its ``Usage``. Closed early (the
        caller stops reading), it stops the engine request."""

    async def generate(
        self,
        token_ids: Sequence[int],
        *,
        sampling: Sampling,
        cache_salt: str | None = None,
        request_id: str | None = None,
        route_as: Sequence[int] | None = None,
    ) -> Completion:
        """See ``EngineBackend.generate``."""
        return await final_completion(self.stream(token_ids, sampling=sampling,
                                                  cache_salt=cache_salt, request_id=request_id,
                                                  route_as=route_as))

    async def stream(
        self,
        token_ids: Sequence[int],
        *,
        sampling: Sampling,
        cache_salt: str | None = None,
        request_id: str | None = None,
        route_as: Sequence[int] | None = None,
    ) -> AsyncIterator[str | Completion]:
        """``generate``, one text delta at a time as the engine produces them (non-empty
        strings), then the ``Completion``. Closing the iterator early aborts the request."""
        request = self._request(token_ids, sampling, cache_salt, request_id, route_as)
        sent = time.perf_counter()
        first: float | None = None
        text: list[str] = []
        out_ids: list[int] = []
        finish: str | None = None
        usage: Usage | None = None
        async with contextlib.aclosing(self._send(request, token_ids)) as items:
            async for item in items:
                if isinstance(item, Usage):
                    usage = item
                    continue
                if first is None:
                    first = time.perf_counter()
                text.append(item.text)
                out_ids.extend(item.token_ids)
                finish = item.finish_reason or finish
                if item.text:
                    yield item.text
        done = time.perf_counter()
        assert usage is not None, "a transport ends with its Usage"
        yield Completion(
            text="".join(text), token_ids=out_ids, prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens, ttft_s=(first or done) - sent,
            latency_s=done - sent, finish_reason=finish,
        )
