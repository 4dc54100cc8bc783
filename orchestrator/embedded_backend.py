"""``EmbeddedBackend``: vLLM's ``AsyncLLM`` in this process, with the minipic plugin on.

Why AsyncLLM and not ``vllm.LLM``: ISPS needs many requests in flight at once (span prefills
overlapping other requests' decodes) and a first-token timestamp per request; ``LLM.generate`` is
a blocking batch call. ``AsyncLLM.generate`` is an async generator; with ``output_kind=DELTA``
every step's new tokens arrive as they are produced, so the first item's arrival is the TTFT.

One event loop per engine: AsyncLLM starts its output-handler task on the loop of its first
request, and a second loop would wait forever on outputs that go to the first. The backend
remembers its loop and refuses another one with a clear error (``SyncOrchestrator`` gives the
engine a private loop thread, which is how to use it from sync code).
"""

from __future__ import annotations

import asyncio
import gc
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from minipic.orchestrator.backends import BackendInfo, Delta, Sampling, TransportBackend, Usage
from minipic.orchestrator.errors import BadInputError, EngineError, MinipicError
from minipic.orchestrator.kv_usage import KVUsageMonitor
from minipic.span_contract.engine_config import (
    EngineSettings,
    engine_shutdown_timeout,
    patched_environ,
)
from minipic.span_contract.engine_utilities import HOLE_STATS_UTILITY, KEY_SHADOW_STATS_RPC
from minipic.span_contract.model_support import MODEL_SUPPORT_UTILITY, ModelSupport
from minipic.span_contract.span_config import SPANS_OPT_IN_KEY


def settings_from_args(model: str | None, engine_args: dict[str, Any]) -> EngineSettings:
    """``EngineSettings`` from ``embedded()``'s keywords: known fields by name, the rest are
    passed to vLLM unchanged (``extra``)."""
    known = {k: v for k, v in engine_args.items() if k in EngineSettings.model_fields}
    extra = {k: v for k, v in engine_args.items() if k not in EngineSettings.model_fields}
    extra = {**known.pop("extra", {}), **extra}
    return EngineSettings(model=model, extra=extra, **known).resolved()


class EmbeddedBackend(TransportBackend):
    """In-process engine. Build with ``EmbeddedBackend.start(settings)`` (blocks while vLLM
    loads the model, tens of seconds on CPU)."""

    def __init__(self, engine: Any, settings: EngineSettings,
                 kv_usage: KVUsageMonitor | None = None) -> None:
        self.engine = engine
        self.settings = settings
        self.info = BackendInfo(
            kind="embedded", model=str(settings.model), tokenizer=str(settings.model),
            max_model_len=settings.max_model_len,
            span_config=settings.span_config if settings.pic else None,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        # KV blocks in use, from the engine's step statistics (wired in by ``start``)
        self.kv_usage = kv_usage or KVUsageMonitor(position_free=False)

    @classmethod
    def start(cls, settings: EngineSettings) -> EmbeddedBackend:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        monitor = KVUsageMonitor(position_free=settings.pic and "rope" in settings.features)
        with patched_environ(settings.plugin_env()):
            engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**settings.llm_kwargs()),
                                               stat_loggers=[monitor.stat_logger_factory()])
        backend = cls(engine, settings, monitor)
        # Imports during start-up may store an exception whose traceback keeps this frame
        # alive; it must not keep the engine alive past close() too.
        del engine
        return backend

    async def fetch_model_support(self) -> ModelSupport | None:
        """The engine's position-free verdict, asked once on the caller's loop (AsyncLLM binds
        its output handler to the loop of its first call, so it cannot be asked at start)."""
        if self.info.model_support is None and self.info.span_config is not None \
                and self.settings is not None and "rope" in self.settings.features:
            self._check_loop()
            raw = await self.engine.engine_core.call_utility_async(MODEL_SUPPORT_UTILITY)
            self.info.model_support = ModelSupport.from_dict(raw)
        return self.info.model_support

    def _check_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise MinipicError(
                "this embedded engine is bound to the event loop of its first request; use one "
                "loop for its lifetime (or SyncOrchestrator, which keeps one for you)"
            )
        if self._closed:
            raise EngineError("the embedded engine was closed")

    def _request(self, token_ids: Sequence[int], sampling: Sampling, cache_salt: str | None,
                 request_id: str | None, route_as: Sequence[int] | None) -> tuple[Any, Any, str]:
        """``AsyncLLM.generate``'s arguments: the prompt, the sampling parameters (deltas) and
        the request id. ``route_as`` is ignored: one engine has nowhere else to send a prefill."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self._check_loop()
        params = SamplingParams(
            max_tokens=sampling.max_tokens, temperature=sampling.temperature,
            top_p=sampling.top_p, seed=sampling.seed, stop=list(sampling.stop) or None,
            output_kind=RequestOutputKind.DELTA,
            # span semantics are opt-in per request; never on a model that is not position-free
            extra_args={SPANS_OPT_IN_KEY: True} if self.info.spans_served else None,
        )
        prompt = TokensPrompt(prompt_token_ids=list(token_ids))
        if cache_salt is not None:
            prompt["cache_salt"] = cache_salt
        return prompt, params, request_id or f"minipic-{uuid.uuid4().hex}"

    async def _send(self, request: tuple[Any, Any, str], token_ids: Sequence[int]
                    ) -> AsyncIterator[Delta | Usage]:
        """``AsyncLLM.generate``'s outputs, one ``Delta`` each (its first choice's delta);
        closed early, the engine's generator is dropped, which aborts the request."""
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError

        cached = 0
        try:
            async for out in self.engine.generate(*request):
                if out.num_cached_tokens is not None:
                    cached = max(cached, out.num_cached_tokens)
                choice = out.outputs[0] if out.outputs else None
                yield Delta() if choice is None else Delta(
                    choice.text, choice.token_ids, choice.finish_reason)
        except EngineDeadError as exc:
            raise EngineError(f"the embedded vLLM engine died: {exc}") from exc
        except (VLLMClientError, ValueError) as exc:
            # keep the cause, not its frames: they pin the engine alive past close()
            raise BadInputError(f"the engine rejected the request: {exc}") from (
                exc.with_traceback(None))
        yield Usage(prompt_tokens=len(token_ids), cached_tokens=cached)

    async def prompt_logprobs(self, token_ids: Sequence[int], k: int, *,
                              spans: bool = True) -> list[dict[int, float] | None]:
        """Log-probabilities of the top ``k`` next tokens (and of the actual one) at every
        prompt position, as the engine computes them in one request (teacher forcing;
        ``minipic eval``). ``spans``: opt the request in to span semantics. vLLM reads no
        cached blocks for such a request, which the engine's span isolation makes harmless:
        a cold prompt is computed as the warm one."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._check_loop()
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k,
                                detokenize=False,  # token ids are what is compared
                                extra_args={SPANS_OPT_IN_KEY: True} if spans else None)
        final = None
        async for out in self.engine.generate(TokensPrompt(prompt_token_ids=list(token_ids)),
                                              params, f"minipic-lp-{uuid.uuid4().hex}"):
            final = out
        assert final is not None and final.prompt_logprobs is not None
        return [None if pos is None else {int(t): float(lp.logprob) for t, lp in pos.items()}
                for pos in final.prompt_logprobs]

    async def rotated_pool_stats(self) -> dict[str, Any]:
        """The CPU worker's rotated-block pool: bytes now, peak, cap and the budget it was given
        (memory outside the KV blocks, inside the configured KV space; see
        ``engine_ext/attention/key_shadow/pool.py``). Empty when the engine has no such pool."""
        self._check_loop()
        try:
            replies = await self.engine.collective_rpc(KEY_SHADOW_STATS_RPC)
        except Exception:  # stock engine, GPU, or plugin off: no pool to report
            return {}
        return replies[0] if replies else {}

    async def prefill_step_stats(self) -> dict[str, Any]:
        """Engine steps per opted-in prompt, counted by the scheduler
        (``engine_ext/holes/scheduler_steps.py``): a histogram and the recent prompts. Empty when
        the engine runs without the lookup past misses."""
        self._check_loop()
        if not (self.settings.pic and "holes" in self.settings.features):
            return {}  # (asking would log the EngineCore's AttributeError)
        try:
            return await self.engine.engine_core.call_utility_async(HOLE_STATS_UTILITY)
        except Exception:  # plugin off or no holes feature: the utility does not exist
            return {}

    async def reset_cache(self) -> None:
        self._check_loop()
        if not await self.engine.reset_prefix_cache():
            raise EngineError("the engine refused to reset its prefix cache (requests running?)",
                              retryable=True)

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Stop the engine's processes now (idempotent; safe without a running loop).

        With ``engine_shutdown_timeout()``, not vLLM's 5 s: on a busy CPU the EngineCore needs
        longer to stop its worker, and killed before that it leaks a shared-memory segment
        (the resource tracker's "leaked shared_memory objects" warning at exit)."""
        if not self._closed:
            self._closed = True
            self.engine.shutdown(timeout=engine_shutdown_timeout())
            # collect it now: AsyncLLM sits in reference cycles, and its __del__ (a second
            # shutdown) raises if it only runs at interpreter exit, after vLLM's modules are gone
            self.engine = None
            gc.collect()
