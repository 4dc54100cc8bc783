"""A real backend with a record of every request's token ids (what the scheduler sent)."""

from __future__ import annotations

from typing import Any


class CountingBackend:
    """Wraps a real backend; ``calls`` lists the token ids of every request sent through it.

    ``owns_inner``: close the wrapped backend on ``aclose`` (False when a fixture owns it).
    """

    def __init__(self, inner: Any, *, owns_inner: bool = False) -> None:
        self.inner = inner
        self.info = inner.info
        self.owns_inner = owns_inner
        self.calls: list[tuple[int, ...]] = []
        self.health_checks = 0  # GET /health probes the orchestrator's circuit sent

    def __getattr__(self, name: str) -> Any:
        """Anything else the inner backend offers (``check_config``, ``kv_usage``, ...)."""
        if name == "inner":  # not set yet (copy/pickle): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    async def generate(self, token_ids, **kwargs):
        self.calls.append(tuple(token_ids))
        return await self.inner.generate(token_ids, **kwargs)

    async def health(self) -> bool:
        self.health_checks += 1
        inner = getattr(self.inner, "health", None)
        return True if inner is None else await inner()

    async def reset_cache(self) -> None:
        await self.inner.reset_cache()

    async def aclose(self) -> None:
        if self.owns_inner:
            await self.inner.aclose()
