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

    async def generate(self, token_ids, **kwargs):
        self.calls.append(tuple(token_ids))
        return await self.inner.generate(token_ids, **kwargs)

    async def reset_cache(self) -> None:
        await self.inner.reset_cache()

    async def aclose(self) -> None:
        if self.owns_inner:
            await self.inner.aclose()
