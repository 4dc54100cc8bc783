"""Estimating the overlap-depth distribution from observed requests.

The planner needs ``p_t``, which nobody knows; we see depths of past requests. The empirical
histogram is the natural estimate, and a plan made from it is within ``2 N TV(p, p_hat)`` of the
optimum (``planner.suboptimality_bound``). When traffic drifts, old observations bias the estimate
for ever, so ``OverlapHistogram`` can instead weight an observation ``k`` arrivals old by
``2 ** (-k / half_life)``: a smaller TV to the *current* distribution at the price of more noise.

This module also reads the histogram files that ``minipic plan --histogram FILE`` accepts (see
``parse_histogram``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from minipic.checkpoint_planner.planner import Plan, make_plan

# Rescale the lazily-growing weights before they can overflow float64.
_RESCALE_AT = 1e100


class OverlapHistogram:
    """Weighted histogram of overlap depths ``0..n``.

    Exponential weighting is done lazily: instead of multiplying every bin by the decay on each
    observation (O(n) per request), new observations are added with a weight that grows by
    ``2 ** (1 / half_life)`` per arrival and the bins are renormalised only when that weight gets
    large. ``probs()`` is the same either way.
    """

    def __init__(self, n: int, half_life: float | None = None) -> None:
        if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
            raise ValueError(f"n (prefix length) must be an integer >= 1, got {n!r}")
        if half_life is not None and not (math.isfinite(half_life) and half_life > 0):
            raise ValueError(f"half_life must be a positive number of observations or None, "
                             f"got {half_life!r}")
        self.n = int(n)
        self.half_life = None if half_life is None else float(half_life)
        self._growth = 1.0 if half_life is None else 2.0 ** (1.0 / half_life)
        self._weights = np.zeros(self.n + 1, dtype=np.float64)
        self._scale = 1.0  # weight the next observation gets
        self.count = 0

    def _check_depths(self, depths: np.ndarray) -> None:
        if depths.size and (depths.min() < 0 or depths.max() > self.n):
            bad = int(depths.min()) if depths.min() < 0 else int(depths.max())
            raise ValueError(f"overlap depth {bad} is outside 0..n = 0..{self.n}")

    def observe(self, depth: int) -> None:
        """Record one request that reused the prefix to ``depth`` tokens."""
        if isinstance(depth, bool) or not isinstance(depth, int | np.integer):
            raise ValueError(f"depth must be an integer, got {depth!r}")
        self._check_depths(np.asarray([depth]))
        self._weights[depth] += self._scale
        self._advance(1)

    def observe_many(self, depths: Iterable[int]) -> None:
        """Record depths in arrival order (vectorised; same result as repeated ``observe``)."""
        d = np.asarray(list(depths) if not isinstance(depths, np.ndarray) else depths)
        if d.size == 0:
            return
        if not np.issubdtype(d.dtype, np.integer):
            raise ValueError(f"depths must be integers, got dtype {d.dtype}")
        d = d.astype(np.int64).ravel()
        self._check_depths(d)
        # chunks short enough that growth**chunk stays far below overflow
        chunk = d.size if self._growth == 1.0 else max(1, int(60 / math.log10(self._growth)))
        for start in range(0, d.size, chunk):
            part = d[start:start + chunk]
            w = self._scale * self._growth ** np.arange(part.size, dtype=np.float64)
            self._weights += np.bincount(part, weights=w, minlength=self.n + 1)
            self._advance(part.size)

    def _advance(self, k: int) -> None:
        self.count += k
        if self._growth == 1.0:
            return
        self._scale *= self._growth**k
        if self._scale > _RESCALE_AT:
            self._weights /= self._scale
            self._scale = 1.0

    def probs(self) -> np.ndarray:
        """The estimated distribution (length n+1, sums to 1); error before any observation."""
        total = self._weights.sum()
        if self.count == 0 or total <= 0:
            raise ValueError("histogram has no observations yet")
        p = self._weights / total
        return p / p.sum()  # second pass trims rounding so the planner's sum check holds

    def plan(
        self,
        budget: int,
        method: str = "dp",
        granularity: int = 1,
        reference: np.ndarray | None = None,
    ) -> Plan:
        """Plan on this estimate; with ``reference`` the plan carries ``2 N TV`` to it."""
        return make_plan(self.probs(), budget, method, granularity, reference)


def histogram_from_depths(
    depths: Iterable[int], n: int, half_life: float | None = None
) -> np.ndarray:
    """Probabilities from raw depths in arrival order (empirical, or exponentially weighted)."""
    h = OverlapHistogram(n, half_life)
    h.observe_many(depths)
    return h.probs()


def parse_histogram(obj: Any) -> np.ndarray:
    """Turn a decoded histogram file into probabilities over depths ``0..N``.

    Accepted shapes:

    * a JSON list of N+1 non-negative numbers, index = depth. All integers: counts, normalised.
      Otherwise they must already sum to 1 (within 1e-6; renormalised exactly).
    * ``{"depths": [d1, d2, ...], "n": N}``: observed depths in arrival order, each in 0..N;
      optional ``"half_life"`` (observations) for an exponentially weighted estimate.
    """
    if isinstance(obj, list):
        return _parse_list(obj)
    if isinstance(obj, dict):
        return _parse_depths(obj)
    raise ValueError(
        "histogram must be a JSON list of probabilities/counts or an object "
        f'{{"depths": [...], "n": N}}; got {type(obj).__name__}'
    )


def _parse_list(values: list[Any]) -> np.ndarray:
    if len(values) < 2:
        raise ValueError(f"histogram list needs N+1 >= 2 entries (depths 0..N), got {len(values)}")
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        raise ValueError("histogram list entries must all be numbers")
    a = np.asarray(values, dtype=np.float64)
    if not np.isfinite(a).all():
        raise ValueError("histogram list contains NaN or infinity")
    if (a < 0).any():
        t = int(np.flatnonzero(a < 0)[0])
        raise ValueError(f"histogram list entry for depth {t} is negative ({a[t]!r})")
    total = math.fsum(a.tolist())
    if total <= 0:
        raise ValueError("histogram list sums to 0: no observations")
    is_counts = all(float(v).is_integer() for v in values)
    if not is_counts and abs(total - 1.0) > 1e-6:
        raise ValueError(
            f"histogram list sums to {total!r}: neither probabilities (sum 1) nor counts "
            "(all integers)"
        )
    p = a / total
    return p / p.sum()


def _parse_depths(obj: dict[str, Any]) -> np.ndarray:
    unknown = set(obj) - {"depths", "n", "half_life"}
    if unknown or "depths" not in obj or "n" not in obj:
        raise ValueError(
            'histogram object must have keys "depths" and "n" (optional "half_life"); '
            f"got keys {sorted(obj)}"
        )
    n, depths, half_life = obj["n"], obj["depths"], obj.get("half_life")
    if isinstance(n, bool) or not isinstance(n, int):
        raise ValueError(f'"n" must be an integer, got {n!r}')
    if not isinstance(depths, list) or not depths:
        raise ValueError('"depths" must be a non-empty list of integer depths')
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in depths):
        raise ValueError('"depths" entries must all be integers')
    if half_life is not None and (isinstance(half_life, bool)
                                  or not isinstance(half_life, int | float)):
        raise ValueError(f'"half_life" must be a number, got {half_life!r}')
    return histogram_from_depths(np.asarray(depths, dtype=np.int64), n, half_life)


def load_histogram(path: str | Path) -> np.ndarray:
    """Read and parse a histogram file (format: ``parse_histogram``)."""
    try:
        obj = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror})") from None
    try:
        return parse_histogram(obj)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
