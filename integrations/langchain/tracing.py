"""The model call as a LangChain LLM run, so callbacks and tracers see it.

Why: a chain's model call is where LangChain users look for the prompt, the output and the token
usage (LangSmith, ``UsageMetadataCallbackHandler``, cost callbacks). ``SpanRAGRunnable`` answers
through the orchestrator, not through a LangChain model, so it opens the child run itself: one
``on_llm_start`` with the prompt as the model reads it, ``on_llm_new_token`` per streamed delta,
and ``on_llm_end`` with a ``ChatGeneration`` whose ``AIMessage`` carries ``usage_metadata``
(``input_token_details.cache_read`` = prompt tokens served from the KV cache) — or
``on_llm_error``.
"""

from __future__ import annotations

from typing import Any

from langchain_core.callbacks import (
    AsyncCallbackManagerForChainRun,
    AsyncCallbackManagerForLLMRun,
    CallbackManagerForChainRun,
    CallbackManagerForLLMRun,
)
from langchain_core.messages import AIMessageChunk
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, LLMResult

from minipic.integrations.langchain.io import to_message, usage_metadata
from minipic.orchestrator.results import Answer

RUN_NAME = "minipic"


def _serialized(model_name: str) -> dict[str, Any]:
    return {"lc": 1, "type": "not_implemented", "name": RUN_NAME,
            "id": ["orchestrator", "SpanRAGRunnable", "model"], "kwargs": {"model": model_name}}


def _metadata(model_name: str) -> dict[str, str]:
    """What LangSmith reads to name the provider and model of an LLM run."""
    return {"ls_provider": "minipic", "ls_model_name": model_name}


def _llm_result(answer: Answer, model_name: str) -> LLMResult:
    usage = usage_metadata(answer)
    return LLMResult(
        generations=[[ChatGeneration(message=to_message(answer, model_name),
                                     generation_info={"finish_reason": answer.finish_reason})]],
        llm_output={"model_name": model_name, "token_usage": {
            "prompt_tokens": usage["input_tokens"], "completion_tokens": usage["output_tokens"],
            "total_tokens": usage["total_tokens"],
            "prompt_tokens_details": {"cached_tokens": answer.cached_tokens}}},
    )


class LLMRun:
    """One model call's child run (sync or async callbacks alike)."""

    def __init__(self, run: CallbackManagerForLLMRun | AsyncCallbackManagerForLLMRun,
                 model_name: str) -> None:
        self.run = run
        self.model_name = model_name

    # sync ---------------------------------------------------------------------------------------

    @classmethod
    def start(cls, parent: CallbackManagerForChainRun, prompt: str, model_name: str,
              params: dict[str, Any]) -> LLMRun:
        manager = parent.get_child()
        manager.add_metadata(_metadata(model_name), inherit=False)
        (run,) = manager.on_llm_start(_serialized(model_name), [prompt],
                                      invocation_params=params, name=RUN_NAME)
        return cls(run, model_name)

    def token(self, text: str) -> None:
        assert isinstance(self.run, CallbackManagerForLLMRun)
        self.run.on_llm_new_token(text, chunk=_chunk(text))

    def end(self, result: Any) -> None:
        assert isinstance(self.run, CallbackManagerForLLMRun)
        if isinstance(result, Answer):
            self.run.on_llm_end(_llm_result(result, self.model_name))
        elif isinstance(result, BaseException):
            self.run.on_llm_error(result)

    # async --------------------------------------------------------------------------------------

    @classmethod
    async def astart(cls, parent: AsyncCallbackManagerForChainRun, prompt: str,
                     model_name: str, params: dict[str, Any]) -> LLMRun:
        manager = parent.get_child()
        manager.add_metadata(_metadata(model_name), inherit=False)
        (run,) = await manager.on_llm_start(_serialized(model_name), [prompt],
                                            invocation_params=params, name=RUN_NAME)
        return cls(run, model_name)

    async def atoken(self, text: str) -> None:
        assert isinstance(self.run, AsyncCallbackManagerForLLMRun)
        await self.run.on_llm_new_token(text, chunk=_chunk(text))

    async def aend(self, result: Any) -> None:
        assert isinstance(self.run, AsyncCallbackManagerForLLMRun)
        if isinstance(result, Answer):
            await self.run.on_llm_end(_llm_result(result, self.model_name))
        elif isinstance(result, BaseException):
            await self.run.on_llm_error(result)


def _chunk(text: str) -> ChatGenerationChunk:
    return ChatGenerationChunk(message=AIMessageChunk(content=text))
