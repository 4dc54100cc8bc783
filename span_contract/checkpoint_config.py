"""Server-level settings of the sparse recurrent-checkpoint feature (``ckpt``).

Part of the client-engine contract: ``minipic serve`` and the embedded engine build it, the
EngineCore reads it (``engine_ext/recurrent/policy.py``). Validation uses the planner's own
method names and histogram formats (``checkpoint_planner``, pure arithmetic below this package).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from minipic.span_contract.span_config import CKPT_CONFIG_ENV


class CheckpointConfig(BaseModel):
    """Server-level checkpoint settings (travels to the EngineCore as ``MINIPIC_CKPT_CONFIG``)."""

    model_config = ConfigDict(frozen=True)

    budget: int = Field(4, ge=0, description="M: recurrent-state checkpoints kept per prefix")
    method: str = Field("dp", description="planner method (checkpoint_planner.METHODS)")
    histogram: list[float] | None = Field(
        None, description="overlap-depth probabilities or counts for depths 0..N")
    histogram_file: str | None = Field(
        None, description="histogram file in a `minipic plan --histogram` format")
    learn: bool = Field(False, description="re-plan from overlap depths observed by the engine")
    half_life: float | None = Field(
        None, gt=0, description="learn: weight halves every half_life requests (drift)")
    replan_every: int = Field(16, gt=0, description="learn: re-plan after this many requests")
    keep_tail: bool = Field(
        False,
        description="also keep vLLM's own checkpoints (prompt tail, shared-prefix junction); "
                    "off = state is kept at planned positions only")

    @field_validator("method")
    @classmethod
    def _known_method(cls, value: str) -> str:
        from minipic.checkpoint_planner import METHODS

        if value not in METHODS:
            raise ValueError(f"unknown planner method {value!r}; choose one of {METHODS}")
        return value

    @model_validator(mode="after")
    def _one_histogram(self) -> CheckpointConfig:
        if self.histogram is not None and self.histogram_file is not None:
            raise ValueError("give either histogram or histogram_file, not both")
        if self.histogram is not None:
            from minipic.checkpoint_planner import parse_histogram

            parse_histogram(list(self.histogram))  # fail here, not in the engine process
        return self

    def prior(self) -> np.ndarray | None:
        """The configured histogram as probabilities, or None (uniform prior)."""
        from minipic.checkpoint_planner import load_histogram, parse_histogram

        if self.histogram is not None:
            return parse_histogram(list(self.histogram))
        if self.histogram_file is not None:
            return load_histogram(self.histogram_file)
        return None

    def to_env(self) -> dict[str, str]:
        return {CKPT_CONFIG_ENV: self.model_dump_json()}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> CheckpointConfig:
        """The configuration in ``MINIPIC_CKPT_CONFIG``; defaults when unset."""
        env = os.environ if environ is None else environ
        raw = env.get(CKPT_CONFIG_ENV)
        return cls.model_validate(json.loads(raw)) if raw else cls()
