"""Sparse recurrent-state checkpoints for hybrid models (docs/design.md §4).

``planner`` chooses the positions (exact DP and baselines) and scores them; ``estimator`` builds
the overlap-depth distribution from observed requests; ``cli`` is ``minipic plan``. Nothing here
imports vLLM: the planner is pure arithmetic and is usable from the client side and from tests.
"""

from minipic.checkpoint_planner.estimator import (
    OverlapHistogram,
    histogram_from_depths,
    load_histogram,
    parse_histogram,
)
from minipic.checkpoint_planner.planner import (
    METHODS,
    Plan,
    expected_recompute,
    make_plan,
    plan_checkpoints,
    suboptimality_bound,
    tv_distance,
)

__all__ = [
    "METHODS",
    "OverlapHistogram",
    "Plan",
    "expected_recompute",
    "histogram_from_depths",
    "load_histogram",
    "make_plan",
    "parse_histogram",
    "plan_checkpoints",
    "suboptimality_bound",
    "tv_distance",
]
