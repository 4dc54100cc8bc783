"""The numbers ``minipic eval`` reports, each a pure function (tests/test_eval_metrics.py).

**KL from top-k log-probabilities.** The engine returns the top ``k`` next-token log-probs at
each position (vLLM's ``prompt_logprobs``; ``k`` = 20, vLLM's default cap), not the full
distribution. :func:`kl_topk` is KL(p ‖ q) over the coarsening {each of p's top-k tokens, the
rest}: exact for that partition when q's top-k holds p's, and otherwise with each missing
``q_i`` set to the largest value it can have (the smallest of q's listed probabilities, or q's
unlisted mass shared out if smaller), so a token q ranks low is charged as little as q allows.
A coarsening never has more KL than the full distributions (data processing), so with every
``q_i`` known this is a lower bound of the full-vocabulary KL; the missing-token rule can only
raise it. For the peaked answer distributions of a RAG answer, p's top-20 holds nearly all of
its mass (``p_rest`` is reported).

**EM / F1** with SQuAD's normalisation: lower case, punctuation and the articles a/an/the
removed, whitespace collapsed; F1 over the bag of normalised tokens.

**Paired bootstrap.** Items are resampled with replacement, the same indices for every mode, so
the CI of a difference carries the pairing (a mode is compared with full attention on the same
questions).
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def kl_topk(p_logprobs: Mapping[int, float], q_logprobs: Mapping[int, float]) -> tuple[float,
                                                                                        float]:
    """``(KL(p ‖ q), p_rest)`` from two top-k log-prob maps of the same position."""
    p = {t: math.exp(lp) for t, lp in p_logprobs.items()}
    q = {t: math.exp(lp) for t, lp in q_logprobs.items()}
    p_rest = max(0.0, 1.0 - sum(p.values()))
    q_listed = sum(q.values())
    missing = [t for t in p if t not in q]
    q_unlisted = max(0.0, 1.0 - q_listed)
    if missing:
        share = q_unlisted / len(missing)
        floor = min(q.values()) if q else share
        fill = max(min(floor, share), 1e-12)
    kl = 0.0
    q_used = 0.0
    for t, pt in p.items():
        qt = q.get(t, fill if missing else 1e-12)
        q_used += qt
        if pt > 0:
            kl += pt * math.log(pt / qt)
    q_rest = max(1.0 - q_used, 1e-12)
    if p_rest > 0:
        kl += p_rest * math.log(p_rest / q_rest)
    return max(kl, 0.0), p_rest


def top1(logprobs: Mapping[int, float]) -> int:
    return max(logprobs.items(), key=lambda kv: (kv[1], -kv[0]))[0]


def normalize_answer(text: str) -> str:
    text = text.lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first token where two greedy outputs differ (None: identical)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def bootstrap_ci(values: Sequence[float] | np.ndarray, *, resamples: int = 2000,
                 level: float = 0.95, seed: int = 0,
                 indices: np.ndarray | None = None) -> tuple[float, float, float]:
    """``(mean, low, high)``: percentile bootstrap CI of the mean. Pass the same ``indices``
    (from :func:`bootstrap_indices`) for every series of one run to pair them."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        return math.nan, math.nan, math.nan
    idx = bootstrap_indices(x.size, resamples, seed) if indices is None else indices
    means = x[idx].mean(axis=1)
    tail = (1 - level) / 2
    return float(x.mean()), float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail))


def bootstrap_indices(n: int, resamples: int = 2000, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def p95(values: Sequence[float]) -> float:
    return float(np.quantile(np.asarray(values, dtype=float), 0.95)) if len(values) else math.nan
