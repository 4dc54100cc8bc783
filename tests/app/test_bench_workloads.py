"""The benchmark's workloads and scoring (what `minipic bench` measures on)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from minipic.bench.runner import percentile, wilson_interval
from minipic.bench.workloads import agent_workload, is_correct, normalize_answer, rag_workload

pytestmark = pytest.mark.fast


def word_count(text: str) -> int:
    return len(text.split())


def test_answer_normalisation_matches_block_attention_style_scoring():
    assert normalize_answer("The  Brasília!") == "brasilia"
    assert is_correct("It was founded in 1636, in Cambridge.", "1636")
    assert is_correct("Washington D.C.", "Washington, D.C.")
    assert not is_correct("Moscow", "Beijing")


def test_rag_workload_is_2wiki_shaped_and_shares_passages():
    seed = random.randrange(10**6)
    items = rag_workload(12, word_count, seed=seed)
    assert len(items) == 12
    uses = Counter(doc for it in items for doc in it.documents)
    assert max(uses.values()) > 1, f"seed {seed}: passages must recur across questions"
    for it in items:
        assert len(it.documents) == 10 and len(set(it.documents)) == 10
        assert all(word_count(d) <= 150 for d in it.documents), seed
        assert 1 <= len(it.relevant) <= 3 and it.question and it.answer
    assert len({it.system for it in items}) > 1  # system prompts vary across clients
    assert rag_workload(12, word_count, seed=seed) == items  # reproducible from the seed


def test_agent_workload_reorders_tools_every_turn():
    turns = agent_workload(5, seed=random.randrange(10**6))
    orders = {tuple(t.documents[:6]) for t in turns}
    assert len(orders) > 1
    assert all(set(t.documents[:6]) == set(turns[0].documents[:6]) for t in turns)


def test_percentile_interpolates():
    values = [random.random() for _ in range(101)]
    assert percentile(values, 0.5) == sorted(values)[50]
    assert percentile(values, 0.0) == min(values) and percentile(values, 1.0) == max(values)


def test_wilson_interval_covers_the_proportion_and_narrows_with_n():
    n = random.randrange(5, 200)
    k = random.randrange(0, n + 1)
    lo, hi = wilson_interval(k, n)
    assert 0.0 <= lo <= k / n <= hi <= 1.0
    lo4, hi4 = wilson_interval(4 * k, 4 * n)
    assert hi4 - lo4 < hi - lo
    # the textbook value: 50/100 -> 0.404..0.596
    assert wilson_interval(50, 100) == pytest.approx((0.4038, 0.5962), abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_plot_only_redraws_from_bench_json(tmp_path):
    """``minipic bench --plot-only`` turns a saved report into its figures, and says what
    to run when there is no report."""
    import shutil
    from pathlib import Path

    from minipic.cli import main

    report = Path(__file__).resolve().parents[2] / "results" / "bench" / "bench.json"
    shutil.copy(report, tmp_path / "bench.json")
    assert main(["bench", "--plot-only", "--out", str(tmp_path)]) == 0
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == ["accuracy_vs_ttft.png", "agent_memory.png", "prefill_steps.png",
                    "throughput.png", "ttft_sweeps.png"]
    assert all((tmp_path / p).stat().st_size > 10_000 for p in pngs)
    assert main(["bench", "--plot-only", "--out", str(tmp_path / "missing")]) == 2
