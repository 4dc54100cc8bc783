"""Fixtures of the span store's tier tests: a seeded ``rng`` (the seed printed, so a failure
replays with ``MINIPIC_TEST_SEED``) and ``logs``, the span-store logger's records."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator

import pytest
from support.store_tiers import LOGGER


@pytest.fixture
def rng(seed: int) -> random.Random:
    print(f"seed={seed}")
    return random.Random(seed)


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


@pytest.fixture
def logs() -> Iterator[Records]:
    log = logging.getLogger(LOGGER)
    handler, level = Records(), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    yield handler
    log.removeHandler(handler)
    log.setLevel(level)
