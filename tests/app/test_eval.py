"""``minipic eval``: its metrics against hand-computed values, and a real small run.

Metrics: KL of identical distributions is 0, a known pair gives its closed form, EM / F1 follow
SQuAD's normalisation, the paired bootstrap CI covers the true mean in a simulation. The run:
the tiny model, fresh random items; the report has every field, ``prefix`` (span opt-in) agrees
with full attention (stock path, same tokens) to KL ~ 0, and bad JSONL lines are per-line errors
while the run goes on.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest

from minipic.eval import metrics

pytestmark = pytest.mark.shares("tiny_orchestrator")

VOCAB = ["river", "stone", "lamp", "cedar", "harbor", "violet", "ember", "falcon", "tundra"]


@pytest.mark.fast
def test_kl_of_identical_distributions_is_zero(seed) -> None:
    rng = random.Random(seed)
    raw = [rng.random() for _ in range(20)]
    total = sum(raw) * 1.3  # 20 listed tokens, the rest of the mass elsewhere
    p = {i: math.log(x / total) for i, x in enumerate(raw)}
    kl, rest = metrics.kl_topk(p, p)
    assert kl == pytest.approx(0.0, abs=1e-12) and rest == pytest.approx(1 - 1 / 1.3)


@pytest.mark.fast
def test_kl_of_a_known_pair_is_its_closed_form() -> None:
    p = {0: math.log(0.7), 1: math.log(0.3)}
    q = {0: math.log(0.4), 1: math.log(0.6)}
    kl, rest = metrics.kl_topk(p, q)
    assert kl == pytest.approx(0.7 * math.log(0.7 / 0.4) + 0.3 * math.log(0.3 / 0.6))
    assert rest == pytest.approx(0.0, abs=1e-12)
    # a tail bucket: p lists 0.5 / 0.3 (rest 0.2), q lists 0.2 / 0.2 (rest 0.6)
    p = {0: math.log(0.5), 1: math.log(0.3)}
    q = {0: math.log(0.2), 1: math.log(0.2)}
    expected = (0.5 * math.log(0.5 / 0.2) + 0.3 * math.log(0.3 / 0.2)
                + 0.2 * math.log(0.2 / 0.6))
    assert metrics.kl_topk(p, q)[0] == pytest.approx(expected)
    # a token q does not list is charged at most q's smallest listed probability
    q_missing = {0: math.log(0.5), 2: math.log(0.4)}
    kl_missing, _ = metrics.kl_topk({0: math.log(0.5), 1: math.log(0.5)}, q_missing)
    assert kl_missing >= 0.5 * math.log(0.5 / 0.1) - 1e-9  # q_1 <= q's unlisted mass 0.1


@pytest.mark.fast
def test_exact_match_and_f1_use_squad_normalisation() -> None:
    assert metrics.exact_match("The  Eiffel Tower!", "eiffel tower") == 1.0
    assert metrics.exact_match("an apple", "Apple.") == 1.0
    assert metrics.exact_match("Paris, France", "Paris") == 0.0
    assert metrics.f1("Paris France", "Paris") == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert metrics.f1("the", "a") == 1.0  # both normalise to nothing
    assert metrics.f1("London", "Paris") == 0.0
    assert metrics.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert metrics.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert metrics.first_divergence([1, 2], [1, 2, 3]) == 2


@pytest.mark.fast
def test_bootstrap_ci_covers_the_true_mean(seed) -> None:
    rng = np.random.default_rng(seed)
    trials, covered = 200, 0
    for t in range(trials):
        sample = rng.normal(1.0, 2.0, size=60)
        _, low, high = metrics.bootstrap_ci(sample, resamples=1000, seed=seed + t)
        covered += low <= 1.0 <= high
    assert 0.88 <= covered / trials <= 0.99, covered / trials
    # paired: the same indices for two series give the CI of their difference's mean
    a = rng.normal(0, 1, 80)
    idx = metrics.bootstrap_indices(80, 500, seed)
    mean, low, high = metrics.bootstrap_ci(a - a, indices=idx)
    assert mean == low == high == 0.0


@pytest.mark.fast
def test_jsonl_lines_with_problems_are_reported_not_fatal(tmp_path: Path) -> None:
    from minipic.eval.datasets import load_jsonl

    path = tmp_path / "mine.jsonl"
    path.write_bytes(b'{"question": "q?", "documents": ["a"], "answer": "a"}\n'
                     b'{"question": "q?"}\n'
                     b'{"question": "q?", "documents": []}\n'
                     b'\xff\xfe not utf-8\n'
                     b'not json\n'
                     b'{"question": "", "documents": ["a"]}\n'
                     b'{"question": "ok", "documents": ["b", "c"]}\n')
    loaded = load_jsonl(path)
    assert [i.question for i in loaded.items] == ["q?", "ok"]
    assert [e["line"] for e in loaded.errors] == [2, 3, 4, 5, 6]
    assert "documents" in loaded.errors[1]["error"] and "UTF-8" in loaded.errors[2]["error"]


@pytest.mark.engine
def test_small_real_run_has_every_field(tiny_orchestrator, tmp_path: Path, seed) -> None:
    from minipic.eval import evaluate, write
    from minipic.eval.datasets import EvalItem, load_jsonl

    rng = random.Random(seed)
    items = []
    for i in range(3):
        docs = [" ".join(rng.choice(VOCAB) for _ in range(rng.randint(20, 50)))
                for _ in range(rng.randint(2, 4))]
        items.append(EvalItem(id=f"r{i}", question=" ".join(rng.sample(VOCAB, 4)) + "?",
                              documents=docs, answer=rng.choice(VOCAB)))
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"question": "q"}\n\xff\n')
    errors = load_jsonl(bad).errors
    modes = ("prefix", "block_attention", "boundary_recompute", "boundary_recompute@40")
    report = tiny_orchestrator.submit(evaluate(
        tiny_orchestrator.aio, items, modes, max_tokens=4, errors=errors, progress=False,
        concurrency=2)).result()
    assert [e["line"] for e in report["errors"]] == [1, 2]
    summary = report["summary"]
    assert summary["n"] == 3 and set(summary["modes"]) == set(modes)
    for m in summary["modes"].values():
        for key in ("kl_mean", "kl_p95", "top1_agreement", "exact_match_full", "em", "f1",
                    "em_minus_full", "f1_minus_full", "ttft_p50_ms", "hit_rate", "p_rest_mean"):
            assert key in m, key
        assert len(m["kl_mean"]["ci95"]) == 2
    # prefix with span opt-in vs full attention on the stock path: the same computation
    assert summary["modes"]["prefix"]["kl_mean"]["mean"] < 1e-4
    assert summary["modes"]["prefix"]["top1_agreement"]["mean"] == 1.0
    assert {"boundary_recompute_minus_block_attention",
            "boundary_recompute@40_minus_block_attention"} <= set(summary["comparisons"])
    assert [r["id"] for r in report["items"]] == ["r0", "r1", "r2"]  # item order kept
    assert report["verdict"]
    for record in report["items"]:
        assert set(record["modes"]) == set(summary["modes"])
        assert record["modes"]["block_attention"]["cached_tokens"] > 0  # spans were reused
    write(report, tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert saved["summary"]["n"] == 3
    assert (tmp_path / "out" / "eval.png").stat().st_size > 0
    assert "block_attention" in (tmp_path / "out" / "eval.md").read_text()
