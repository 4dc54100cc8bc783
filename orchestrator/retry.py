"""When to try an engine request again, and how long to wait first.

Retried: errors marked ``retryable`` (connection refused or dropped, 5xx) — the engine may be
restarting, and vLLM on CPU takes tens of seconds to come back, so the default budget is time
(``give_up_after_s``) as much as attempts. Not retried: bad requests (they fail the same way
again) and timeouts (the engine is busy; resending adds load).

The budget is per question (``RetryBudget``): its clock starts at that question's first failure,
or when it first finds the engine down — not when its batch started, so a question that fails an
hour into ``answer_many`` gets the same retries as the first one. The waiting itself is shared:
``orchestrator.circuit`` backs off (exponential with jitter, per orchestrator) and probes
the engine's health once for every question waiting.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field


class RetryPolicy(BaseModel):
    model_config = ConfigDict(frozen=True)

    max_attempts: int = Field(6, ge=1, description="tries per question, the first included "
                              "(its sends, and health probes that failed while it waited)")
    backoff_s: float = Field(0.5, ge=0, description="wait before the first health probe")
    max_backoff_s: float = Field(10.0, ge=0, description="cap on one wait")
    give_up_after_s: float = Field(60.0, ge=0, description="no new attempt after this long "
                                   "(from the question's first failure)")

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before attempt number ``attempt + 1`` (``attempt`` >= 1 failed)."""
        cap = min(self.max_backoff_s, self.backoff_s * 2 ** min(attempt - 1, 64))
        return (rng or random).uniform(cap / 2, cap)

    def should_retry(self, attempt: int, elapsed_s: float) -> bool:
        return attempt < self.max_attempts and elapsed_s < self.give_up_after_s


NO_RETRY = RetryPolicy(max_attempts=1)


@dataclass
class RetryBudget:
    """One question's retries: failures so far, and since when it has been failing."""

    policy: RetryPolicy
    failures: int = 0
    since: float | None = None  # time.monotonic() of the first failure or wait for the engine

    def deadline(self) -> float:
        """When this question stops waiting for the engine (starts the clock if not running)."""
        if self.since is None:
            self.since = time.monotonic()
        return self.since + self.policy.give_up_after_s

    def failed(self) -> bool:
        """Count one failed attempt; True when another one is allowed."""
        self.failures += 1
        if self.since is None:
            self.since = time.monotonic()
        return self.policy.should_retry(self.failures, time.monotonic() - self.since)
