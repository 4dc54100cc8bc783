"""Where to store recurrent-state checkpoints along one cached prefix (docs/design.md §4).

A hybrid model's recurrent layers can resume from any stored state ``h_c`` and recompute the
suffix exactly, but each stored state costs ``d_head**2`` per head, so only ``M`` of the ``N``
prefix positions can hold one. A future request that overlaps the prefix to depth ``t`` resumes
from the deepest checkpoint ``l(t; C) = max({0} ∪ {c ∈ C : c <= t})`` and recomputes
``r(t; C) = t - l(t; C)`` tokens. Given the overlap-depth distribution ``p_t`` (t = 0..N) we choose
``C`` to minimise ``E[r(T; C)]``.

Methods
-------
``dp``
    The exact optimum (a one-sided weighted k-median on a line), O(K·M) time with K candidate
    positions, via the monotone convex-hull trick. Returns exactly ``min(budget, K)`` positions:
    adding a checkpoint never increases the cost, so an optimum of that size always exists.
``balanced``
    Equal spacing ``c_k = floor(k (N+1) / ((M+1) g)) · g`` — optimal for uniform ``p`` (and the
    worst case) when ``g = 1``, since it splits the ``N+1`` depths into ``M+1`` runs of lengths
    that differ by at most one.
``block``
    vLLM's hybrid "align" caching: a checkpoint at every multiple of ``g``. When the budget is
    smaller than the number of blocks, the *first* ``M`` blocks are kept — a prefill that fills
    slots in order and stops when they run out. (With ``g = 1`` this is positions ``1..M``.)
``log``
    Geometric spacing over candidate indices, ``i_k ≈ K^(k/M)``: dense near the start, always
    ending at the deepest candidate.
``sqrt``
    Classic sqrt(L) checkpointing: spacing ``≈ sqrt(N)`` (rounded to a multiple of ``g``, at least
    ``g``), first ``M`` of them when the budget is smaller.

Every method returns sorted, distinct positions that are multiples of ``g`` in ``1..N`` and never
more than ``budget`` of them; ``budget >= K`` returns every candidate for ``dp`` and ``balanced``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

import numba
import numpy as np

METHODS: tuple[str, ...] = ("dp", "balanced", "block", "log", "sqrt")
PROB_SUM_TOL = 1e-9
# Cap on the DP's back-pointer table (int32 entries): 2**27 entries = 512 MiB.
MAX_DP_TABLE = 2**27


# --------------------------------------------------------------------------------------------
# validation


def validate_probs(probs: Sequence[float] | np.ndarray) -> np.ndarray:
    """Return ``probs`` as a float64 vector of length N+1 (N >= 1), or raise ``ValueError``.

    The planner treats ``probs`` as an exact distribution (costs are compared across methods), so
    a vector that does not sum to one is refused rather than silently renormalised.
    """
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 1:
        raise ValueError(f"probs must be a 1-D vector, got shape {p.shape}")
    if p.size < 2:
        raise ValueError(f"probs must have length N+1 >= 2 (depths 0..N), got length {p.size}")
    if np.isnan(p).any():
        raise ValueError(f"probs contains NaN at depth {int(np.flatnonzero(np.isnan(p))[0])}")
    if not np.isfinite(p).all():
        raise ValueError(f"probs contains inf at depth {int(np.flatnonzero(~np.isfinite(p))[0])}")
    if (p < 0).any():
        t = int(np.flatnonzero(p < 0)[0])
        raise ValueError(f"probs must be non-negative; probs[{t}] = {p[t]!r}")
    total = math.fsum(p.tolist())
    if abs(total - 1.0) > PROB_SUM_TOL:
        raise ValueError(f"probs must sum to 1 within {PROB_SUM_TOL:g}; they sum to {total!r}")
    return p


def _validate_budget(budget: int) -> int:
    if isinstance(budget, bool) or not isinstance(budget, int | np.integer):
        raise ValueError(f"budget must be an integer, got {budget!r}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    return int(budget)


def _validate_granularity(granularity: int, n: int) -> int:
    if isinstance(granularity, bool) or not isinstance(granularity, int | np.integer):
        raise ValueError(f"granularity must be an integer, got {granularity!r}")
    if granularity < 1:
        raise ValueError(f"granularity must be >= 1, got {granularity}")
    if granularity > n:
        raise ValueError(f"granularity {granularity} is larger than the prefix length N = {n}")
    return int(granularity)


def _validate_positions(positions: Iterable[int], n: int) -> np.ndarray:
    c = np.asarray(sorted(int(x) for x in positions), dtype=np.int64)
    if c.size and (c[0] < 1 or c[-1] > n):
        bad = int(c[0]) if c[0] < 1 else int(c[-1])
        raise ValueError(f"checkpoint position {bad} is outside 1..N = 1..{n}")
    return c


# --------------------------------------------------------------------------------------------
# cost


def expected_recompute(probs: Sequence[float] | np.ndarray, positions: Iterable[int]) -> float:
    """``E[r(T; C)] = sum_t p_t (t - l(t; C))`` — computed directly, not from DP values.

    Evaluating the plan from scratch is what makes the DP's answer checkable: the DP's own running
    minimum suffers cancellation between terms of size ~N, this sum does not.
    """
    p = validate_probs(probs)
    n = p.size - 1
    c = np.concatenate(([0], _validate_positions(positions, n)))
    t = np.arange(n + 1, dtype=np.int64)
    deepest = c[np.searchsorted(c, t, side="right") - 1]
    return float(np.dot(p, (t - deepest).astype(np.float64)))


def tv_distance(p: Sequence[float] | np.ndarray, q: Sequence[float] | np.ndarray) -> float:
    """Total variation distance ``½ Σ |p_t - q_t|`` between two depth distributions."""
    a, b = validate_probs(p), validate_probs(q)
    if a.size != b.size:
        raise ValueError(f"distributions have different lengths: {a.size} and {b.size}")
    return 0.5 * float(np.abs(a - b).sum())


def suboptimality_bound(p: Sequence[float] | np.ndarray, q: Sequence[float] | np.ndarray) -> float:
    """``2 N TV(p, q)``: how much worse, on ``p``, a plan optimised for ``q`` can be.

    Since ``0 <= r <= N``, any plan's cost moves by at most ``N·TV`` between ``p`` and ``q``; apply
    that once to the q-optimal plan and once to the p-optimal plan.
    """
    return 2.0 * (len(p) - 1) * tv_distance(p, q)


# --------------------------------------------------------------------------------------------
# exact DP


@numba.njit(cache=False)
def _dp_layers(p1, t1, cand, ends, budget):  # pragma: no cover - compiled
    """Exactly ``budget`` checkpoints among ``cand`` (1 <= budget < len(cand)).

    ``p1[k] = Σ_{t<k} p_t`` and ``t1[k] = Σ_{t<k} t·p_t`` (length N+2). Candidate ``i`` (1-based)
    is position ``cand[i-1]``; ``ends[j]`` is the last depth served before candidate ``j+1`` takes
    over (``ends[K] = N``). ``f_m[j]`` = least cost of depths ``0..ends[j]`` with ``m``
    checkpoints among the first ``j`` candidates; ``f_0[j] = t1[ends[j]+1]`` and

        f_m[j] = min_{m<=i<=j} f_{m-1}[i-1] + w(cand[i-1], ends[j]),
        w(s, e) = (T[e] - T[s-1]) - s (P[e] - P[s-1]),

    i.e. a line of slope ``-s`` and intercept ``f_{m-1}[i-1] - T[s-1] + s P[s-1]`` evaluated at
    ``x = P[e]`` (plus ``T[e]``). Lines arrive with decreasing slopes and queries with
    non-decreasing ``x``, so a deque-shaped lower hull with a forward pointer answers each layer
    in O(K). Layer ``m`` only visits ``j <= K - (budget - m)`` (later checkpoints need room).

    Ties: the pointer advances only on a strict improvement and a hull line that is never
    strictly below both neighbours is dropped, so when two choices compare *equal in float64* at
    a step the smaller checkpoint is kept. Choices that tie mathematically but differ by rounding
    are not distinguished; the result is deterministic, not the lexicographically first optimum.
    """
    k_total = cand.shape[0]
    width = k_total - budget + 1
    prev = np.empty(k_total + 1)
    for j in range(k_total + 1):
        prev[j] = t1[ends[j] + 1]
    cur = np.empty(k_total + 1)
    choice = np.empty((budget, width), dtype=np.int32)
    slope = np.empty(width)
    icept = np.empty(width)
    owner = np.empty(width, dtype=np.int32)
    for m in range(1, budget + 1):
        head = 0
        tail = 0
        hi = k_total - (budget - m)
        for j in range(m, hi + 1):
            s = cand[j - 1]
            ks = -float(s)
            bs = prev[j - 1] - t1[s] + s * p1[s]
            while tail - head >= 2:
                k1 = slope[tail - 2]
                b1 = icept[tail - 2]
                k2 = slope[tail - 1]
                b2 = icept[tail - 1]
                # middle line useless iff x(1,new) <= x(1,2); denominators k1-k2, k1-ks > 0
                if (bs - b1) * (k1 - k2) <= (b2 - b1) * (k1 - ks):
                    tail -= 1
                else:
                    break
            slope[tail] = ks
            icept[tail] = bs
            owner[tail] = j
            tail += 1
            x = p1[ends[j] + 1]
            while tail - head >= 2 and (
                slope[head + 1] * x + icept[head + 1] < slope[head] * x + icept[head]
            ):
                head += 1
            cur[j] = slope[head] * x + icept[head] + t1[ends[j] + 1]
            choice[m - 1, j - m] = owner[head]
        prev, cur = cur, prev
    picked = np.empty(budget, dtype=np.int64)
    j = k_total
    for m in range(budget, 0, -1):
        i = choice[m - 1, j - m]
        picked[m - 1] = cand[i - 1]
        j = i - 1
    return picked


def _prefix_sums(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    t = np.arange(p.size, dtype=np.float64)
    p1 = np.concatenate(([0.0], np.cumsum(p)))
    t1 = np.concatenate(([0.0], np.cumsum(t * p)))
    return p1, t1


def _plan_dp(p: np.ndarray, budget: int, g: int) -> list[int]:
    n = p.size - 1
    cand = np.arange(g, n + 1, g, dtype=np.int64)
    k = cand.size
    if budget >= k:
        return cand.tolist()
    if budget * (k - budget + 1) > MAX_DP_TABLE:
        raise ValueError(
            f"dp back-pointer table for budget {budget} and {k} candidates exceeds "
            f"{MAX_DP_TABLE} entries; raise granularity or lower the budget"
        )
    ends = np.concatenate((cand - 1, [n])).astype(np.int64)
    p1, t1 = _prefix_sums(p)
    return _dp_layers(p1, t1, cand, ends, budget).tolist()


# --------------------------------------------------------------------------------------------
# baselines


def _plan_balanced(p: np.ndarray, budget: int, g: int) -> list[int]:
    n = p.size - 1
    k = n // g
    if budget >= k:
        return list(range(g, k * g + 1, g))
    # (M+1) g < N+1 here, so consecutive indices differ by >= 1 and the first is >= 1.
    return [(i * (n + 1)) // ((budget + 1) * g) * g for i in range(1, budget + 1)]


def _plan_block(p: np.ndarray, budget: int, g: int) -> list[int]:
    n = p.size - 1
    return list(range(g, n + 1, g)[:budget])


def _plan_sqrt(p: np.ndarray, budget: int, g: int) -> list[int]:
    n = p.size - 1
    step = g * max(1, round(math.sqrt(n) / g))
    return list(range(step, n + 1, step)[:budget])


def _plan_log(p: np.ndarray, budget: int, g: int) -> list[int]:
    n = p.size - 1
    k = n // g
    m = min(budget, k)
    if m == 0:
        return []
    idx = [max(1, min(k, round(k ** (i / m)))) for i in range(1, m + 1)]
    for i in range(1, m):  # forward: strictly increasing
        idx[i] = max(idx[i], idx[i - 1] + 1)
    for i in range(m - 1, -1, -1):  # backward: leave room above for the rest
        idx[i] = min(idx[i], k - (m - 1 - i))
    return [i * g for i in idx]


_PLANNERS: dict[str, Callable[[np.ndarray, int, int], list[int]]] = {
    "dp": _plan_dp,
    "balanced": _plan_balanced,
    "block": _plan_block,
    "log": _plan_log,
    "sqrt": _plan_sqrt,
}


# --------------------------------------------------------------------------------------------
# public API


def plan_checkpoints(
    probs: Sequence[float] | np.ndarray,
    budget: int,
    method: str = "dp",
    granularity: int = 1,
) -> list[int]:
    """Sorted checkpoint positions in ``1..N`` (multiples of ``granularity``), at most ``budget``.

    ``probs[t]`` is P(overlap depth = t) for t = 0..N. Raises ``ValueError`` for a bad
    distribution, a negative budget, a granularity outside ``1..N`` or an unknown method.
    Deterministic: the same input always gives the same positions (for ``dp``, among several
    optimal plans one is returned; see ``_dp_layers`` for how ties are broken).
    """
    if method not in _PLANNERS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    p = validate_probs(probs)
    m = _validate_budget(budget)
    g = _validate_granularity(granularity, p.size - 1)
    if m == 0:
        return []
    return [int(x) for x in _PLANNERS[method](p, m, g)]


@dataclass(frozen=True)
class Plan:
    """A plan as reported to operators: where, what it costs on the planning distribution ``q``,
    and — when a reference distribution ``p`` (e.g. a fresher window) is given — ``TV(p, q)`` and
    the guarantee ``cost_p(plan) - OPT_p <= 2 N TV(p, q)``.
    """

    method: str
    budget: int
    granularity: int
    n: int
    positions: tuple[int, ...]
    expected_recompute: float
    no_cache_recompute: float
    tv: float | None = None
    suboptimality_bound: float | None = None

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["positions"] = list(self.positions)
        return d


def make_plan(
    probs: Sequence[float] | np.ndarray,
    budget: int,
    method: str = "dp",
    granularity: int = 1,
    reference: Sequence[float] | np.ndarray | None = None,
) -> Plan:
    """Plan on ``probs`` and package the result with its cost (and bound against ``reference``)."""
    q = validate_probs(probs)
    positions = plan_checkpoints(q, budget, method, granularity)
    tv = bound = None
    if reference is not None:
        tv = tv_distance(reference, q)
        bound = 2.0 * (q.size - 1) * tv
    return Plan(
        method=method,
        budget=int(budget),
        granularity=int(granularity),
        n=q.size - 1,
        positions=tuple(positions),
        expected_recompute=expected_recompute(q, positions),
        no_cache_recompute=expected_recompute(q, []),
        tv=tv,
        suboptimality_bound=bound,
    )
