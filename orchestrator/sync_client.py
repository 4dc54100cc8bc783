"""``SyncOrchestrator``: the same methods as ``Orchestrator``, callable from plain sync code.

Why a private loop thread and not ``asyncio.run`` per call: the embedded engine's output handler
lives on the event loop of its first request, and ISPS needs concurrent requests on one loop. So
the facade starts one loop in a daemon thread, builds the async orchestrator *inside* it, and
runs every call there (``run_coroutine_threadsafe``). Async code elsewhere can still reach it
with ``submit(...)`` and ``asyncio.wrap_future`` (the LangChain adapter does).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from minipic.orchestrator.client import Document, Orchestrator, Question
from minipic.orchestrator.errors import MinipicError
from minipic.orchestrator.results import Answer
from minipic.orchestrator.scheduler import Policy, SchedulerEvent, SchedulerOptions
from minipic.orchestrator.warmth import WarmthRegistry
from minipic.prompt_builder import BudgetPolicy, BuiltPrompt, Mode
from minipic.span_contract.model_support import ModelSupport

T = TypeVar("T")


class _LoopThread:
    """An event loop running forever in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                       name="minipic-orchestrator-loop")
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("SyncOrchestrator called from its own loop; await the async "
                               "orchestrator (.aio) there instead")
        return self.submit(coro).result()

    def stop(self) -> None:
        if self.loop.is_running():
            with contextlib.suppress(Exception):  # finalize streams left half-read
                self.submit(self.loop.shutdown_asyncgens()).result(timeout=10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=30)
        if not self.loop.is_running() and not self.loop.is_closed():
            self.loop.close()


async def _construct(factory: Callable[[], Orchestrator]) -> Orchestrator:
    return factory()  # inside the loop, so the engine binds to it


class SyncOrchestrator:
    """Blocking facade over an ``Orchestrator`` running on a private loop thread."""

    def __init__(self, factory: Callable[[], Orchestrator]) -> None:
        """``factory`` builds the async orchestrator; it runs on the loop thread."""
        self._thread = _LoopThread()
        try:
            self.aio: Orchestrator = self._thread.call(_construct(factory))
        except BaseException:
            self._thread.stop()
            raise
        self._closed = False

    @classmethod
    def embedded(cls, model: str | None = None, *,
                 options: SchedulerOptions | Mapping[str, Any] | None = None,
                 **engine_args: Any) -> SyncOrchestrator:
        """See ``Orchestrator.embedded``."""
        return cls(lambda: Orchestrator.embedded(model, options=options, **engine_args))

    @classmethod
    def connect(cls, base_url: str, model: str | None = None, **kwargs: Any) -> SyncOrchestrator:
        """See ``Orchestrator.connect``."""
        return cls(lambda: Orchestrator.connect(base_url, model, **kwargs))

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run a coroutine on the orchestrator's loop; wait with ``.result()`` or, from async
        code, ``await asyncio.wrap_future(...)``."""
        return self._thread.submit(coro)

    # same names and arguments as Orchestrator ---------------------------------------------------

    @property
    def options(self) -> SchedulerOptions:
        return self.aio.options

    def configure(self, **changes: Any) -> SchedulerOptions:
        return self.aio.configure(**changes)

    @property
    def registry(self) -> WarmthRegistry:
        return self.aio.registry

    def record_events(self) -> contextlib.AbstractContextManager[list[SchedulerEvent]]:
        return self.aio.record_events()

    def build(
        self,
        question: str,
        documents: Sequence[Document] = (),
        system: str | None = None,
        mode: Mode | str = Mode.BLOCK_ATTENTION,
        *,
        max_tokens: int = 64,
        budget: BudgetPolicy | str = BudgetPolicy.ERROR,
        require_documents: bool = True,
    ) -> BuiltPrompt:
        """See ``Orchestrator.build``."""
        return self.aio.build(question, documents, system, mode, max_tokens=max_tokens,
                              budget=budget, require_documents=require_documents)

    def answer(
        self,
        question: str,
        documents: Sequence[Document] = (),
        system: str | None = None,
        mode: Mode | str = Mode.BLOCK_ATTENTION,
        *,
        cache_salt: str | None = None,
        budget: BudgetPolicy | str = BudgetPolicy.ERROR,
        require_documents: bool = True,
        skip_warm: bool | None = None,
        **sampling: Any,
    ) -> Answer:
        """See ``Orchestrator.answer``."""
        return self._thread.call(self.aio.answer(
            question, documents, system, mode, cache_salt=cache_salt, budget=budget,
            require_documents=require_documents, skip_warm=skip_warm, **sampling))

    def answer_many(
        self,
        questions: Sequence[Question | str | Mapping[str, Any] | tuple[str, Sequence[Document]]],
        documents: Sequence[Document] | None = None,
        system: str | None = None,
        mode: Mode | str = Mode.BLOCK_ATTENTION,
        *,
        cache_salt: str | None = None,
        budget: BudgetPolicy | str = BudgetPolicy.ERROR,
        require_documents: bool = True,
        policy: Policy | None = None,
        skip_warm: bool | None = None,
        **sampling: Any,
    ) -> list[Answer | MinipicError]:
        """See ``Orchestrator.answer_many``."""
        return self._thread.call(self.aio.answer_many(
            questions, documents, system, mode, cache_salt=cache_salt, budget=budget,
            require_documents=require_documents, policy=policy, skip_warm=skip_warm,
            **sampling))

    def warm(
        self,
        documents: Sequence[Document],
        system: str | None = None,
        *,
        mode: Mode | str = Mode.BLOCK_ATTENTION,
        cache_salt: str | None = None,
    ) -> int:
        """See ``Orchestrator.warm``."""
        return self._thread.call(self.aio.warm(documents, system, mode=mode,
                                               cache_salt=cache_salt))

    def learn_stored_spans(self, store_dir: str | os.PathLike[str] | None = None, *,
                           fingerprint: str | None = None) -> int:
        """See ``Orchestrator.learn_stored_spans`` (run on the loop thread, which owns the
        registry)."""
        async def learn() -> int:
            return self.aio.learn_stored_spans(store_dir, fingerprint=fingerprint)

        return self._thread.call(learn())

    def check_model(self) -> ModelSupport | None:
        """``Orchestrator.check_model``: whether the engine's model is position-free."""
        return self._thread.call(self.aio.check_model())

    def reset_cache(self) -> None:
        self._thread.call(self.aio.reset_cache())

    def close(self) -> None:
        """Stop the engine (embedded) or close connections, then the loop thread."""
        if not self._closed:
            self._closed = True
            try:
                self._thread.call(self.aio.aclose())
            finally:
                self._thread.stop()

    def __enter__(self) -> SyncOrchestrator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

