"""Where a hybrid model's recurrent-state checkpoints go: the server plan and per-request overrides.

vLLM's "align" prefix caching for hybrid (attention + Mamba/GDN) models can only resume a request
from a recurrent state that was materialised at a block boundary and kept in the prefix cache.
Keeping one at every block costs far more memory than the attention KV it sits next to (one GDN
state is ``heads × d_k × d_v`` floats per layer, whatever the block length), so docs/design.md §4
keeps only ``M`` of them per prefix, at the positions the planner (``checkpoint_planner``) chooses
for the observed overlap-depth distribution. This module decides, for each request, *which*
positions; ``engine_ext.recurrent.checkpoints`` makes vLLM compute and keep state exactly there.

Sources of the plan, in order of precedence:

1. **Per request** — ``SamplingParams(extra_args={"minipic_checkpoints": ...})``, or the OpenAI
   field ``vllm_xargs`` on ``/v1/completions``. A list of token positions (floored to the engine's
   recurrent block size), ``"all"`` (every block, i.e. vLLM align caching with dense retention),
   ``"vllm"`` (leave this request to stock vLLM retention) or ``"server"``.
2. **Server plan** — ``plan_checkpoints(p, budget, method, granularity=block size)`` where ``p``
   is a configured histogram (inline or a file, ``minipic plan`` formats), or, with ``learn``,
   the histogram of overlap depths observed by this engine (``OverlapHistogram``, optionally
   exponentially weighted), re-planned every ``replan_every`` requests. Before anything is known
   the prior is uniform over ``0..max_model_len``, for which balanced spacing is optimal.

Nothing here imports vLLM, so the policy is testable without an engine and usable client-side.
The planner (numba) is imported lazily: this module is loaded by the plugin in every vLLM process,
and importing numba/llvmlite into a CPU *worker* breaks vLLM's Triton kernel rebinding there
(``triton_utils/dispatcher.py`` trips over an llvmlite object).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from minipic.span_contract.checkpoint_config import CheckpointConfig

logger = logging.getLogger("minipic.ckpt")

OVERRIDE_KEY = "minipic_checkpoints"
# Values of OVERRIDE_KEY that are not position lists.
STOCK = "vllm"
EVERY_BLOCK = "all"
SERVER = "server"


# --------------------------------------------------------------------------------------------
# per-request overrides

Override = tuple[int, ...] | Literal["vllm", "all", "server"]


def parse_override(value: Any) -> Override:
    """Validate the value of ``extra_args["minipic_checkpoints"]``; raises ``ValueError``.

    Called in the front-end (so a bad value is a 400, not a crashed engine) and again in the
    EngineCore, where the value is trusted to parse.
    """
    if value is None:
        return SERVER
    if isinstance(value, str):
        if value in (STOCK, EVERY_BLOCK, SERVER):
            return value  # type: ignore[return-value]
        raise ValueError(f"{OVERRIDE_KEY} must be a list of token positions or one of "
                         f"{STOCK!r}, {EVERY_BLOCK!r}, {SERVER!r}; got {value!r}")
    if isinstance(value, list | tuple):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ValueError(f"{OVERRIDE_KEY} positions must be integers, got {value!r}")
        if any(v < 0 for v in value):
            raise ValueError(f"{OVERRIDE_KEY} positions must be >= 0, got {value!r}")
        return tuple(sorted(set(value)))
    raise ValueError(f"{OVERRIDE_KEY} must be a list of token positions or a string, "
                     f"got {type(value).__name__}")


def override_of(sampling_params: Any) -> Override:
    """The override a request carries (``SERVER`` when it carries none)."""
    extra = getattr(sampling_params, "extra_args", None) or {}
    return parse_override(extra.get(OVERRIDE_KEY))


@dataclass(frozen=True)
class RequestPlan:
    """Checkpoint positions for one request (multiples of the recurrent block size).

    ``strict``: keep state at these positions only — vLLM's own prompt-tail and shared-prefix
    junction checkpoints are dropped (``keep_tail=False``).
    """

    positions: tuple[int, ...]
    strict: bool
    source: str


# --------------------------------------------------------------------------------------------
# the server policy


class CheckpointPolicy:
    """Resolves each request's plan; learns the overlap distribution when configured to.

    One instance lives in the EngineCore process next to the scheduler. ``block_size`` is the
    engine's recurrent (Mamba/GDN) block size — in align mode the enlarged attention block size —
    and every position it hands out is a multiple of it, because vLLM can only materialise state
    at block boundaries.
    """

    def __init__(self, config: CheckpointConfig, block_size: int, max_model_len: int) -> None:
        from minipic.checkpoint_planner import OverlapHistogram

        if block_size < 1 or max_model_len < 1:
            raise ValueError(f"bad block_size {block_size} / max_model_len {max_model_len}")
        self.config = config
        self.block_size = int(block_size)
        self.max_model_len = int(max_model_len)
        self.every_block = tuple(range(self.block_size, self.max_model_len + 1, self.block_size))
        self.learner = (OverlapHistogram(self.max_model_len, config.half_life)
                        if config.learn else None)
        self.num_replans = 0
        self._since_replan = 0
        prior = config.prior()
        if prior is None:
            prior = np.full(self.max_model_len + 1, 1.0 / (self.max_model_len + 1))
            self.plan_source = "uniform prior"
        else:
            self.plan_source = "histogram file" if config.histogram_file else "histogram"
        self.server_plan = self._plan(prior)

    def _plan(self, probs: np.ndarray) -> tuple[int, ...]:
        from minipic.checkpoint_planner import plan_checkpoints

        if probs.size - 1 < self.block_size:
            logger.warning("checkpoint histogram covers depths 0..%d, shorter than one recurrent "
                           "block (%d tokens): no checkpoint can help", probs.size - 1,
                           self.block_size)
            return ()
        return tuple(plan_checkpoints(probs, self.config.budget, self.config.method,
                                      self.block_size))

    def observe(self, depth: int) -> None:
        """Record a request's overlap depth (its longest cached prefix in the dense attention KV);
        re-plan every ``replan_every`` observations when learning."""
        if self.learner is None:
            return
        self.learner.observe(int(min(max(depth, 0), self.max_model_len)))
        self._since_replan += 1
        if self._since_replan >= self.config.replan_every:
            self.replan()

    def replan(self) -> tuple[int, ...]:
        """Re-plan from what was learned so far (no-op without observations)."""
        if self.learner is None or self.learner.count == 0:
            return self.server_plan
        self.server_plan = self._plan(self.learner.probs())
        self.plan_source = "learned"
        self.num_replans += 1
        self._since_replan = 0
        logger.info("minipic ckpt: re-planned from %d observed depths -> %s",
                    self.learner.count, list(self.server_plan))
        return self.server_plan

    def resolve(self, override: Override) -> RequestPlan | None:
        """The plan for a request with this override; None = stock vLLM behaviour."""
        strict = not self.config.keep_tail
        if override == STOCK:
            return None
        if override == EVERY_BLOCK:
            return RequestPlan(self.every_block, strict, "all")
        if override == SERVER:
            return RequestPlan(self.server_plan, strict, "server")
        g = self.block_size
        floored = tuple(sorted({p // g * g for p in override if p >= g}))
        return RequestPlan(floored, strict, "request")

    def stats(self) -> dict[str, Any]:
        return {
            "config": self.config.model_dump(exclude={"histogram"}),
            "histogram_depths": (None if self.config.histogram is None
                                 else len(self.config.histogram) - 1),
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "server_plan": list(self.server_plan),
            "plan_source": self.plan_source,
            "observations": 0 if self.learner is None else self.learner.count,
            "replans": self.num_replans,
        }


def positions_in(plan: Sequence[int], lo: int, hi: int) -> list[int]:
    """Planned positions ``p`` with ``lo < p < hi`` (plan sorted)."""
    i = bisect.bisect_right(plan, lo)
    j = bisect.bisect_left(plan, hi)
    return list(plan[i:j])
