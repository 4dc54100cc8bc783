"""Fresh random inputs every run: the seed a test draws them from, replayable by
``MINIPIC_TEST_SEED``."""

from __future__ import annotations

import os
import random

from minipic.span_contract.env import TEST_SEED_ENV


def fresh_seed() -> int:
    """``seed``'s value, for a fixture of wider scope that draws its own inputs."""
    env = os.environ.get(TEST_SEED_ENV)
    return int(env) if env else random.SystemRandom().randrange(2**31)
