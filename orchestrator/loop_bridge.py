"""Run an orchestrator's coroutines and async iterators for any caller: sync code, or async code
on another event loop.

Why: an embedded engine is bound to the event loop of its first request, and
``SyncOrchestrator`` keeps that loop on a thread of its own. LangChain calls a runnable from
sync code (``invoke``, ``batch``, ``stream``) and from whatever loop its caller runs
(``ainvoke``, ``astream``); these helpers move the work onto the orchestrator's loop and the
results back. With an async ``Orchestrator`` the work runs on the caller's loop; from sync code
it needs a fresh loop (``asyncio.run``), which an embedded engine accepts only once — pair
embedded engines with ``SyncOrchestrator`` for sync chains.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, TypeVar

from minipic.orchestrator.errors import MinipicError
from minipic.orchestrator.sync_client import SyncOrchestrator

T = TypeVar("T")
_ITEM, _ERROR, _DONE = "item", "error", "done"


def check_orchestrator(value: Any) -> Any:
    """A framework component's ``orchestrator`` field: an ``Orchestrator`` or a
    ``SyncOrchestrator``, nothing else (pydantic validators of both integrations call it)."""
    from minipic.orchestrator.client import Orchestrator

    if not isinstance(value, (Orchestrator, SyncOrchestrator)):
        raise TypeError(f"orchestrator must be an Orchestrator or SyncOrchestrator, got "
                        f"{type(value).__name__}")
    return value


def async_side(orc: Any) -> Any:
    """The async ``Orchestrator`` behind ``orc`` (itself, or a ``SyncOrchestrator``'s)."""
    return orc.aio if isinstance(orc, SyncOrchestrator) else orc


def _no_running_loop(what: str) -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise MinipicError(f"sync {what} inside a running event loop: use the async method "
                       "(ainvoke, abatch, astream), or give the runnable a SyncOrchestrator")


def run_sync(orc: Any, coro: Coroutine[Any, Any, T]) -> T:
    if isinstance(orc, SyncOrchestrator):
        return orc.submit(coro).result()
    try:
        _no_running_loop("invoke/batch")
    except MinipicError:
        coro.close()
        raise
    return asyncio.run(coro)


async def run_async(orc: Any, coro: Coroutine[Any, Any, T]) -> T:
    if isinstance(orc, SyncOrchestrator):
        return await asyncio.wrap_future(orc.submit(coro))
    return await coro


async def _pump(make: Callable[[], AsyncIterator[T]], put: Callable[[str, Any], None]) -> None:
    """Drain the iterator on the orchestrator's loop into ``put``; always ends with one
    ``_DONE`` or ``_ERROR``."""
    items = make()
    try:
        async for item in items:
            put(_ITEM, item)
    except BaseException as exc:  # handed to the consumer, which re-raises it
        put(_ERROR, exc)
        if not isinstance(exc, Exception):
            raise
    else:
        put(_DONE, None)
    finally:
        await items.aclose()


def iterate_sync(orc: Any, make: Callable[[], AsyncIterator[T]]) -> Iterator[T]:
    """Iterate ``make()`` (an async iterator) from sync code. Stopping early cancels it."""
    if not isinstance(orc, SyncOrchestrator):
        _no_running_loop("stream")
        yield from _iterate_on_fresh_loop(make)
        return
    inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
    future = orc.submit(_pump(make, lambda kind, value: inbox.put((kind, value))))
    try:
        while True:
            kind, value = inbox.get()
            if kind == _ITEM:
                yield value
            elif kind == _ERROR:
                raise value
            else:
                return
    finally:
        future.cancel()  # no-op once it finished


def _iterate_on_fresh_loop(make: Callable[[], AsyncIterator[T]]) -> Iterator[T]:
    loop = asyncio.new_event_loop()
    items = make()
    try:
        while True:
            try:
                yield loop.run_until_complete(anext(items))
            except StopAsyncIteration:
                return
    finally:
        loop.run_until_complete(items.aclose())
        loop.close()


async def iterate_async(orc: Any, make: Callable[[], AsyncIterator[T]]) -> AsyncIterator[T]:
    """Iterate ``make()`` from the caller's event loop, on the orchestrator's loop if it has
    one of its own. Stopping early cancels it."""
    if not isinstance(orc, SyncOrchestrator):
        items = make()
        try:
            async for item in items:
                yield item
        finally:
            await items.aclose()
        return
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    future = orc.submit(_pump(make, lambda kind, value: loop.call_soon_threadsafe(
        inbox.put_nowait, (kind, value))))
    try:
        while True:
            kind, value = await inbox.get()
            if kind == _ITEM:
                yield value
            elif kind == _ERROR:
                raise value
            else:
                return
    finally:
        future.cancel()
