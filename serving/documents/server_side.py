"""The layout and the span prefills, done by the server with the SDK's own parts.

One :class:`Orchestrator` per API-server process, over the server's own engine client
(:class:`ServerEngineBackend`, the embedded backend's request path on an engine it does not
own). :func:`layout` makes the ``PromptBuilder.build`` call ``Orchestrator.build`` makes, with
the builder ``Orchestrator.connect`` would make, so a plain client's prompt equals the SDK's for
the same inputs; ``Scheduler.prewarm`` runs its span prefills with
the SDK's de-duplication: a span another request is already prefilling is joined, not sent again
(one task per ``(cache_salt, prefill key)``), and a span the warmth registry knows warm is not
sent at all. Prefills hold only the scheduler's prefill slots, so requests whose spans are warm
go straight to the engine: the interleaving of the SDK's ISPS, per request instead of per batch.

What the registry may get wrong (a span evicted since) costs speed only: the final then computes
that span inside itself, isolated (the engine guarantees it), and leaves it cached again.

On a model that is not position-free (``span_contract.model_support``) the documents are laid out
as the plain prompt (``prefix`` mode: no markers, no prefills, stock prefix caching) and sent
without the span opt-in: the answer is exactly the plain prompt's, the response's ``minipic``
object says ``fallback`` with the reason, and the server logs it once. A user who sent documents
gets an answer; span caching is what the model cannot have.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from minipic.orchestrator import Orchestrator
from minipic.orchestrator.backends import BackendInfo
from minipic.orchestrator.embedded_backend import EmbeddedBackend
from minipic.orchestrator.errors import BadInputError, MinipicError, from_build_error
from minipic.orchestrator.kv_usage import KVUsageMonitor
from minipic.prompt_builder import BuiltPrompt, PromptBuilder, PromptBuildError
from minipic.serving.documents.bodies import DocumentsRequest
from minipic.span_contract.model_support import ModelSupport
from minipic.span_contract.span_config import SpanConfig

logger = logging.getLogger("minipic.documents")


def layout_builder(model_dir: str, span_config: SpanConfig, max_model_len: int) -> PromptBuilder:
    """The prompt builder the SDK would make for this server (``Orchestrator.connect``)."""
    return PromptBuilder.from_pretrained(
        model_dir, block_size=span_config.block_size, ssep_id=span_config.ssep_id,
        pdep_id=span_config.pdep_id, pad_id=span_config.pad_id, max_model_len=max_model_len,
        sink_ids=span_config.sink_ids)


def layout(builder: PromptBuilder, request: DocumentsRequest) -> BuiltPrompt:
    """The request laid out exactly as ``Orchestrator.build`` lays out the same inputs (the
    server's final and the cluster ingress's routing both use this); ``BadInputError`` family
    when it cannot be built."""
    try:
        return builder.build(question=request.question, system=request.system,
                             spans=list(request.documents), mode=request.mode,
                             max_tokens=request.max_tokens, budget=request.budget)
    except PromptBuildError as exc:
        raise from_build_error(exc) from exc


class ServerEngineBackend(EmbeddedBackend):
    """The API server's engine client as an SDK backend. The server owns the engine: closing
    this backend only stops its own use of it."""

    def __init__(self, engine_client: Any, model_dir: str, max_model_len: int,
                 span_config: SpanConfig) -> None:
        self.engine = engine_client
        self.settings = None  # type: ignore[assignment]  # no EngineSettings: not ours to start
        self.info = BackendInfo(kind="server", model=model_dir, tokenizer=model_dir,
                                max_model_len=max_model_len, span_config=span_config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self.kv_usage = KVUsageMonitor(position_free=False)

    def close(self) -> None:
        self._closed = True


@dataclass(frozen=True)
class Prepared:
    """A laid-out request whose prefills are done, and the evidence for its response."""

    prompt: BuiltPrompt
    evidence: dict[str, Any]
    opt_in: bool = True  # False: the plain prompt on a model that is not position-free


class ServerSide:
    """Lays out and prefills documents requests for one API server."""

    def __init__(self, engine_client: Any, model_dir: str, max_model_len: int,
                 span_config: SpanConfig, support: ModelSupport | None = None) -> None:
        self.support = support or ModelSupport(True)
        self._fallback_logged = False
        backend = ServerEngineBackend(engine_client, model_dir, max_model_len, span_config)
        self.orchestrator = Orchestrator(backend, layout_builder(model_dir, span_config,
                                                                 max_model_len))
        self.prefills_sent = 0
        self.requests = 0
        # Layouts tokenize every document: off the event loop (a large request must not stall
        # other streams and /health), on one thread (one tokenizer, used one call at a time)
        self._layout_thread = ThreadPoolExecutor(1, thread_name_prefix="minipic-layout")

    def stats(self) -> dict[str, int]:
        return {"requests": self.requests, "prefills_sent": self.prefills_sent,
                "spans_believed_warm": len(self.orchestrator.registry)}

    def build(self, request: DocumentsRequest) -> BuiltPrompt:
        if not self.support.position_free:
            request = dataclasses.replace(request, mode="prefix")
        return layout(self.orchestrator.builder, request)

    async def prepare(self, request: DocumentsRequest) -> Prepared:
        loop = asyncio.get_running_loop()
        prompt = await loop.run_in_executor(self._layout_thread, self.build, request)
        self.requests += 1
        if not self.support.position_free:
            if not self._fallback_logged:
                self._fallback_logged = True
                logger.warning("minipic: documents are answered as plain prompts on this model "
                               "(%s)", self.support.reason)
            out = evidence(prompt, set(), 0, None)
            out["fallback"] = {"served_as": "plain prompt", "reason": self.support.reason}
            return Prepared(prompt, out, opt_in=False)
        registry = self.orchestrator.registry
        warm = {key for key in prompt.prefill_keys if (request.cache_salt, key) in registry}
        error = None
        try:
            sent = await self.orchestrator.scheduler.prewarm(prompt, request.cache_salt)
        except BadInputError:
            raise
        except MinipicError as exc:  # prefills are for speed: the final is correct without
            logger.warning("span prefills failed (%s); the final prompt computes its spans", exc)
            sent, error = 0, f"{type(exc).__name__}: {exc}"
        self.prefills_sent += sent
        return Prepared(prompt, evidence(prompt, warm, sent, error))


def evidence(prompt: BuiltPrompt, warm: set[str], sent: int, error: str | None) -> dict[str, Any]:
    """The response's ``minipic`` object: what the layout expects to be cached and why."""
    spans = []
    for span in prompt.spans:
        if span.prefill_key is None:
            status = "uncached"
        elif span.prefill_key in warm:
            status = "warm"
        else:
            status = "cold"  # prefilled for this request, or joined another's prefill
        spans.append({"kind": "system" if span.kind == "system" else "document",
                      "index": span.index, "id": span.span_id, "tokens": span.token_count,
                      "status": status})
    out: dict[str, Any] = {
        "mode": prompt.mode.value, "mode_spec": prompt.mode_spec or prompt.mode.value,
        "prompt_tokens": prompt.num_prompt_tokens,
        "expected_cached_tokens": prompt.expected_cached_tokens, "prefills_sent": sent,
        "spans": spans,
        "skipped_documents": [{"index": s.index, "id": s.span_id, "reason": s.reason}
                              for s in prompt.skipped_spans],
    }
    if prompt.budget is not None:
        out["budget"] = prompt.budget.model_dump(mode="json")
    if error is not None:
        out["prefill_error"] = error
    return out
