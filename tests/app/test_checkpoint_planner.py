"""Checkpoint planner: exactness of the O(NM) DP, baselines, estimator, CLI (docs/design.md §4).

The DP is checked against two independent references: a straightforward O(N²M) DP that computes
every segment cost from the definition (no prefix-sum identity, no hull), and, for tiny N, an
exhaustive search over all checkpoint sets. Inputs are fresh each run (hypothesis; numpy tests use
an unseeded generator whose seed is printed on failure).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minipic.checkpoint_planner import (
    METHODS,
    OverlapHistogram,
    expected_recompute,
    histogram_from_depths,
    make_plan,
    parse_histogram,
    plan_checkpoints,
    suboptimality_bound,
    tv_distance,
)
from minipic.checkpoint_planner import cli as plan_cli

pytestmark = pytest.mark.fast

BASELINES = [m for m in METHODS if m != "dp"]
SETTINGS = settings(deadline=None, max_examples=150,
                    suppress_health_check=[HealthCheck.too_slow])


def close(a: float, b: float, n: int) -> bool:
    """Equal within 1e-9 relative; the 1e-12·N absolute floor only matters for costs near 0,
    where float64 rounding of O(N) intermediate sums is all that can differ."""
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b)) + 1e-12 * max(1, n)


# ------------------------------------------------------------------------------------------
# references


def oracle_cost(p: np.ndarray, budget: int, g: int) -> float:
    """Straightforward DP: f_m[e] = min(f_{m-1}[e], min_{s cand, s<=e} f_{m-1}[s-1] + W[s, e])
    with W[s, e] = Σ_{t=s..e} (t - s) p_t computed directly. O(N²) memory, O(N²M) time."""
    n = p.size - 1
    t = np.arange(n + 1)
    w = np.full((n + 2, n + 1), np.inf)
    for s in range(1, n + 1):
        w[s, s:] = np.cumsum((t[s:] - s) * p[s:])
    f = np.cumsum(t * p)  # f_0[e]: everything served from depth 0
    cand = np.arange(g, n + 1, g)
    for _ in range(budget):
        prev_at = f[cand - 1][:, None] + w[cand, :]  # (K, N+1); inf where s > e
        f = np.minimum(f, prev_at.min(axis=0))
    return float(f[n])


def exhaustive_cost(p: np.ndarray, budget: int, g: int) -> float:
    n = p.size - 1
    cand = range(g, n + 1, g)
    return min(
        expected_recompute(p, c)
        for k in range(min(budget, len(cand)) + 1)
        for c in itertools.combinations(cand, k)
    )


# ------------------------------------------------------------------------------------------
# strategies


def _normalise(weights: list[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.sum() <= 0 or not np.isfinite(w.sum()):
        w = np.zeros_like(w)
        w[len(w) // 2] = 1.0
    return w / w.sum()


_weight = st.one_of(
    st.just(0.0), st.just(0.0), st.floats(0.0, 1.0), st.integers(0, 1000).map(float)
)


@st.composite
def instances(draw, max_n: int = 40, max_budget: int = 8):
    """(p, budget, granularity): zero-heavy and spiky distributions are common here."""
    n = draw(st.integers(1, max_n))
    g = draw(st.one_of(st.just(1), st.integers(1, n)))
    budget = draw(st.integers(0, max_budget))
    p = _normalise(draw(st.lists(_weight, min_size=n + 1, max_size=n + 1)))
    return p, budget, g


def fresh_rng() -> tuple[np.random.Generator, int]:
    seed = int(np.random.SeedSequence().entropy)
    return np.random.default_rng(seed), seed


# ------------------------------------------------------------------------------------------
# exactness


@SETTINGS
@given(instances())
def test_dp_matches_quadratic_oracle(inst):
    p, budget, g = inst
    pos = plan_checkpoints(p, budget, "dp", g)
    got, want = expected_recompute(p, pos), oracle_cost(p, budget, g)
    assert close(got, want, p.size - 1), (got, want, pos)


@SETTINGS
@given(instances(max_n=11, max_budget=5))
def test_dp_matches_exhaustive_search(inst):
    p, budget, g = inst
    got = expected_recompute(p, plan_checkpoints(p, budget, "dp", g))
    assert close(got, exhaustive_cost(p, budget, g), p.size - 1)


@SETTINGS
@given(instances())
def test_dp_never_worse_than_any_baseline(inst):
    p, budget, g = inst
    best = expected_recompute(p, plan_checkpoints(p, budget, "dp", g))
    for method in BASELINES:
        other = expected_recompute(p, plan_checkpoints(p, budget, method, g))
        assert best <= other + 1e-9 * abs(other) + 1e-12 * p.size, method


def test_dp_matches_oracle_on_larger_random_inputs():
    rng, seed = fresh_rng()
    for _ in range(4):
        n = int(rng.integers(50, 400))
        g = int(rng.choice([1, 1, rng.integers(2, 33)]))
        budget = int(rng.integers(1, 20))
        # mixtures of bumps on a sparse floor: multimodal, many exact zeros
        w = rng.random(n + 1) * (rng.random(n + 1) < 0.2)
        for c in rng.integers(0, n + 1, size=3):
            w += np.exp(-0.5 * ((np.arange(n + 1) - c) / rng.uniform(1, 20)) ** 2)
        p = w / w.sum()
        got = expected_recompute(p, plan_checkpoints(p, budget, "dp", g))
        want = oracle_cost(p, budget, g)
        assert close(got, want, n), f"seed={seed} n={n} g={g} M={budget}: {got} vs {want}"


@SETTINGS
@given(instances(max_n=60, max_budget=12))
def test_positions_are_valid_for_every_method(inst):
    p, budget, g = inst
    n = p.size - 1
    k = n // g
    for method in METHODS:
        pos = plan_checkpoints(p, budget, method, g)
        assert pos == sorted(set(pos)), method
        assert all(isinstance(c, int) and 1 <= c <= n and c % g == 0 for c in pos), method
        assert len(pos) <= budget, method
        if method in ("dp", "balanced"):
            assert len(pos) == min(budget, k), method


@SETTINGS
@given(st.integers(1, 300), st.integers(1, 40))
def test_balanced_is_optimal_for_uniform(n, budget):
    p = np.full(n + 1, 1.0 / (n + 1))
    dp = expected_recompute(p, plan_checkpoints(p, budget, "dp"))
    bal = expected_recompute(p, plan_checkpoints(p, budget, "balanced"))
    assert close(dp, bal, n), (dp, bal)


def test_budget_zero_and_budget_covering_every_candidate():
    rng, seed = fresh_rng()
    n = int(rng.integers(10, 200))
    p = rng.random(n + 1)
    p /= p.sum()
    assert plan_checkpoints(p, 0) == []
    mean_depth = float(np.dot(np.arange(n + 1), p))
    assert math.isclose(expected_recompute(p, []), mean_depth, rel_tol=1e-12), seed
    assert plan_checkpoints(p, n) == list(range(1, n + 1)), seed
    assert expected_recompute(p, plan_checkpoints(p, n + 5)) == 0.0, seed
    g = int(rng.integers(2, 10))
    assert plan_checkpoints(p, n, "dp", g) == list(range(g, n + 1, g)), seed


def test_expected_recompute_by_hand():
    p = [0.1, 0.2, 0.3, 0.4]  # depths 0..3
    # C = {2}: r = 0, 1, 0, 1
    assert math.isclose(expected_recompute(p, [2]), 0.2 + 0.4)
    assert math.isclose(expected_recompute(p, []), 0.2 + 0.6 + 1.2)
    # one checkpoint c saves c·P(T >= c): 0.9, 1.4, 1.2 for c = 1, 2, 3
    assert plan_checkpoints(p, 1) == [2]


def test_spike_gets_a_checkpoint_exactly():
    n = 1000
    p = np.zeros(n + 1)
    p[[123, 777]] = [0.3, 0.7]
    assert plan_checkpoints(p, 2) == [123, 777]
    assert plan_checkpoints(p, 2, granularity=100) == [100, 700]


def test_plan_dataclass_and_bound():
    rng, seed = fresh_rng()
    n = 100
    p = rng.random(n + 1)
    p /= p.sum()
    q = rng.random(n + 1)
    q /= q.sum()
    plan = make_plan(q, 5, reference=p)
    assert plan.positions == tuple(plan_checkpoints(q, 5))
    assert math.isclose(plan.suboptimality_bound, 2 * n * tv_distance(p, q)), seed
    assert json.loads(json.dumps(plan.to_dict()))["positions"] == list(plan.positions)
    assert make_plan(q, 5).suboptimality_bound is None


@SETTINGS
@given(instances(max_n=40, max_budget=6), st.data())
def test_tv_bound_holds(inst, data):
    """cost_p(plan optimised for q) - OPT_p <= 2 N TV(p, q)."""
    p, budget, g = inst
    q = _normalise(data.draw(st.lists(_weight, min_size=p.size, max_size=p.size)))
    regret = expected_recompute(p, plan_checkpoints(q, budget, "dp", g)) - expected_recompute(
        p, plan_checkpoints(p, budget, "dp", g)
    )
    assert regret <= suboptimality_bound(p, q) + 1e-9


# ------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize(
    ("probs", "kwargs", "match"),
    [
        ([0.5, -0.1, 0.6], {}, "non-negative"),
        ([0.5, float("nan"), 0.5], {}, "NaN"),
        ([0.5, float("inf"), 0.5], {}, "inf"),
        ([0.5, 0.4, 0.05], {}, "sum to 1"),
        ([1.0], {}, "length"),
        ([[0.5, 0.5]], {}, "1-D"),
        ([0.5, 0.25, 0.25], {"budget": -1}, "budget must be >= 0"),
        ([0.5, 0.25, 0.25], {"budget": 1.5}, "budget must be an integer"),
        ([0.5, 0.25, 0.25], {"granularity": 0}, "granularity must be >= 1"),
        ([0.5, 0.25, 0.25], {"granularity": 3}, "larger than the prefix length"),
        ([0.5, 0.25, 0.25], {"method": "greedy"}, "unknown method 'greedy'"),
    ],
)
def test_bad_input_is_a_clear_value_error(probs, kwargs, match):
    args = {"budget": 1, **kwargs}
    with pytest.raises(ValueError, match=match):
        plan_checkpoints(probs, **args)


def test_dp_refuses_a_back_pointer_table_too_large_to_allocate():
    p = np.full(200_001, 1 / 200_001)
    with pytest.raises(ValueError, match="back-pointer table"):
        plan_checkpoints(p, 100_000)


def test_plans_are_deterministic():
    rng, seed = fresh_rng()
    p = np.full(301, 1 / 301)  # many optimal plans
    assert plan_checkpoints(p, 7) == plan_checkpoints(p.copy(), 7)
    q = rng.random(301)
    q /= q.sum()
    assert plan_checkpoints(q, 9, granularity=4) == plan_checkpoints(q, 9, granularity=4), seed


def test_expected_recompute_rejects_out_of_range_positions():
    with pytest.raises(ValueError, match="outside 1..N"):
        expected_recompute([0.5, 0.5], [2])
    with pytest.raises(ValueError, match="outside 1..N"):
        expected_recompute([0.5, 0.5], [0])


# ------------------------------------------------------------------------------------------
# estimator


def test_empirical_histogram_is_normalised_counts():
    rng, seed = fresh_rng()
    n = 50
    depths = rng.integers(0, n + 1, size=500)
    want = np.bincount(depths, minlength=n + 1) / depths.size
    assert np.allclose(histogram_from_depths(depths, n), want), seed
    h = OverlapHistogram(n)
    for d in depths:
        h.observe(int(d))
    assert np.allclose(h.probs(), want), seed
    assert h.count == depths.size


def test_exponential_weights_follow_half_life():
    rng, seed = fresh_rng()
    n, half_life = 30, 7.0
    depths = rng.integers(0, n + 1, size=2000)  # long enough to force internal rescaling
    age = np.arange(depths.size)[::-1]
    want = np.bincount(depths, weights=0.5 ** (age / half_life), minlength=n + 1)
    want /= want.sum()
    one = OverlapHistogram(n, half_life=half_life)
    for d in depths:
        one.observe(int(d))
    many = OverlapHistogram(n, half_life=half_life)
    many.observe_many(depths[:777])
    many.observe_many(depths[777:])
    assert np.allclose(one.probs(), want, rtol=1e-9, atol=1e-15), seed
    assert np.allclose(many.probs(), want, rtol=1e-9, atol=1e-15), seed


def test_exponential_histogram_tracks_drift():
    h = OverlapHistogram(100, half_life=10)
    h.observe_many([10] * 1000)
    h.observe_many([90] * 100)
    assert h.probs()[90] > 0.99
    plain = OverlapHistogram(100)
    plain.observe_many([10] * 1000 + [90] * 100)
    assert plain.probs()[10] > 0.9


def test_histogram_plan_uses_its_estimate():
    h = OverlapHistogram(64)
    h.observe_many([5, 5, 40, 40, 40])
    plan = h.plan(2)
    assert plan.positions == (5, 40) and plan.expected_recompute == 0.0


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: OverlapHistogram(0), "n"),
        (lambda: OverlapHistogram(10, half_life=0), "half_life"),
        (lambda: OverlapHistogram(10, half_life=float("nan")), "half_life"),
        (lambda: OverlapHistogram(10).observe(11), "outside 0..n"),
        (lambda: OverlapHistogram(10).observe(-1), "outside 0..n"),
        (lambda: OverlapHistogram(10).observe_many([1.5]), "integers"),
        (lambda: OverlapHistogram(10).probs(), "no observations"),
    ],
)
def test_estimator_bad_input(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ------------------------------------------------------------------------------------------
# histogram file formats and CLI


def test_parse_histogram_formats():
    assert np.allclose(parse_histogram([0.25, 0.75]), [0.25, 0.75])
    assert np.allclose(parse_histogram([1, 3, 0]), [0.25, 0.75, 0.0])
    assert np.allclose(parse_histogram({"depths": [1, 1, 2, 0], "n": 3}), [0.25, 0.5, 0.25, 0])
    ew = parse_histogram({"depths": [0, 1], "n": 1, "half_life": 1})
    assert np.allclose(ew, [1 / 3, 2 / 3])


@pytest.mark.parametrize(
    ("obj", "match"),
    [
        ("0.5,0.5", "JSON list"),
        ({"n": 3}, '"depths" and "n"'),
        ({"depths": [1], "n": 3, "extra": 1}, '"depths" and "n"'),
        ({"depths": [4], "n": 3}, "outside 0..n"),
        ({"depths": [1.5], "n": 3}, "integers"),
        ([0.2, 0.2], "neither probabilities"),
        ([1, -1, 2], "negative"),
        ([0, 0], "sums to 0"),
        ([1], "N\\+1 >= 2"),
        ([1, "a"], "numbers"),
    ],
)
def test_parse_histogram_rejects(obj, match):
    with pytest.raises(ValueError, match=match):
        parse_histogram(obj)


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="minipic")
    plan_cli.add_subparser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_plan_prints_every_method(tmp_path, capsys):
    hist = tmp_path / "h.json"
    hist.write_text(json.dumps({"depths": [3, 3, 7, 8, 8, 8], "n": 8}))
    ref = tmp_path / "r.json"
    ref.write_text(json.dumps([0, 0, 0, 1, 0, 0, 0, 0, 2]))
    assert _cli(["plan", "--histogram", str(hist), "--budget", "2",
                 "--reference", str(ref)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["positions"] == [3, 7] and out["method"] == "dp"  # cost 3/6 beats {3, 8}: 4/6
    assert set(out["baselines"]) == set(BASELINES)
    assert out["suboptimality_bound"] == pytest.approx(2 * 8 * out["tv"])
    assert _cli(["plan", "--histogram", str(hist), "--budget", "1", "--granularity", "4",
                 "--method", "block"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["positions"] == [4] and "dp" in out["baselines"]


def test_cli_plan_bad_input_exits_2(tmp_path, capsys):
    hist = tmp_path / "h.json"
    hist.write_text('{"probs": [1]}')
    assert _cli(["plan", "--histogram", str(hist), "--budget", "2"]) == 2
    assert '"depths" and "n"' in capsys.readouterr().err
    hist.write_text("[0.5, 0.5]")
    assert _cli(["plan", "--histogram", str(hist), "--budget", "-3"]) == 2
    assert "budget must be >= 0" in capsys.readouterr().err
    assert _cli(["plan", "--histogram", str(tmp_path / "missing.json"), "--budget", "1"]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_cli_help_documents_file_format(capsys):
    with pytest.raises(SystemExit):
        _cli(["plan", "--help"])
    text = capsys.readouterr().out
    assert '"depths"' in text and "half_life" in text and "--granularity" in text
