"""Names the span store's tier tests share: the store's logger, a handler that keeps its
records, and fresh random entry keys (the ``rng`` and ``logs`` fixtures: tests/conftest.py)."""

from __future__ import annotations

import logging
import random

LOGGER = "vllm.minipic.span_store"


def key_for(rng: random.Random, prefix: str | None = None) -> str:
    """A fresh entry key (64 hex digits); ``prefix`` replaces its first characters (a shard)."""
    key = rng.randbytes(32).hex()
    return key if prefix is None else prefix + key[len(prefix):]


class Records(logging.Handler):
    """Records of the span-store logger, attached to it directly (vLLM, once imported, stops
    ``vllm.*`` records from reaching the root logger, where caplog listens)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def warnings(self, needle: str = "") -> list[str]:
        return [r.getMessage() for r in self.records
                if r.levelno >= logging.WARNING and needle in r.getMessage()]
