"""Selective recompute (issue 37): which signal picks the span tokens to recompute, and at which
granularity (token or 32-token block), measured in transformers (no vLLM, no engine).

    python benchmarks/selective_signal.py                       # 60 items, all budgets
    python benchmarks/selective_signal.py --n 4 --budgets 0.1 --threads 1 --check   # smoke

Per item (``minipic eval``'s built-in items and seed, the SDK's real layouts, fp32
SmolLM2-135M, the engine's defaults: blocks of 32, max_model_len 2048):

1. **full attention**: the ``prefix`` layout (the plain prompt); its greedy answer ``A`` (up to
   ``--max-tokens``, EOS included when produced) and, teacher-forced, the next-token
   distributions over ``A``: the reference ``p``.
2. **block_attention**: the ``block_attention`` layout + ``A`` in one pass under the block mask
   (``tests/support/pic_reference.py``: a span run -- SSEP .. end of its padding -- attends only
   within itself). This pass also records every layer's post-RoPE K/V (the cached KV: each span
   computed alone, at the final prompt's positions) and the attention the question puts on every
   key. A second pass of the same tokens under the plain causal mask gives K/V with every span in
   context, and ``layout_full``: everything recomputed (budget 1.0; its KL is what the markers and
   padding alone cost, the floor of any selection).
3. **signals**, a score per span content token (SSEP and PAD are never candidates):

   * ``question_attention_all`` (ProphetKV-like): in the block pass, for every layer, the
     attention weights of the question rows (PDEP .. last prompt token) summed over those rows and
     averaged over heads; then averaged over layers;
   * ``question_attention_L<k>``: the same at one early-middle layer (``--attn-layer``);
   * ``kv_deviation_k`` / ``kv_deviation_v`` (CacheBlend-like): ``||K_full - K_block||`` (resp. V)
     per token over all KV heads at layer 1 (layer 0's K/V are the same under both masks: no
     attention has mixed anything yet). Here K_full comes from the full causal pass, but the signal
     only needs layer 0 recomputed in context (1/30 of a prefill), as CacheBlend does;
   * ``random`` (seeded per item) and ``span_start`` (the first tokens of every span, as
     ``boundary_recompute`` recomputes) as controls.

   Block granularity: each 32-token block of a span scores the mean of its content tokens.
4. **selective**: per budget (a share of the span content tokens), signal and granularity, the
   top tokens (token) or the top blocks that fit (block, greedily, by content tokens) are
   recomputed *in context*; every other position keeps the block pass's K/V at every layer. That
   is one forward pass of the recomputed tokens + question + ``A`` over the cached K/V of the rest
   (the engine's semantics: an unselected token is never recomputed). KL(p || selective) over the
   full vocabulary per answer token, top-1 agreement with ``p``, and whether the argmax is ``A``'s
   token (teacher-forced greedy agreement; no free-running decode per config).

Not a single mixed-mask pass: with selected rows full causal and unselected rows isolated, an
unselected token that follows a selected one in its span would read the *recomputed* K/V of that
token and so change its own K/V -- which the engine, reading it from cache, never does. ``--check``
measures that difference and asserts the two exact sanity checks: budget 0 reproduces the block
pass, and every span position recomputed reproduces the full causal pass.

Writes ``selective_signal.json`` (meta, per-config summary with paired bootstrap 95% CIs of the
KL difference vs block_attention, per-item records), ``selective_signal.md`` and
``selective_signal.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from minipic.tune.layout import additive_mask  # noqa: E402  (after the path set-up)
from minipic.tune.objective import greedy_answer  # noqa: E402

ATTN = "minipic_selective_probe"
KV_LAYER = 1
GRANULARITIES = ("token", "block")
CONTROL_SIGNALS = ("random", "span_start")


# ---------------------------------------------------------------------------------------------
# the attention function: eager attention, plus recording and splicing for the pass in flight
# ---------------------------------------------------------------------------------------------


@dataclass
class Probe:
    """What the attention function does during one pass (inactive: plain eager attention)."""

    active: bool = False
    record_layers: set[int] = field(default_factory=set)  # layers whose K/V to keep
    question_rows: slice | None = None  # query rows whose attention mass to keep
    cached_k: list[torch.Tensor] | None = None  # per layer [1, kv_heads, C, d]: prepended keys
    cached_v: list[torch.Tensor] | None = None
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    mass: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [kv_len]

    def start(self, **settings: Any) -> None:
        """Arm for one pass: ``settings`` as the fields; everything recorded before is gone."""
        self.__dict__.update(Probe(active=True, **settings).__dict__)


PROBE = Probe()


def probe_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                    **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    from transformers.models.llama.modeling_llama import eager_attention_forward

    if not PROBE.active:
        return eager_attention_forward(module, query, key, value, attention_mask, scaling,
                                       dropout, **kwargs)
    layer = module.layer_idx
    if layer in PROBE.record_layers:
        PROBE.keys[layer], PROBE.values[layer] = key.detach().clone(), value.detach().clone()
    if PROBE.cached_k is not None and PROBE.cached_v is not None:
        key = torch.cat([PROBE.cached_k[layer], key], dim=2)
        value = torch.cat([PROBE.cached_v[layer], value], dim=2)
    out, weights = eager_attention_forward(module, query, key, value, attention_mask, scaling,
                                           dropout)
    if PROBE.question_rows is not None:
        PROBE.mass[layer] = weights[0, :, PROBE.question_rows, :].sum(dim=1).mean(dim=0)
    return out, None


def register_attention(model: Any, name: str, attention: Callable[..., Any]) -> None:
    """``attention`` as ``model``'s attention function, registered as ``name``; generate() keeps
    eager's mask function."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["eager"])  # generate()
    model.set_attn_implementation(name)


@torch.inference_mode()
def forward(model: Any, ids: Sequence[int], positions: Sequence[int], allowed: torch.Tensor,
            rows: Sequence[int], *, record_layers: Sequence[int] = (),
            question_rows: slice | None = None,
            cached: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None) -> torch.Tensor:
    """Log-softmax of the next-token logits at ``rows`` (indices into ``ids``), ``[rows, V]``.

    ``allowed``: ``[len(ids), C + len(ids)]`` with ``cached`` (K/V of ``C`` positions per layer,
    prepended to every layer's keys), else ``[len(ids), len(ids)]``."""
    PROBE.start(record_layers=set(record_layers), question_rows=question_rows,
                cached_k=cached[0] if cached else None, cached_v=cached[1] if cached else None)
    try:
        hidden = model.model(input_ids=torch.tensor([list(ids)]),
                             attention_mask=additive_mask(allowed),
                             position_ids=torch.tensor([list(positions)]),
                             use_cache=False).last_hidden_state
    finally:
        PROBE.active = False
    logits = model.lm_head(hidden[0, list(rows)])
    return torch.log_softmax(logits.float(), dim=-1)


# ---------------------------------------------------------------------------------------------
# layouts, masks, selections
# ---------------------------------------------------------------------------------------------


@dataclass
class Layout:
    """The block_attention layout of one item, with the answer appended."""

    ids: list[int]  # prompt + A
    prompt_len: int
    question_start: int  # the PDEP
    runs: list[tuple[int, int]]  # span runs: SSEP .. end of padding (isolated)
    content: np.ndarray  # positions of span content tokens (no SSEP, no PAD)
    offset: np.ndarray  # parallel: offset of each content token within its span
    block_of: np.ndarray  # parallel: prompt block index (position // block_size)


def layout_of(built: Any, answer: list[int]) -> Layout:
    from support.pic_reference import span_part_runs

    content, offset = [], []
    for seg in built.segments:
        if seg.kind == "span":
            positions = range(seg.content_start, seg.end)
            content += positions
            offset += range(len(positions))
    question = [s for s in built.segments if s.kind == "question"]
    assert len(question) == 1 and question[0].marker == "pdep"
    ids = list(built.prompt_token_ids) + answer
    content_arr = np.asarray(content, dtype=np.int64)
    return Layout(ids=ids, prompt_len=len(built.prompt_token_ids),
                  question_start=question[0].start,
                  runs=[(a, b) for a, b, _ in span_part_runs(built)], content=content_arr,
                  offset=np.asarray(offset, dtype=np.int64),
                  block_of=content_arr // built.block_size)


def causal(length: int) -> torch.Tensor:
    return torch.ones(length, length, dtype=torch.bool).tril()


def mixed_allowed(length: int, runs: Sequence[tuple[int, int]],
                  selected: Sequence[int]) -> torch.Tensor:
    """The single-pass mixed mask (``--check`` only): block mask, with the rows of ``selected``
    full causal. Not the engine's semantics (see the module docstring)."""
    from support.pic_reference import block_attention_allowed

    allowed = block_attention_allowed(length, runs)
    rows = torch.as_tensor(list(selected), dtype=torch.long)
    if rows.numel():
        allowed[rows] = causal(length)[rows]
    return allowed


def select(scores: np.ndarray, lay: Layout, budget: float, granularity: str) -> np.ndarray:
    """Positions to recompute: the best content tokens, or the best blocks (mean score) whose
    content tokens fit, within ``round(budget * span content tokens)``."""
    limit = round(budget * len(lay.content))
    if granularity == "token":
        order = np.argsort(-scores, kind="stable")
        return np.sort(lay.content[order[:limit]])
    blocks = np.unique(lay.block_of)
    means = np.array([scores[lay.block_of == b].mean() for b in blocks])
    chosen: list[int] = []
    used = 0
    for b in blocks[np.argsort(-means, kind="stable")]:
        members = lay.content[lay.block_of == b]
        if used + len(members) <= limit:
            chosen += members.tolist()
            used += len(members)
    return np.sort(np.asarray(chosen, dtype=np.int64))


@torch.inference_mode()
def selective(model: Any, lay: Layout, selected: np.ndarray,
              kv: tuple[list[torch.Tensor], list[torch.Tensor]]) -> torch.Tensor:
    """``selected`` span positions recomputed in context, every other position before the
    question read from the block pass's K/V (all layers); logprobs over the answer."""
    total = len(lay.ids)
    recompute = np.concatenate([selected, np.arange(lay.question_start, total)])
    keep = np.ones(lay.question_start, dtype=bool)
    keep[selected] = False
    cached_pos = np.flatnonzero(keep)
    idx = torch.as_tensor(cached_pos)
    cached = ([k[:, :, idx] for k in kv[0]], [v[:, :, idx] for v in kv[1]])
    key_pos = torch.as_tensor(np.concatenate([cached_pos, recompute]))
    allowed = key_pos[None, :] <= torch.as_tensor(recompute)[:, None]  # all rows: full causal
    answer_len = total - lay.prompt_len
    rows = range(len(recompute) - answer_len - 1, len(recompute) - 1)
    return forward(model, [lay.ids[p] for p in recompute], recompute.tolist(), allowed, rows,
                   cached=cached)


# ---------------------------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------------------------


def compare(p: torch.Tensor, q: torch.Tensor, answer: list[int], k: int = 20) -> dict[str, float]:
    """KL(p || q) over the full vocabulary per answer token (mean), eval's top-20 KL, top-1
    agreement with p, and agreement of q's argmax with the answer token."""
    from minipic.eval import metrics

    kl = (p.exp() * (p - q)).sum(dim=-1).clamp_min(0)
    pk, qk = p.topk(k, dim=-1), q.topk(k, dim=-1)
    top20 = [metrics.kl_topk(dict(zip(pi.tolist(), pv.tolist(), strict=True)),
                             dict(zip(qi.tolist(), qv.tolist(), strict=True)))[0]
             for pv, pi, qv, qi in zip(pk.values, pk.indices, qk.values, qk.indices,
                                       strict=True)]
    return {"kl": float(kl.mean()), "kl_max": float(kl.max()),
            "kl_top20": float(np.mean(top20)),
            "top1": float((p.argmax(-1) == q.argmax(-1)).float().mean()),
            "answer_agree": float((q.argmax(-1) == torch.tensor(answer)).float().mean())}


# ---------------------------------------------------------------------------------------------
# one item
# ---------------------------------------------------------------------------------------------


def reference_pass(model: Any, builder: Any, item: Any, max_tokens: int, timing: dict[str, float],
                   pass_key: str) -> tuple[Any, Any, list[int], torch.Tensor]:
    """The item's ``prefix`` (the plain prompt) and ``block_attention`` builds, the greedy
    answer ``A`` under full attention on the plain prompt (up to ``max_tokens``, EOS included
    when produced) and, teacher-forced, the reference ``p``: the next-token logprobs over ``A``.
    ``timing`` gets ``generate_s`` (the builds and ``A``) and ``pass_key`` (the pass of ``p``)."""
    t0 = time.perf_counter()
    common = dict(question=item.question, system=item.system, spans=list(item.documents),
                  max_tokens=max_tokens)
    plain = builder.build(mode="prefix", **common)
    built = builder.build(mode="block_attention", **common)
    prompt = list(plain.prompt_token_ids)
    answer = greedy_answer(model, prompt, max_tokens, builder.tokenizer.eos_token_id)
    timing["generate_s"] = time.perf_counter() - t0

    t = time.perf_counter()
    ids = prompt + answer
    p = forward(model, ids, range(len(ids)), causal(len(ids)), range(len(prompt) - 1, len(ids) - 1))
    timing[pass_key] = time.perf_counter() - t
    return plain, built, answer, p


def finish_record(record: dict[str, Any], timing: dict[str, float], t0: float,
                  check: Callable[[], dict[str, Any]] | None) -> dict[str, Any]:
    """``record`` with its ``check`` (``--check``: ``check()``, timed as ``check_s``) and then its
    ``timing``, ``item_s`` counted from ``t0``, the item's start."""
    if check is not None:
        t = time.perf_counter()
        record["check"] = check()
        timing["check_s"] = time.perf_counter() - t
    timing["item_s"] = time.perf_counter() - t0
    record["timing"] = timing
    return record


def signals_of(lay: Layout, mass: dict[int, torch.Tensor], kv_block: tuple[dict, dict],
               kv_full: tuple[dict, dict], attn_layer: int, names: Sequence[str],
               rng: np.random.Generator) -> dict[str, np.ndarray]:
    pos = torch.as_tensor(lay.content)
    out: dict[str, np.ndarray] = {}
    every = torch.stack([mass[layer] for layer in sorted(mass)])  # [layers, kv]
    candidates = {
        "question_attention_all": lambda: every.mean(dim=0)[pos],
        f"question_attention_L{attn_layer}": lambda: mass[attn_layer][pos],
        "kv_deviation_k": lambda: (kv_full[0][KV_LAYER] - kv_block[0][KV_LAYER])[0][:, pos]
        .pow(2).sum(dim=(0, 2)).sqrt(),
        "kv_deviation_v": lambda: (kv_full[1][KV_LAYER] - kv_block[1][KV_LAYER])[0][:, pos]
        .pow(2).sum(dim=(0, 2)).sqrt(),
        "random": lambda: torch.as_tensor(rng.random(len(pos))),
        "span_start": lambda: -torch.as_tensor(lay.offset, dtype=torch.float64),
    }
    for name in names:
        out[name] = candidates[name]().double().numpy()
    return out


def evaluate_item(model: Any, builder: Any, item: Any, index: int,
                  args: argparse.Namespace) -> dict[str, Any]:
    from support.pic_reference import block_attention_allowed

    timing: dict[str, float] = {}
    t0 = time.perf_counter()
    full_built, built, answer, p = reference_pass(model, builder, item, args.max_tokens, timing,
                                                  "full_pass_s")
    lay = layout_of(built, answer)
    total = len(lay.ids)
    rows = range(lay.prompt_len - 1, total - 1)
    layers = model.config.num_hidden_layers
    t = time.perf_counter()
    q_block = forward(model, lay.ids, range(total), block_attention_allowed(total, lay.runs),
                      rows, record_layers=range(layers),
                      question_rows=slice(lay.question_start, lay.prompt_len))
    kv_block = (dict(PROBE.keys), dict(PROBE.values))
    mass = dict(PROBE.mass)
    timing["block_pass_s"] = time.perf_counter() - t
    t = time.perf_counter()
    q_layout = forward(model, lay.ids, range(total), causal(total), rows,
                       record_layers=[KV_LAYER])
    kv_full = (dict(PROBE.keys), dict(PROBE.values))
    timing["layout_full_pass_s"] = time.perf_counter() - t
    kv = ([kv_block[0][i] for i in range(layers)], [kv_block[1][i] for i in range(layers)])

    rng = np.random.default_rng([args.seed, index])
    scores = signals_of(lay, mass, kv_block, kv_full, args.attn_layer, args.signals, rng)
    configs: dict[str, dict[str, Any]] = {}
    t = time.perf_counter()
    passes = 0
    for name, score in scores.items():
        for gran in GRANULARITIES:
            for budget in args.budgets:
                chosen = select(score, lay, budget, gran)
                q = selective(model, lay, chosen, kv)
                passes += 1
                configs[f"{name}|{gran}|{budget:g}"] = {
                    **compare(p, q, answer), "recomputed": len(chosen) / len(lay.content)}
    timing["selective_s"] = time.perf_counter() - t
    timing["selective_pass_s"] = timing["selective_s"] / max(1, passes)

    record: dict[str, Any] = {
        "id": item.id, "documents": len(item.documents),
        "prefix_tokens": len(full_built.prompt_token_ids), "layout_tokens": lay.prompt_len,
        "span_content_tokens": int(len(lay.content)),
        "span_blocks": int(len(np.unique(lay.block_of))), "answer_tokens": len(answer),
        "answer": builder.decode(answer), "block_attention": compare(p, q_block, answer),
        "layout_full": compare(p, q_layout, answer), "configs": configs,
    }
    return finish_record(record, timing, t0,
                         (lambda: sanity_checks(model, lay, kv, q_block, q_layout, scores))
                         if args.check else None)


def sanity_checks(model: Any, lay: Layout, kv: tuple[list, list], q_block: torch.Tensor,
                  q_layout: torch.Tensor, scores: dict[str, np.ndarray]) -> dict[str, float]:
    """(i) nothing recomputed == the block pass; (ii) every span position (SSEP and PAD too)
    recomputed == the full causal pass of the layout; (iii) the first half of the spans
    recomputed whole == the single mixed-mask pass (where the two semantics agree); (iv) how far
    the single mixed-mask pass is from the engine's semantics for one 15% token selection."""
    from support.pic_reference import block_attention_allowed

    total = len(lay.ids)
    rows = range(lay.prompt_len - 1, total - 1)
    empty = np.zeros(0, dtype=np.int64)
    every = np.concatenate([np.arange(a, b) for a, b in lay.runs])
    out = {
        "budget0_max_abs_logprob_diff": float((selective(model, lay, empty, kv) - q_block)
                                              .abs().max()),
        "budget0_mixed_mask_equals_block_mask": float(torch.equal(
            mixed_allowed(total, lay.runs, []), block_attention_allowed(total, lay.runs))),
        "all_max_abs_logprob_diff": float((selective(model, lay, every, kv) - q_layout)
                                          .abs().max()),
    }
    name = "kv_deviation_v" if "kv_deviation_v" in scores else next(iter(scores))
    chosen = select(scores[name], lay, 0.15, "token")
    spliced = selective(model, lay, chosen, kv)
    single = forward(model, lay.ids, range(total), mixed_allowed(total, lay.runs, chosen), rows)
    out["mixed_mask_vs_engine_selection"] = f"{name}|token|0.15"  # type: ignore[assignment]
    # KL(engine || single pass), mean over the answer tokens
    out["mixed_mask_vs_engine_kl"] = float((spliced.exp() * (spliced - single)).sum(-1).mean())
    out["mixed_mask_vs_engine_max_abs_logprob_diff"] = float((spliced - single).abs().max())
    # whole span runs recomputed: no unselected token follows a selected one in its span, so
    # there the single mixed-mask pass *is* the engine's semantics (a partial selection, checked)
    whole = np.concatenate([np.arange(a, b) for a, b in lay.runs[: max(1, len(lay.runs) // 2)]])
    single = forward(model, lay.ids, range(total), mixed_allowed(total, lay.runs, whole), rows)
    out["whole_spans_max_abs_logprob_diff"] = float((selective(model, lay, whole, kv) - single)
                                                    .abs().max())
    assert out["budget0_mixed_mask_equals_block_mask"] == 1.0
    assert out["budget0_max_abs_logprob_diff"] < 1e-3, out
    assert out["all_max_abs_logprob_diff"] < 1e-3, out
    assert out["whole_spans_max_abs_logprob_diff"] < 1e-3, out
    return out


# ---------------------------------------------------------------------------------------------
# summary, report
# ---------------------------------------------------------------------------------------------


def paired_ci(n: int, resamples: int = 2000,
              seed: int = 0) -> Callable[[Sequence[float]], dict[str, Any]]:
    """Eval's bootstrap mean and 95% CI of ``n`` per-item values, every call over the one index
    set drawn here: all CIs of a run resample the same items, so a difference between two
    configurations is paired."""
    from minipic.eval import metrics

    idx = metrics.bootstrap_indices(n, resamples, seed)

    def ci(values: Sequence[float]) -> dict[str, Any]:
        mean, low, high = metrics.bootstrap_ci(values, indices=idx)
        return {"mean": mean, "ci95": [low, high]}

    return ci


def summarize(records: list[dict[str, Any]], resamples: int = 2000,
              seed: int = 0) -> dict[str, Any]:
    ci = paired_ci(len(records), resamples, seed)
    base = [r["block_attention"]["kl"] for r in records]
    out: dict[str, Any] = {}
    for name in ("block_attention", "layout_full"):
        rows = [r[name] for r in records]
        out[name] = {"kl": ci([x["kl"] for x in rows]),
                     "kl_top20": ci([x["kl_top20"] for x in rows]),
                     "top1": ci([x["top1"] for x in rows]),
                     "answer_agree": float(np.mean([x["answer_agree"] for x in rows]))}
    out["layout_full"]["kl_minus_block"] = ci([r["layout_full"]["kl"] - b
                                               for r, b in zip(records, base, strict=True)])
    for key in records[0]["configs"]:
        rows = [r["configs"][key] for r in records]
        kl = [x["kl"] for x in rows]
        out[key] = {"kl": ci(kl), "kl_minus_block": ci([a - b for a, b in zip(kl, base,
                                                                              strict=True)]),
                    "kl_top20": float(np.mean([x["kl_top20"] for x in rows])),
                    "top1": ci([x["top1"] for x in rows]),
                    "top1_minus_block": ci([x["top1"] - r["block_attention"]["top1"]
                                            for x, r in zip(rows, records, strict=True)]),
                    "answer_agree": float(np.mean([x["answer_agree"] for x in rows])),
                    "recomputed": float(np.mean([x["recomputed"] for x in rows]))}
    return out


def _fmt_ci(entry: dict[str, Any], scale: float = 1.0, digits: int = 3) -> str:
    low, high = (x * scale for x in entry["ci95"])
    return f"{entry['mean'] * scale:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def checks_line(meta: dict[str, Any], describe: Callable[[dict[str, Any]], str]) -> list[str]:
    """A table's last line when the run made the ``--check`` measurements: ``describe`` of
    their maxima over the items (none without ``--check``)."""
    if "check" not in meta:
        return []
    return [f"checks (max over items): {describe(meta['check'])}"]


def table(report: dict[str, Any]) -> str:
    s = report["summary"]
    meta = report["meta"]
    lines = [f"n = {meta['n']} items, {meta['model_name']}; KL(full || mode) over the full "
             f"vocabulary, mean over the full-attention answer tokens (teacher-forced); 95% "
             f"paired bootstrap CIs; ΔKL vs block_attention",
             "",
             "| signal | granularity | budget | recomputed | KL [CI] | ΔKL vs block [CI] "
             "| top-1 % [CI] | argmax = A % |",
             "|---|---|---|---|---|---|---|---|"]
    for name in ("block_attention", "layout_full"):
        e = s[name]
        delta = _fmt_ci(e["kl_minus_block"]) if "kl_minus_block" in e else "—"
        label = "none (block_attention)" if name == "block_attention" else "all (layout_full)"
        share = "0%" if name == "block_attention" else "100%"
        lines.append(f"| {label} | — | — | {share} | {_fmt_ci(e['kl'])} | {delta} | "
                     f"{_fmt_ci(e['top1'], 100, 1)} | {e['answer_agree'] * 100:.1f} |")
    for key, e in s.items():
        if "|" not in key:
            continue
        name, gran, budget = key.split("|")
        lines.append(f"| {name} | {gran} | {budget} | {e['recomputed'] * 100:.1f}% | "
                     f"{_fmt_ci(e['kl'])} | {_fmt_ci(e['kl_minus_block'])} | "
                     f"{_fmt_ci(e['top1'], 100, 1)} | {e['answer_agree'] * 100:.1f} |")
    lines += ["", f"block_attention top-20 KL (eval's estimator): "
                  f"{s['block_attention']['kl_top20']['mean']:.3f}; "
                  f"{meta['seconds_per_item']:.1f} s per item on {meta['threads']} thread(s)"]
    lines += checks_line(meta, lambda c: (
        f"budget 0 vs block pass {c['budget0_max_abs_logprob_diff']:.2g}, all recomputed vs "
        f"full causal {c['all_max_abs_logprob_diff']:.2g}, half the spans whole vs single "
        f"mixed-mask pass {c['whole_spans_max_abs_logprob_diff']:.2g} (max |Δ logprob|); "
        f"single mixed-mask pass vs engine semantics ({c['mixed_mask_vs_engine_selection']}): "
        f"KL up to {c['mixed_mask_vs_engine_kl']:.3f}, |Δ logprob| up to "
        f"{c['mixed_mask_vs_engine_max_abs_logprob_diff']:.2f}"))
    return "\n".join(lines)


def plot(report: dict[str, Any], plt: Any) -> Any:
    """The KL-vs-budget figure (``plt``: pyplot; ``write_report`` saves it)."""
    s = report["summary"]
    fig, ax = plt.subplots(figsize=(8, 5))
    budgets = report["meta"]["budgets"]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    base = s["block_attention"]["kl"]["mean"]
    xs = [0.0, *budgets] if 0 not in budgets else budgets
    for i, name in enumerate(report["meta"]["signals"]):
        for gran, style in zip(GRANULARITIES, ("-", "--"), strict=True):
            ys = [s[f"{name}|{gran}|{b:g}"]["kl"]["mean"] for b in budgets]
            ys = [base, *ys] if len(xs) > len(budgets) else ys  # budget 0 = block_attention
            ax.plot(xs, ys, style, marker="o", ms=3, color=colors[i % len(colors)],
                    label=f"{name} ({gran})")
    ax.axhline(base, color="black", lw=1,
               label="block_attention (nothing recomputed)")
    ax.axhline(s["layout_full"]["kl"]["mean"], color="gray", lw=1, ls=":",
               label="everything recomputed (layout_full)")
    ax.set_xlabel("budget (share of span content tokens recomputed)")
    ax.set_ylabel("mean KL(full || selective) per answer token")
    ax.set_title(f"Selective recompute signals, n = {report['meta']['n']}")
    ax.set_xlim(left=0)
    ax.legend(fontsize=7, ncol=2, loc="best")
    return fig


# ---------------------------------------------------------------------------------------------
# the run: options, set-up, items, report (benchmarks/layout_levers.py's too)
# ---------------------------------------------------------------------------------------------


def argument_parser(doc: str | None) -> argparse.ArgumentParser:
    """A script's parser: its module docstring as the description, line breaks kept."""
    return argparse.ArgumentParser(description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def add_fidelity_items(ap: argparse.ArgumentParser, *, seed_help: str) -> None:
    """The item options of the scripts that read the fidelity table's items (``--n`` 300,
    ``--data`` results/fidelity/items.jsonl, ``--seed``, ``--passages``, ``--max-words``,
    ``--max-tokens`` 10, as results/fidelity)."""
    ap.add_argument("--n", type=int, default=300, help="items: the first N (default 300)")
    ap.add_argument("--data", default="results/fidelity/items.jsonl",
                    help="a .jsonl of {id, question, documents, answer?, system?} (default "
                         "results/fidelity/items.jsonl, the fidelity table's 300 items), or "
                         "builtin / fanoutqa / squad as minipic eval (with --seed, --passages, "
                         "--max-words)")
    ap.add_argument("--seed", type=int, default=0, help=seed_help)
    ap.add_argument("--passages", default="3-10", help="documents per built-in item, MIN-MAX")
    ap.add_argument("--max-words", type=int, default=80, help="built-in passages' cut (80)")
    ap.add_argument("--max-tokens", type=int, default=10,
                    help="greedy answer length A (default 10, as results/fidelity)")


def parse_common(ap: argparse.ArgumentParser, argv: Sequence[str] | None, *, check_help: str,
                 out: str) -> argparse.Namespace:
    """``ap`` with the options every script of this kind ends with (``--model``, ``--threads``,
    ``--check``, ``--out``), parsed; ``--passages`` MIN-MAX becomes ``(MIN, MAX)``."""
    ap.add_argument("--model", default=None, help="model folder (default SmolLM2-135M)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--check", action="store_true", help=check_help)
    ap.add_argument("--out", type=Path, default=Path(out), help=f"output folder (default {out})")
    args = ap.parse_args(argv)
    low, _, high = args.passages.partition("-")
    args.passages = (int(low), int(high or low))
    return args


def setup(args: argparse.Namespace, attn: str,
          attention: Callable[..., Any]) -> tuple[float, str, Any, Any]:
    """What a run needs before its first item: ``--threads``; the model folder (``--model``,
    default SmolLM2-135M); the engine's PromptBuilder for it (the model's span config, blocks of
    32, max_model_len 2048: the SDK's real layouts); the fp32 eager model of
    ``tests/support/pic_reference.py`` with ``attention`` as its attention function (``attn``).
    Returned first: the start of the run's clock, after the imports, as ``wall_s`` counts."""
    if args.threads:
        torch.set_num_threads(args.threads)
    from support.pic_reference import PicReference

    from minipic.prompt_builder import PromptBuilder
    from minipic.span_contract.models import resolve_model
    from minipic.span_contract.special_tokens import span_config_for_model

    started = time.perf_counter()
    model_dir = resolve_model(args.model)
    span = span_config_for_model(model_dir, 32)
    builder = PromptBuilder.from_pretrained(model_dir, block_size=32, ssep_id=span.ssep_id,
                                            pdep_id=span.pdep_id, pad_id=span.pad_id,
                                            max_model_len=2048)
    model = PicReference(model_dir).model
    register_attention(model, attn, attention)
    return started, model_dir, builder, model


def load_items(args: argparse.Namespace) -> tuple[list[Any], list[dict[str, Any]]]:
    """The first ``--n`` items of ``--data`` (a .jsonl, or a built-in set as minipic eval with
    ``--seed``, ``--passages``, ``--max-words``) and the file's bad lines."""
    from minipic.eval.datasets import builtin_items, load_jsonl

    if args.data.endswith(".jsonl"):
        loaded = load_jsonl(args.data)
        return loaded.items[: args.n], list(loaded.errors)
    return builtin_items(args.data, args.n, args.seed, args.passages, args.max_words), []


def run_items(args: argparse.Namespace, evaluate: Callable[[int, Any], dict[str, Any]],
              started: float, time_limit: float | None = None,
              done: Mapping[str, dict[str, Any]] | None = None
              ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    """The first ``--n`` items of ``--data`` (a .jsonl, or a built-in set as minipic eval with
    ``--seed``, ``--passages``, ``--max-words``), each through ``evaluate(index, item)``; with
    ``time_limit`` (minutes since ``started``) no item starts after it. ``done``: records of an
    earlier run of the same settings by item id (:func:`earlier_records`), kept instead of run
    again (each item's index is its place in the file, so a resumed run computes what one
    uninterrupted run would). Returns the records, the errors (the file's bad lines, then the
    items that failed) and how many items there were; says so when no item ran."""
    from tqdm import tqdm

    items, errors = load_items(args)
    records = []
    for index, item in enumerate(tqdm(items, desc="items", unit="item")):
        if done and item.id in done:
            records.append(done[item.id])
            continue
        if time_limit and time.perf_counter() - started > time_limit * 60:
            print(f"--time-limit: stopped after {len(records)} items")
            break
        try:
            records.append(evaluate(index, item))
        except AssertionError:  # a --check failed: the run is wrong, not the item
            raise
        except Exception as exc:  # one bad item (too long, ...) never loses the others
            errors.append({"id": item.id, "error": f"{type(exc).__name__}: {exc}"[:500]})
    if not records:
        print(f"no item ran: {errors}")
    return records, errors, len(items)


def earlier_records(path: Path, meta: Mapping[str, Any], keys: Sequence[str]
                    ) -> dict[str, dict[str, Any]]:
    """The per-item records of an earlier report at ``path`` (``--resume``), by item id: empty
    when there is none; refused (``SystemExit`` with the reason) when it was run with other
    values of ``keys`` than ``meta`` holds, since its items would not pair with new ones."""
    if not path.is_file():
        print(f"--resume: no {path}, starting from the first item")
        return {}
    old = json.loads(path.read_text())
    differ = [k for k in keys if old["meta"].get(k) != meta.get(k)]
    if differ:
        raise SystemExit(f"--resume: {path} was run with other {differ} "
                         f"({[old['meta'].get(k) for k in differ]}); use another --out")
    print(f"--resume: {len(old['items'])} items kept from {path}")
    return {r["id"]: r for r in old["items"]}


def run_meta(records: list[dict[str, Any]], wall: float, *,
             processor: bool = False) -> dict[str, Any]:
    """The meta's machine and times: the machine (``processor``: with ``platform.processor()``,
    which layout_levers records), torch's threads, the wall time, the mean seconds per item and
    the mean of every per-item timing."""
    machine = {"platform": platform.platform(), "cpu": platform.machine()}
    if processor:
        machine["processor"] = platform.processor()
    machine.update(cpus=os.cpu_count(), python=platform.python_version(),
                   torch=torch.__version__)
    return {"machine": machine, "threads": torch.get_num_threads(), "wall_s": wall,
            "seconds_per_item": float(np.mean([r["timing"]["item_s"] for r in records])),
            "timing_mean": {k: float(np.mean([r["timing"][k] for r in records]))
                            for k in records[0]["timing"]}}


def write_report(out: Path, stem: str, meta: dict[str, Any], summary: dict[str, Any],
                 errors: list[dict[str, Any]], records: list[dict[str, Any]],
                 table: Callable[[dict[str, Any]], str], plot: Callable[[dict[str, Any], Any], Any],
                 wall: float) -> None:
    """``<stem>.json`` (meta, summary, errors, per-item records; NaN / inf as null),
    ``<stem>.md`` (``table(report)``, printed too) and ``<stem>.png`` (``plot(report, pyplot)``'s
    figure) in ``out``."""
    from minipic.eval.runner import finite

    report = {"meta": meta, "summary": summary, "errors": errors, "items": records}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(finite(report), indent=1))
    text = table(report)
    (out / f"{stem}.md").write_text(text + "\n")
    import matplotlib  # only now: the JSON and the table are written whatever matplotlib does

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plot(report, plt)
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=130)
    plt.close(fig)
    print(text)
    if errors:
        print(f"{len(errors)} item(s) failed: {errors}")
    print(f"wrote {out}/{stem}.json, .md, .png in {wall:.0f} s")


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argument_parser(__doc__)
    ap.add_argument("--n", type=int, default=60, help="items (default 60)")
    ap.add_argument("--seed", type=int, default=0,
                    help="data seed (minipic eval's: same items and distractors) and the seed "
                         "of the random signal (default 0)")
    ap.add_argument("--data", default="builtin",
                    help="builtin (fanoutqa + SQuAD 1.1 dev), fanoutqa, squad (as minipic "
                         "eval), or a .jsonl of {question, documents, answer?, system?} "
                         "(default builtin)")
    ap.add_argument("--passages", default="3-10", help="documents per built-in item, MIN-MAX")
    ap.add_argument("--max-words", type=int, default=80, help="built-in passages' cut (80)")
    ap.add_argument("--budgets", default="0.05,0.1,0.15,0.25",
                    help="comma-separated shares of span content tokens to recompute "
                         "(default 0.05,0.1,0.15,0.25)")
    ap.add_argument("--signals", default=None,
                    help="comma-separated subset of the signals (default: all)")
    ap.add_argument("--attn-layer", type=int, default=None,
                    help="layer of the single-layer question_attention signal (default: "
                         "30%% of the depth, layer 9 of SmolLM2-135M's 30)")
    ap.add_argument("--max-tokens", type=int, default=16, help="answer length (default 16)")
    args = parse_common(ap, argv, out="results/selective_signal",
                        check_help="per item (~4 extra passes): assert budget 0 == block pass, "
                                   "all recomputed == full causal pass, half the spans "
                                   "recomputed whole == the single mixed-mask pass; measure "
                                   "that pass's deviation otherwise")
    args.budgets = [float(b) for b in args.budgets.split(",") if b]
    if not args.budgets or not all(0 <= b <= 1 for b in args.budgets):
        ap.error("--budgets: shares in [0, 1]")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started, model_dir, builder, model = setup(args, ATTN, probe_attention)
    layers = model.config.num_hidden_layers
    if args.attn_layer is None:
        args.attn_layer = round(0.3 * layers)
    if not 0 <= args.attn_layer < layers:
        raise SystemExit(f"--attn-layer must be in [0, {layers})")
    known = ["question_attention_all", f"question_attention_L{args.attn_layer}",
             "kv_deviation_k", "kv_deviation_v", *CONTROL_SIGNALS]
    args.signals = known if args.signals is None else args.signals.split(",")
    if unknown := [s for s in args.signals if s not in known]:
        raise SystemExit(f"unknown signals {unknown}; known: {known}")

    records, errors, _ = run_items(
        args, lambda index, item: evaluate_item(model, builder, item, index, args), started)
    if not records:
        return 1
    wall = time.perf_counter() - started
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "n": len(records), "seed": args.seed, "data": args.data, "model": model_dir,
        "model_name": Path(model_dir).name, "dtype": "float32", "block_size": 32,
        "budgets": args.budgets, "signals": args.signals, "granularities": list(GRANULARITIES),
        "attn_layer": args.attn_layer, "kv_layer": KV_LAYER, "max_tokens": args.max_tokens,
        **run_meta(records, wall),
        "semantics": "selected span content tokens recomputed in context over the cached "
                     "(block-isolated) K/V of every other position, all layers; KL over the "
                     "full vocabulary",
    }
    if args.check:
        meta["check"] = {k: max(r["check"][k] for r in records) for k, v in
                         records[0]["check"].items() if isinstance(v, float)}
        meta["check"]["mixed_mask_vs_engine_selection"] = records[0]["check"][
            "mixed_mask_vs_engine_selection"]
    write_report(args.out, "selective_signal", meta, summarize(records, seed=args.seed), errors,
                 records, table, plot, wall)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
