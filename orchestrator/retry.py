"""When to try an engine request again, and how long to wait first.

Retried: errors marked ``retryable`` (connection refused or dropped, 5xx) — the engine may be
restarting, and vLLM on CPU takes tens of seconds to come back, so the default budget is time
(``give_up_after_s``) as much as attempts. Not retried: bad requests (they fail the same way
again) and timeouts (the engine is busy; resending adds load). Backoff is exponential with full
jitter so a batch of requests that failed together does not return together.
"""

from __future__ import annotations

import random

from pydantic import BaseModel, ConfigDict, Field


class RetryPolicy(BaseModel):
    model_config = ConfigDict(frozen=True)

    max_attempts: int = Field(6, ge=1, description="tries per request, the first included")
    backoff_s: float = Field(0.5, ge=0, description="wait before the first retry")
    max_backoff_s: float = Field(10.0, ge=0, description="cap on one wait")
    give_up_after_s: float = Field(60.0, ge=0, description="no new attempt after this long")

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before attempt number ``attempt + 1`` (``attempt`` >= 1 failed)."""
        cap = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
        return (rng or random).uniform(cap / 2, cap)

    def should_retry(self, attempt: int, elapsed_s: float) -> bool:
        return attempt < self.max_attempts and elapsed_s < self.give_up_after_s


NO_RETRY = RetryPolicy(max_attempts=1)
