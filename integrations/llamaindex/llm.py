"""``MinipicLLM``: minipic as a LlamaIndex LLM, with documents as spans when a caller has them.

LlamaIndex's LLM interface takes one prompt string. A component that only has a prompt (a query
transform, an agent step) gets a plain answer from the model. The response synthesizer
(``integrations.llamaindex.synthesizer``) passes the retrieved texts as ``documents=`` and the
query as the prompt, so the call is laid out with spans: every document is cached on its own
and reused wherever it appears next time.

Every call goes through ``llm_completion_callback``: LlamaIndex's callback event
(``CBEventType.LLM``)
and instrumentation events (``LLMCompletionStartEvent`` / ``EndEvent``) carry the
``CompletionResponse``, whose ``raw["usage"]`` has the OpenAI-style counts
(``prompt_tokens``, ``completion_tokens``, ``prompt_tokens_details.cached_tokens``) and whose
``additional_kwargs["minipic"]`` has the cache evidence (span statuses, expected cached tokens).

Both ways LlamaIndex documents for callbacks count: ``Settings.callback_manager``, and a
``callback_manager`` given to the LLM itself. LlamaIndex's glue replaces an LLM's manager with the
index's or the global one (``resolve_llm`` in ``index.as_query_engine(llm=...)``, a synthesizer's
``callback_manager`` setter), which would silently drop the handlers a user gave the LLM; so the
handlers given at construction are kept on whatever manager is assigned later.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llama_index.core.callbacks import CallbackManager
from llama_index.core.llms import (
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    CustomLLM,
    LLMMetadata,
)
from llama_index.core.llms.callbacks import llm_completion_callback
from pydantic import ConfigDict, Field, PrivateAttr, field_validator

from minipic.orchestrator.client import Orchestrator
from minipic.orchestrator.loop_bridge import (
    async_side,
    check_orchestrator,
    iterate_async,
    iterate_sync,
    run_async,
    run_sync,
)
from minipic.orchestrator.results import Answer
from minipic.orchestrator.streaming import stream_answer


def usage(answer: Answer) -> dict[str, Any]:
    """OpenAI-style usage of one answer (what LlamaIndex's token counter reads)."""
    completion = len(answer.token_ids)
    return {"prompt_tokens": answer.prompt_tokens, "completion_tokens": completion,
            "total_tokens": answer.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": answer.cached_tokens}}


def evidence(answer: Answer) -> dict[str, Any]:
    """The cache evidence of one answer, as plain data."""
    return {"mode": str(answer.mode), "cached_tokens": answer.cached_tokens,
            "expected_cached_tokens": answer.expected_cached_tokens,
            "cache_ok": answer.cache_ok, "ttft_s": answer.ttft_s,
            "prefills_sent": answer.prefills_sent,
            "spans": [s.model_dump(mode="json") for s in answer.spans],
            "skipped_documents": [s.model_dump(mode="json") for s in answer.skipped_spans]}


def with_handlers(manager: CallbackManager, handlers: Sequence[Any]) -> CallbackManager:
    """``manager``, or a copy of it that also has ``handlers`` (never the shared global one
    changed in place: other components use it)."""
    missing = [h for h in handlers if not any(h is have for have in manager.handlers)]
    if not missing:
        return manager
    return CallbackManager([*manager.handlers, *missing])


def response_of(answer: Answer, delta: str | None = None) -> CompletionResponse:
    return CompletionResponse(text=answer.text, delta=delta, raw={"usage": usage(answer)},
                              additional_kwargs={"minipic": evidence(answer)})


class MinipicLLM(CustomLLM):
    """A LlamaIndex LLM over an ``Orchestrator`` or ``SyncOrchestrator``.

    ``complete(prompt, documents=[...], system=..., mode=...)``: with documents, the prompt is
    the question and each document a span. ``answer_kwargs`` go to every answer
    (``max_tokens``, ``temperature``, ``cache_salt``, ``budget``, ...).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    orchestrator: Any = Field(description="an Orchestrator or a SyncOrchestrator")
    system: str | None = None
    mode: str = "block_attention"
    answer_kwargs: dict[str, Any] = Field(default_factory=dict)
    # the handlers the caller gave this LLM, kept on any manager assigned later (module docstring)
    _own_handlers: list[Any] = PrivateAttr(default_factory=list)

    def model_post_init(self, context: Any) -> None:
        super().model_post_init(context)
        manager = self.__dict__.get("callback_manager")
        if isinstance(manager, CallbackManager):
            self._own_handlers = list(manager.handlers)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "callback_manager" and isinstance(value, CallbackManager):
            value = with_handlers(value, getattr(self, "_own_handlers", []))
        super().__setattr__(name, value)

    @field_validator("orchestrator")
    @classmethod
    def _check_orchestrator(cls, value: Any) -> Any:
        return check_orchestrator(value)

    @classmethod
    def class_name(cls) -> str:
        return "MinipicLLM"

    @property
    def _aio(self) -> Orchestrator:
        return async_side(self.orchestrator)

    @property
    def metadata(self) -> LLMMetadata:
        info = self._aio.backend.info
        return LLMMetadata(context_window=info.max_model_len,
                           num_output=int(self.answer_kwargs.get("max_tokens", 64)),
                           model_name=info.model, is_chat_model=False)

    def _call(self, prompt: str, documents: Sequence[str], system: str | None,
              mode: str | None, kwargs: dict[str, Any]) -> tuple[Any, ...]:
        merged = {"require_documents": False, **self.answer_kwargs, **kwargs}
        return (prompt, list(documents), system if system is not None else self.system,
                mode or self.mode), merged

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, *, documents: Sequence[str] = (),
                 system: str | None = None, mode: str | None = None,
                 **kwargs: Any) -> CompletionResponse:
        args, merged = self._call(prompt, documents, system, mode, kwargs)
        return response_of(run_sync(self.orchestrator, self._aio.answer(*args, **merged)))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, *,
                        documents: Sequence[str] = (), system: str | None = None,
                        mode: str | None = None, **kwargs: Any) -> CompletionResponse:
        args, merged = self._call(prompt, documents, system, mode, kwargs)
        return response_of(await run_async(self.orchestrator, self._aio.answer(*args, **merged)))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, *,
                        documents: Sequence[str] = (), system: str | None = None,
                        mode: str | None = None, **kwargs: Any) -> CompletionResponseGen:
        args, merged = self._call(prompt, documents, system, mode, kwargs)
        items = iterate_sync(self.orchestrator,
                             lambda: stream_answer(self._aio, *args, **merged))
        return _responses(items)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, *,
                               documents: Sequence[str] = (), system: str | None = None,
                               mode: str | None = None,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        args, merged = self._call(prompt, documents, system, mode, kwargs)
        items = iterate_async(self.orchestrator,
                              lambda: stream_answer(self._aio, *args, **merged))

        async def gen() -> CompletionResponseAsyncGen:
            text = ""
            async for item in items:
                if isinstance(item, Answer):
                    yield response_of(item, delta="")
                else:
                    text += item
                    yield CompletionResponse(text=text, delta=item)

        return gen()


def _responses(items: Any) -> CompletionResponseGen:
    """Text deltas as LlamaIndex responses; the last one carries usage and evidence."""
    text = ""
    for item in items:
        if isinstance(item, Answer):
            yield response_of(item, delta="")
        else:
            text += item
            yield CompletionResponse(text=text, delta=item)
