"""Run the evaluation: every item under full attention and under each mode, paired.

Per item (one engine, the SDK's layouts, greedy):

1. **Full attention**: the ``prefix`` layout (the plain prompt), answered free-running; its
   tokens ``A`` are the reference. Its next-token distributions over ``A`` come from one
   teacher-forced request (prompt + ``A``, vLLM's ``prompt_logprobs``, top ``k``) sent
   *without* span opt-in: stock vLLM hashing and attention.
2. **Each mode** (``prefix`` — the same tokens with span opt-in, the control — then
   ``block_attention``, ``boundary_recompute``): answered free-running through the SDK (spans
   prefilled, then the final: its TTFT is the mode's warm TTFT), and teacher-forced on ``A``
   (the mode's layout + ``A``). KL(full ‖ mode) and top-1 agreement per answer token; greedy
   exact match with full attention and the first divergence; EM / F1 against the gold answer.

A teacher-forced request reads no cached blocks (vLLM skips the cache for prompt log-probs);
the engine's span isolation makes a cold prompt compute exactly what the warm one reads, so the
distributions are the mode's, whatever the cache held.
"""

from __future__ import annotations

import asyncio
import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from minipic.eval import metrics
from minipic.eval.datasets import EvalItem

DEFAULT_MODES = ("prefix", "block_attention", "boundary_recompute")
TOP_K = 20  # vLLM's default max_logprobs


async def _teacher_forced(backend: Any, prompt: list[int], answer: list[int], k: int,
                          spans: bool) -> list[dict[int, float]]:
    positions = await backend.prompt_logprobs(prompt + answer, k, spans=spans)
    out = []
    for j, token in enumerate(answer):
        entry = positions[len(prompt) + j]
        out.append(dict(entry) if entry else {token: 0.0})
    return out


# a ``--modes`` entry ending in this lays its spans out without their sink (docs/design.md §2),
# on the same engine: the sink's own row, paired with the mode's
NO_SINK = "/no-sink"


def parse_mode(spec: str) -> str:
    """A ``--modes`` entry in its canonical text form (``prompt_builder.parse_mode``:
    ``block_attention``, ``boundary_recompute@63``, ``selective@0.15``; any of them may end in
    ``/no-sink``); ``ValueError`` with the reason otherwise."""
    from minipic.prompt_builder import parse_mode as parse

    if spec.endswith(NO_SINK):
        return str(parse(spec[: -len(NO_SINK)])) + NO_SINK
    return str(parse(spec))


def _build(orc: Any, item: EvalItem, spec: str, max_tokens: int) -> Any:
    """The item's prompt in ``spec``: ``Orchestrator.build``'s call, plus the head length."""
    from minipic.orchestrator.errors import from_build_error
    from minipic.prompt_builder import PromptBuildError

    builder = orc.builder
    if spec.endswith(NO_SINK):
        builder, spec = builder.without_sink(), spec[: -len(NO_SINK)]
    try:
        return builder.build(question=item.question, system=item.system,
                             spans=list(item.documents), mode=parse_mode(spec),
                             max_tokens=max_tokens)
    except PromptBuildError as exc:
        raise from_build_error(exc) from exc


async def _answer(orc: Any, item: EvalItem, prompt: Any, spec: str, max_tokens: int) -> Any:
    """Free-running greedy answer through the SDK's scheduler (spans prefilled, then the
    final); each mode warms its own spans (its own cache salt)."""
    from minipic.orchestrator.backends import Sampling
    from minipic.orchestrator.errors import MinipicError
    from minipic.orchestrator.scheduler import Job

    job = Job(0, item.question, prompt, Sampling(max_tokens=max_tokens), f"eval-{spec}")
    (result,) = await orc.scheduler.run([job])
    if isinstance(result, MinipicError):
        raise result
    return result


async def evaluate_item(orc: Any, item: EvalItem, modes: Sequence[str], *, max_tokens: int,
                        k: int, reference_orc: Any = None) -> dict[str, Any]:
    """``reference_orc``: another engine whose full attention is the reference (the base model
    of a tuned one: the answers a user had before tuning); default ``orc`` itself."""
    backend = orc.backend
    ref_orc = reference_orc or orc
    full_built = _build(ref_orc, item, "prefix", max_tokens)
    full_prompt = full_built.prompt_token_ids
    full = await _answer(ref_orc, item, full_built, "full", max_tokens)
    answer_ids = list(full.token_ids) or [orc.builder.tokenizer.eos_token_id]
    reference = await _teacher_forced(ref_orc.backend, full_prompt, answer_ids, k, spans=False)
    record: dict[str, Any] = {
        "id": item.id, "source": item.source, "question": item.question,
        "gold": item.answer, "documents": len(item.documents),
        "full": {"text": full.text, "tokens": len(full.token_ids), "ttft_s": full.ttft_s,
                 "prompt_tokens": full.prompt_tokens, "cached_tokens": full.cached_tokens},
        "modes": {},
    }
    if item.answer is not None:
        record["full"].update(em=metrics.exact_match(full.text, item.answer),
                              f1=metrics.f1(full.text, item.answer))
    for mode in modes:
        built = _build(orc, item, mode, max_tokens)
        got = await _answer(orc, item, built, mode, max_tokens)
        forced = await _teacher_forced(backend, built.prompt_token_ids, answer_ids, k,
                                       spans=True)
        kls, rests, agree = [], [], []
        for p, q in zip(reference, forced, strict=True):
            kl, rest = metrics.kl_topk(p, q)
            kls.append(kl)
            rests.append(rest)
            agree.append(float(metrics.top1(p) == metrics.top1(q)))
        divergence = metrics.first_divergence(full.token_ids, got.token_ids)
        entry = {"text": got.text, "ttft_s": got.ttft_s, "prompt_tokens": got.prompt_tokens,
                 "cached_tokens": got.cached_tokens, "kl_mean": statistics.fmean(kls),
                 "kl_max": max(kls), "p_rest_mean": statistics.fmean(rests),
                 "top1_agreement": statistics.fmean(agree),
                 "exact_match_full": float(divergence is None), "first_divergence": divergence}
        if item.answer is not None:
            entry.update(em=metrics.exact_match(got.text, item.answer),
                         f1=metrics.f1(got.text, item.answer))
        record["modes"][mode] = entry
    return record


def summarize(records: list[dict[str, Any]], modes: Sequence[str], *, resamples: int = 2000,
              seed: int = 0) -> dict[str, Any]:
    """Per-mode means with paired bootstrap CIs, and the mode-vs-mode differences."""
    n = len(records)
    if n == 0:
        return {"n": 0, "modes": {}, "comparisons": {}}
    idx = metrics.bootstrap_indices(n, resamples, seed)

    def ci(values: list[float]) -> dict[str, float]:
        mean, low, high = metrics.bootstrap_ci(values, indices=idx)
        return {"mean": mean, "ci95": [low, high], "half_width": (high - low) / 2}

    has_gold = all(r["gold"] is not None for r in records)
    out: dict[str, Any] = {"n": n, "modes": {}, "comparisons": {}}
    full_ttft = [r["full"]["ttft_s"] for r in records]
    out["full_attention"] = {"ttft_p50_ms": statistics.median(full_ttft) * 1e3}
    if has_gold:
        out["full_attention"].update(em=ci([r["full"]["em"] for r in records]),
                                     f1=ci([r["full"]["f1"] for r in records]))
    for mode in modes:
        rows = [r["modes"][mode] for r in records]
        kl = [row["kl_mean"] for row in rows]
        diverged = [row["first_divergence"] for row in rows if row["first_divergence"] is not None]
        summary: dict[str, Any] = {
            "kl_mean": ci(kl), "kl_p95": metrics.p95(kl),
            "top1_agreement": ci([row["top1_agreement"] for row in rows]),
            "exact_match_full": ci([row["exact_match_full"] for row in rows]),
            "first_divergence_mean": statistics.fmean(diverged) if diverged else None,
            "p_rest_mean": statistics.fmean(row["p_rest_mean"] for row in rows),
            "ttft_p50_ms": statistics.median(row["ttft_s"] for row in rows) * 1e3,
            "hit_rate": (sum(row["cached_tokens"] for row in rows)
                         / max(1, sum(row["prompt_tokens"] for row in rows))),
        }
        if has_gold:
            summary["em"] = ci([row["em"] for row in rows])
            summary["f1"] = ci([row["f1"] for row in rows])
            summary["em_minus_full"] = ci([row["em"] - r["full"]["em"]
                                           for row, r in zip(rows, records, strict=True)])
            summary["f1_minus_full"] = ci([row["f1"] - r["full"]["f1"]
                                           for row, r in zip(rows, records, strict=True)])
        out["modes"][mode] = summary
    pairs = [(a, "block_attention") for a in modes
             if a.startswith(("boundary_recompute", "selective")) or a == "prefix"]
    for a, b in pairs:
        if b in modes:
            ra = [r["modes"][a] for r in records]
            rb = [r["modes"][b] for r in records]
            out["comparisons"][f"{a}_minus_{b}"] = {
                "kl_mean": ci([x["kl_mean"] - y["kl_mean"] for x, y in zip(ra, rb, strict=True)]),
                "top1_agreement": ci([x["top1_agreement"] - y["top1_agreement"]
                                      for x, y in zip(ra, rb, strict=True)]),
            }
    return out


def verdict(summary: dict[str, Any]) -> str | None:
    """Whether ``boundary_recompute`` is closer to full attention than ``block_attention``,
    as far as the CIs of the paired differences can say."""
    comparison = summary.get("comparisons", {}).get("boundary_recompute_minus_block_attention")
    if comparison is None:
        return None
    low, high = comparison["kl_mean"]["ci95"]
    a_low, a_high = comparison["top1_agreement"]["ci95"]
    if high < 0 and a_low >= 0:
        return "boundary_recompute is closer to full attention than block_attention (lower KL)"
    if low > 0 and a_high <= 0:
        return "block_attention is closer to full attention than boundary_recompute"
    return "the CIs cannot separate boundary_recompute from block_attention"


async def run_items(orc: Any, items: Sequence[EvalItem], modes: Sequence[str], *,
                    max_tokens: int = 16, k: int = TOP_K, concurrency: int = 1,
                    progress: Callable[[], None] | None = None, reference_orc: Any = None
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Records of the items that ran (in item order), and an error entry for each that failed
    (the run goes on: one bad item never loses the others). ``concurrency`` items run at once:
    their requests share engine steps (more throughput; a TTFT then includes other items'
    work, alike for every mode)."""
    gate = asyncio.Semaphore(max(1, concurrency))

    async def one(item: EvalItem) -> dict[str, Any] | Exception:
        async with gate:
            try:
                return await evaluate_item(orc, item, modes, max_tokens=max_tokens, k=k,
                                           reference_orc=reference_orc)
            except Exception as exc:  # per item: report it, keep going
                return exc
            finally:
                if progress is not None:
                    progress()

    results = await asyncio.gather(*(one(item) for item in items))
    records, errors = [], []
    for item, result in zip(items, results, strict=True):
        if isinstance(result, Exception):
            errors.append({"id": item.id, "error": f"{type(result).__name__}: {result}"[:500]})
        else:
            records.append(result)
    return records, errors


def finite(x: Any) -> Any:
    """JSON-safe: NaN / inf become None."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [finite(v) for v in x]
    if isinstance(x, np.floating):
        return finite(float(x))
    return x
