"""Layout levers (issue 46): what the model sees of the PIC layout, measured in transformers
(no vLLM, no engine), one teacher-forced pass per item and lever.

    python benchmarks/layout_levers.py --threads 2                  # the 300 fidelity items
    python benchmarks/layout_levers.py --n 2 --threads 1 --check    # smoke

Per item (``results/fidelity/items.jsonl`` by default, the items of ``results/fidelity/``; fp32
SmolLM2-135M; the SDK's real layouts without their sink, which the sink variants place
themselves, blocks of 32, max_model_len 2048):

* **reference p**: full attention on the plain prompt (the ``prefix`` layout: no markers, no
  pads), its greedy answer ``A`` (``--max-tokens``, EOS included when produced) and the
  teacher-forced next-token distributions over ``A``.
* the **block_attention layout** + ``A``, teacher-forced, one forward pass per variant, each an
  explicit 4-D attention mask and explicit position ids (``benchmarks/selective_signal.py``'s
  pass, whose attention function this script extends):

  1. ``today``: the reference of ``tests/support/pic_reference.py``: a span run (SSEP .. end of
     its padding) attends only within itself, everything else causally to everything before it,
     physical positions. Every query sees the SSEP / PDEP / PAD tokens before it.
  2. ``invisible`` (the issue's rule 1, attention half): SSEP, PDEP and PAD are attended by no
     query but their own (each attends only to itself, so its row is never empty); real tokens
     attend real tokens as the block mask allows; physical positions.
  3. ``invisible+logical``: as 2, and every real token takes the position the plain prompt gives
     it (a layout token takes the position of the next real token; it is invisible, so which
     one does not matter).
  4. ``invisible+logical+sink``: as 3, and every span's tokens also see the **sink**: the real
     prompt's own opening, i.e. the plain prompt's tokens before the first document (the system
     segment: the chat template's head, the system prompt, the user-turn header; 24 tokens for
     SmolLM2's default system prompt; its first token ``<|im_start|>`` is the tokenizer's BOS,
     which the template writes, so there is no separate BOS). One shared prefix, at its real
     positions: a span at plain offset ``o`` sees it at distance ``o``, as in full attention.
     In the final prompt this costs **no extra KV** (the opening is in every prompt already), but
     a span's KV then depends on its offset: not position-independent, an upper reference.
  4b. ``invisible+logical+sink_adjacent``: the position-independent form (APE's shared prefix
     with virtual positions): every span sees the same opening as if the span followed it
     directly (the span's tokens at their plain positions, the opening's keys at the ``S``
     positions just before the span's first real token). Implemented as a private copy of the
     opening per span in the same pass, visible to that span only; in an engine it is the span
     prefill ``[opening][span]`` whose opening blocks are one cached prefix shared by every span
     prefill: **0 extra KV per span in the final prompt** (the span's cached KV is as large as
     today's), ``S`` tokens of (prefix-cached) prefill context per span prefill.
  4d. ``invisible+logical+sink_adjacent+gap<G>`` (``--gaps``, issue 55): as 4b with ``G``
     virtual positions between the copy and the span's first real token (the copy at the ``S``
     positions ending ``G`` before it). Still position-independent: RoPE is relative, and ``G``
     is one constant of the layout. ``--gaps mean`` is the run's mean distance from the opening's
     end to a span's first real token in the plain prompt (the distance the ``sink`` variant
     gives, averaged over every span of the run's items).
  4c. ``invisible+logical+bos_adjacent``: as 4b with the opening's first token only
     (``<|im_start|>``, the BOS), just before each span: the smallest sink.
  5. ``<4 or 4b>+temp<T>``: 4 (and 4b, ``--temp-bases``), plus APE's attention temperature on
     the question's attention to span keys: the logits of every question and answer row (PDEP
     onwards) to span-content keys (not the opening, not the question) are divided by ``T``
     (``--temps``; 1.1 is there to show the direction); ``--scales S`` adds APE's scale as
     ``log S`` on the same logits (after the temperature). A temperature is no additive bias, so
     it is a custom attention function registered through transformers' ``AttentionInterface``
     (eager attention with a per-(query, key) logit multiplier). Rows before the question never
     see a question key, so only the question and answer rows are computed again, over the base
     pass's cached K/V (``--check`` asserts it equals the whole pass).

  And ``all_recomputed``: the same padded layout with every token computed in context (no span
  isolation) under ``today`` (the known floor of selective_signal's ``layout_full``), under
  ``invisible`` and under ``invisible+logical``, which must equal the plain prompt to float noise
  (``--check`` asserts it).

In the rule-1 passes (2-4c) the invisible layout tokens are left out of the pass by default:
exact (they attend only to themselves and nothing attends to them; ``--check`` asserts it),
and ~18% fewer tokens; ``--keep-layout-tokens`` keeps them.

Metrics per variant (``selective_signal.compare``): KL(p || variant) over the full vocabulary,
mean over the answer tokens; eval's top-20 KL; top-1 agreement with p; greedy agreement (the
variant's argmax is A's token); ``greedy = full``: every answer token agrees, i.e. free-running
greedy decoding under the variant reproduces A exactly (the fidelity table's column). Paired
bootstrap 95% CIs (eval's helper, one index set for the whole run) of the KL difference vs
``today`` and vs the variant each lever builds on.

Writes ``levers.json`` (meta, per-variant summary, per-item records), ``levers.md`` and
``levers.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

import selective_signal as ss  # noqa: E402  (after the path set-up)

ATTN = "minipic_layout_levers"
TODAY = "today"
INV = "invisible"
LOG = "invisible+logical"
SINK = "invisible+logical+sink"
ADJ = "invisible+logical+sink_adjacent"
BOS = "invisible+logical+bos_adjacent"
ALL = "all_recomputed"


# ---------------------------------------------------------------------------------------------
# attention: selective_signal's probe (plain eager when idle), or eager with a logit multiplier
# ---------------------------------------------------------------------------------------------


@dataclass
class LogitScale:
    """``mult``/``bias`` ``[q, k]`` applied to the scaled logits in the pass in flight."""

    mult: torch.Tensor | None = None
    bias: torch.Tensor | None = None


SCALE = LogitScale()


def lever_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                    **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Eager attention with ``logits * mult + bias`` before the mask (APE's temperature and
    scale), over selective_signal's cached keys when it has some; selective_signal's probe
    attention when no multiplier is set."""
    if SCALE.mult is None:
        return ss.probe_attention(module, query, key, value, attention_mask, scaling, dropout,
                                  **kwargs)
    from transformers.models.llama.modeling_llama import repeat_kv

    probe = ss.PROBE
    if probe.active and probe.cached_k is not None and probe.cached_v is not None:
        key = torch.cat([probe.cached_k[module.layer_idx], key], dim=2)
        value = torch.cat([probe.cached_v[module.layer_idx], value], dim=2)
    keys = repeat_kv(key, module.num_key_value_groups)
    values = repeat_kv(value, module.num_key_value_groups)
    logits = torch.matmul(query, keys.transpose(2, 3)) * scaling * SCALE.mult
    if SCALE.bias is not None:
        logits = logits + SCALE.bias
    if attention_mask is not None:
        logits = logits + attention_mask
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, values).transpose(1, 2).contiguous(), None


# ---------------------------------------------------------------------------------------------
# the layout of one item, and each variant's pass
# ---------------------------------------------------------------------------------------------


@dataclass
class Item:
    """The block_attention layout of one item + A, with what each position is."""

    ids: list[int]  # block_attention prompt + A
    prompt_len: int
    question_start: int  # the PDEP
    runs: list[tuple[int, int]]  # isolated span runs: SSEP .. end of padding
    layout: np.ndarray  # bool: SSEP, PDEP or PAD
    logical: np.ndarray  # the plain prompt's position (layout tokens: the next real token's)
    run_of: np.ndarray  # index of the span run (-1: not in a span)
    sink: np.ndarray  # positions of the opening (the plain prompt before the first document)

    @property
    def total(self) -> int:
        return len(self.ids)

    @property
    def rows(self) -> range:
        return range(self.prompt_len - 1, self.total - 1)

    @property
    def real(self) -> np.ndarray:
        return ~self.layout


def item_of(built: Any, plain: Any, answer: list[int]) -> Item:
    """Where the layout tokens are, and the plain position of every real token; asserts the
    real tokens are the plain prompt, token for token."""
    from support.pic_reference import span_part_runs

    prompt = list(built.prompt_token_ids)
    ids = prompt + answer
    layout = np.zeros(len(ids), dtype=bool)
    for seg in built.segments:
        if seg.kind == "pad":
            layout[seg.start:seg.end] = True
        elif seg.marker is not None:
            layout[seg.start] = True
    real_ids = [t for t, lay in zip(prompt, layout, strict=False) if not lay]
    if real_ids != list(plain.prompt_token_ids):
        raise AssertionError("block_attention minus its layout tokens is not the plain prompt")
    logical = np.empty(len(ids), dtype=np.int64)
    logical[~layout] = np.arange(int((~layout).sum()))
    nxt = int(logical[~layout][-1]) + 1
    for i in range(len(ids) - 1, -1, -1):  # a layout token: the next real token's position
        if layout[i]:
            logical[i] = nxt
        else:
            nxt = int(logical[i])
    runs = [(a, b) for a, b, _ in span_part_runs(built)]
    run_of = np.full(len(ids), -1, dtype=np.int64)
    for k, (a, b) in enumerate(runs):
        run_of[a:b] = k
    first_doc = min(seg.start for seg in plain.segments if seg.kind == "span")
    sink = np.flatnonzero(~layout & (logical < first_doc) & (run_of < 0))
    question = [s for s in built.segments if s.kind == "question"]
    assert len(question) == 1 and question[0].marker == "pdep"
    assert sink.size == first_doc and (sink < runs[0][0]).all()
    return Item(ids=ids, prompt_len=len(prompt), question_start=question[0].start, runs=runs,
                layout=layout, logical=logical, run_of=run_of, sink=sink)


def invisible(allowed: torch.Tensor, it: Item) -> torch.Tensor:
    """No query attends to a layout token but the token itself."""
    out = allowed & torch.as_tensor(it.real)[None, :]
    out.fill_diagonal_(True)
    return out


def with_sink(allowed: torch.Tensor, it: Item) -> torch.Tensor:
    """Every span's real tokens also see the opening, at its real positions."""
    out = allowed.clone()
    span_rows = torch.as_tensor(np.flatnonzero((it.run_of >= 0) & it.real))
    cols = torch.as_tensor(it.sink)
    out[span_rows[:, None], cols[None, :]] = True
    return out


@dataclass
class Pass:
    """One forward pass: tokens, positions, mask, and each token's index in the item (-1: a
    private sink copy)."""

    ids: list[int]
    pos: list[int]
    allowed: torch.Tensor
    src: np.ndarray

    def rows(self, it: Item) -> list[int]:
        where = {int(s): j for j, s in enumerate(self.src) if s >= 0}
        return [where[r] for r in it.rows]


def make_pass(it: Item, positions: Sequence[int], allowed: torch.Tensor, *,
              drop_layout: bool, extra_ids: Sequence[int] = (),
              extra_pos: Sequence[int] = ()) -> Pass:
    """The item's tokens (+ ``extra`` tokens after them; ``allowed`` covers both). With
    ``drop_layout`` the layout tokens leave the pass: exact when the mask makes them invisible
    (they attend only to themselves and nothing attends to them), and ~18% fewer tokens."""
    ids = [*it.ids, *extra_ids]
    pos = [*positions, *extra_pos]
    src = np.concatenate([np.arange(it.total), np.full(len(extra_ids), -1)])
    keep = np.ones(len(ids), dtype=bool)
    if drop_layout:
        keep[: it.total] = it.real
    idx = np.flatnonzero(keep)
    t = torch.as_tensor(idx)
    return Pass(ids=[ids[i] for i in idx], pos=[pos[i] for i in idx],
                allowed=allowed[t][:, t], src=src[idx])


def adjacent_sink(it: Item, allowed: torch.Tensor, drop_layout: bool, size: int | None = None,
                  gap: int = 0) -> Pass:
    """``allowed`` (invisible+logical) plus a private copy of the opening (its first ``size``
    tokens; default all) per span, after the answer: copy k sits at the positions ending
    ``gap`` before span k's first real token, attends causally within itself, and only span
    k's real tokens see it. Its positions may be negative: RoPE rotates by any integer, and
    only the distances count."""
    sink = it.sink[:size]
    s = len(sink)
    sink_ids = [it.ids[i] for i in sink]
    extra_ids: list[int] = []
    extra_pos: list[int] = []
    total = it.total + len(it.runs) * s
    out = torch.zeros(total, total, dtype=torch.bool)
    out[: it.total, : it.total] = allowed
    block = torch.ones(s, s, dtype=torch.bool).tril()
    for a, b in it.runs:
        members = np.flatnonzero(it.real[a:b]) + a
        start = int(it.logical[members[0]]) - gap
        base = it.total + len(extra_ids)
        extra_ids += sink_ids
        extra_pos += range(start - s, start)
        out[base:base + s, base:base + s] = block
        out[torch.as_tensor(members)[:, None], torch.arange(base, base + s)[None, :]] = True
    return make_pass(it, it.logical.tolist(), out, drop_layout=drop_layout,
                     extra_ids=extra_ids, extra_pos=extra_pos)


def run(model: Any, ps: Pass, it: Item, record: bool = False) -> torch.Tensor:
    """``selective_signal.forward`` of the pass: log-softmax over A's rows (with ``record``:
    every layer's post-RoPE K/V stay in ``selective_signal.PROBE``)."""
    layers = range(model.config.num_hidden_layers) if record else ()
    return ss.forward(model, ps.ids, ps.pos, ps.allowed, ps.rows(it), record_layers=layers)


def ape_pass(model: Any, ps: Pass, it: Item, temp: float, scale: float,
             kv: tuple[list[torch.Tensor], list[torch.Tensor]] | None) -> torch.Tensor:
    """``ps`` with the logits of every question / answer row (PDEP onwards) to span-content
    keys divided by ``temp`` and ``log(scale)`` added. The temperature leaves every row before
    the question as it is, so with ``kv`` (the K/V ``ps`` recorded) only the question and
    answer rows are computed, over the cached K/V of everything before them (exact: the
    cached rows never see a question key); without it, the whole pass again."""
    main = ps.src >= 0
    end = int(main.sum())
    assert main[:end].all()  # the item's tokens first, sink copies after them
    first = int(np.argmax(ps.src >= it.question_start))
    src = ps.src[:end]
    cols = torch.as_tensor((it.run_of[src] >= 0) & it.real[src])
    lo = first if kv is not None else 0
    hit = torch.as_tensor(src[lo:] >= it.question_start)[:, None] & cols[None, :]
    mult = torch.ones(hit.shape).masked_fill_(hit, 1.0 / temp)
    bias = None if scale == 1 else torch.zeros(hit.shape).masked_fill_(hit, math.log(scale))
    cached = None
    if kv is not None:
        idx = torch.arange(first)
        cached = ([k[:, :, idx] for k in kv[0]], [v[:, :, idx] for v in kv[1]])
    rows = [r - lo for r in ps.rows(it)]
    SCALE.mult, SCALE.bias = mult, bias
    try:
        if kv is None:
            total = len(ps.ids)
            pad = torch.ones(total, total)
            pad[:end, :end] = mult
            SCALE.mult = pad
            if bias is not None:
                SCALE.bias = torch.zeros(total, total)
                SCALE.bias[:end, :end] = bias
            return ss.forward(model, ps.ids, ps.pos, ps.allowed, rows)
        return ss.forward(model, ps.ids[lo:end], ps.pos[lo:end], ps.allowed[lo:end, :end], rows,
                          cached=cached)
    finally:
        SCALE.mult = SCALE.bias = None


def temp_name(base: str, temp: float, scale: float) -> str:
    return f"{base}+temp{temp:g}" + ("" if scale == 1 else f"+scale{scale:g}")


LEVERS = (TODAY, INV, LOG, SINK, ADJ, BOS, f"{ALL}@{TODAY}", f"{ALL}@{INV}", f"{ALL}@{LOG}")


def gap_name(gap: int) -> str:
    return f"{ADJ}+gap{gap}"


def variant_names(args: argparse.Namespace) -> list[str]:
    """Every reported variant, in table order: the chosen ``--levers`` (``today`` always), the
    gaps after ``sink_adjacent``, the temperatures, everything recomputed last."""
    chosen = [name for name in LEVERS if name in args.levers]
    names = [name for name in chosen if not name.startswith(ALL)]
    names += [gap_name(g) for g in args.gaps]
    names += [temp_name(b, t, s) for b in args.temp_bases for t in args.temps
              for s in args.scales]
    return names + [name for name in chosen if name.startswith(ALL)]


def parent_of(name: str) -> str | None:
    """The variant a lever builds on (its paired ΔKL in the table)."""
    for base in (ADJ, SINK):
        if name.startswith(f"{base}+"):
            return base
    return {INV: TODAY, LOG: INV, SINK: LOG, ADJ: LOG, BOS: LOG, f"{ALL}@{INV}": f"{ALL}@{TODAY}",
            f"{ALL}@{LOG}": f"{ALL}@{INV}"}.get(name)


# ---------------------------------------------------------------------------------------------
# one item
# ---------------------------------------------------------------------------------------------


def evaluate_item(model: Any, builder: Any, item: Any, args: argparse.Namespace,
                  reference: Any = None) -> dict[str, Any]:
    from support.pic_reference import block_attention_allowed

    timing: dict[str, float] = {}
    t0 = time.perf_counter()
    plain, built, answer, p = ss.reference_pass(model, builder, item, args.max_tokens, timing,
                                                "reference_pass_s")
    it = item_of(built, plain, answer)
    n = it.total
    drop = not args.keep_layout_tokens
    physical, logical = list(range(n)), it.logical.tolist()
    block = block_attention_allowed(n, it.runs)
    causal = ss.causal(n)
    inv_block = invisible(block, it)
    build = {
        TODAY: lambda: make_pass(it, physical, block, drop_layout=False),
        INV: lambda: make_pass(it, physical, inv_block, drop_layout=drop),
        LOG: lambda: make_pass(it, logical, inv_block, drop_layout=drop),
        SINK: lambda: make_pass(it, logical, with_sink(inv_block, it), drop_layout=drop),
        ADJ: lambda: adjacent_sink(it, inv_block, drop),
        BOS: lambda: adjacent_sink(it, inv_block, drop, size=1),
        f"{ALL}@{TODAY}": lambda: make_pass(it, physical, causal, drop_layout=False),
        f"{ALL}@{INV}": lambda: make_pass(it, physical, invisible(causal, it), drop_layout=drop),
        # kept whole: with the layout tokens in the pass, this is the rule-1 invariant
        f"{ALL}@{LOG}": lambda: make_pass(it, logical, invisible(causal, it), drop_layout=False),
    }
    passes = {name: build[name]() for name in LEVERS if name in args.levers}
    for gap in args.gaps:
        passes[gap_name(gap)] = adjacent_sink(it, inv_block, drop, gap=gap)
    q: dict[str, torch.Tensor] = {}
    kv: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    layers = model.config.num_hidden_layers
    t = time.perf_counter()
    for name, ps in passes.items():
        q[name] = run(model, ps, it, record=name in args.temp_bases)
        if name in args.temp_bases:
            kv[name] = ([ss.PROBE.keys[i] for i in range(layers)],
                        [ss.PROBE.values[i] for i in range(layers)])
    timing["variant_passes_s"] = time.perf_counter() - t
    timing["pass_s"] = timing["variant_passes_s"] / len(passes)
    t = time.perf_counter()
    for base in args.temp_bases:
        for temp in args.temps:
            for scale in args.scales:
                q[temp_name(base, temp, scale)] = ape_pass(model, passes[base], it, temp, scale,
                                                           kv[base])
    timing["ape_passes_s"] = time.perf_counter() - t

    variants = {}
    for name, qv in q.items():
        m = ss.compare(p, qv, answer)
        m["greedy_same"] = float(m["answer_agree"] == 1.0)
        variants[name] = m
    record: dict[str, Any] = {
        "id": item.id, "documents": len(item.documents),
        "prefix_tokens": len(plain.prompt_token_ids),
        "layout_tokens": it.prompt_len, "layout_only_tokens": int(it.layout[: it.prompt_len]
                                                                   .sum()),
        "sink_tokens": len(it.sink), "answer_tokens": len(answer),
        "sink_starts_with_bos": it.ids[int(it.sink[0])] == builder.tokenizer.bos_token_id,
        "answer": builder.decode(answer), "variants": variants,
    }
    check = (lambda: checks(model, p, q, it, passes, kv, args, reference)) if args.check else None
    return ss.finish_record(record, timing, t0, check)


CHECK_KL = 1e-5  # KL(plain || everything recomputed, markers invisible, logical positions)
CHECK_LOGPROB = 1e-3  # max |Δ logprob| of two computations of the same thing


def checks(model: Any, p: torch.Tensor, q: dict[str, torch.Tensor], it: Item,
           passes: dict[str, Pass], kv: dict[str, Any], args: argparse.Namespace,
           reference: Any) -> dict[str, float]:
    """Asserted: (i) all_recomputed under rule 1 (markers invisible, logical positions, the
    layout tokens in the pass) == the plain prompt (float noise); (ii) ``today`` ==
    ``tests/support/pic_reference.py``'s own pass (``PicReference.logprobs`` on a separate eager
    model, not this script's attention function); (iii) dropping the invisible layout tokens
    from a pass changes nothing (``invisible+logical+sink_adjacent`` with them); (iv) the
    question-only APE pass over cached K/V == the whole pass again (``temp`` = the first of
    ``--temps``), and with ``temp`` 1 == its base pass. Recorded only: how far the shared sink
    at real positions is from the position-independent private copy."""
    from support.pic_reference import block_attention_allowed

    rec = q[f"{ALL}@{LOG}"]
    kl = (p.exp() * (p - rec)).sum(-1)
    ref = reference.logprobs(it.ids, it.runs)[list(it.rows)]
    kept = adjacent_sink(it, invisible(block_attention_allowed(it.total, it.runs), it), False)
    out = {
        "all_recomputed_logical_kl_max": float(kl.max()),
        "all_recomputed_logical_max_abs_logprob_diff": float((p - rec).abs().max()),
        "today_vs_pic_reference_max_abs_logprob_diff": float((ref - q[TODAY]).abs().max()),
        "dropped_vs_kept_layout_max_abs_logprob_diff": float((run(model, kept, it) - q[ADJ])
                                                             .abs().max()),
        "sink_vs_adjacent_max_abs_logprob_diff": float((q[SINK] - q[ADJ]).abs().max()),
    }
    if args.temp_bases and args.temps:
        base, temp = args.temp_bases[0], args.temps[0]
        whole = ape_pass(model, passes[base], it, temp, args.scales[0], None)
        name = temp_name(base, temp, args.scales[0])
        out["ape_cached_vs_whole_max_abs_logprob_diff"] = float((whole - q[name]).abs().max())
        one = ape_pass(model, passes[base], it, 1.0, 1.0, kv[base])
        out["ape_t1_vs_base_max_abs_logprob_diff"] = float((one - q[base]).abs().max())
    assert out["all_recomputed_logical_kl_max"] < CHECK_KL, out
    for key, value in out.items():
        if key.endswith("max_abs_logprob_diff") and not key.startswith("sink_vs"):
            assert value < CHECK_LOGPROB, (key, out)
    return out


# ---------------------------------------------------------------------------------------------
# summary, report
# ---------------------------------------------------------------------------------------------


def summarize(records: list[dict[str, Any]], names: Sequence[str], resamples: int = 2000,
              seed: int = 0) -> dict[str, Any]:
    ci = ss.paired_ci(len(records), resamples, seed)

    def series(name: str, key: str) -> np.ndarray:
        return np.array([r["variants"][name][key] for r in records])

    out: dict[str, Any] = {}
    for name in names:
        kl = series(name, "kl")
        entry = {"kl": ci(kl), "kl_top20": ci(series(name, "kl_top20")),
                 "top1": ci(series(name, "top1")),
                 "answer_agree": float(series(name, "answer_agree").mean()),
                 "greedy_same": float(series(name, "greedy_same").mean()),
                 "kl_minus_today": ci(kl - series(TODAY, "kl")),
                 "top1_minus_today": ci(series(name, "top1") - series(TODAY, "top1"))}
        if (parent := parent_of(name)) in names:
            entry["parent"] = parent
            entry["kl_minus_parent"] = ci(kl - series(parent, "kl"))
        out[name] = entry
    return out


def table(report: dict[str, Any]) -> str:
    s, meta = report["summary"], report["meta"]
    lines = [f"n = {meta['n']} items ({meta['data']}), {meta['model_name']} fp32, answers of up "
             f"to {meta['max_tokens']} tokens; KL(full attention || variant) over the full "
             f"vocabulary, mean over A's tokens (teacher-forced); paired bootstrap 95% CIs",
             "",
             "| variant | KL [CI] | ΔKL vs today [CI] | ΔKL vs parent [CI] | top-20 KL | "
             "top-1 % [CI] | argmax = A % | greedy = full % |",
             "|---|---|---|---|---|---|---|---|"]
    for name, e in s.items():
        delta = "—" if name == TODAY else ss._fmt_ci(e["kl_minus_today"])
        parent = (f"{ss._fmt_ci(e['kl_minus_parent'])} vs {e['parent']}"
                  if "parent" in e else "—")
        lines.append(f"| `{name}` | {ss._fmt_ci(e['kl'])} | {delta} | {parent} | "
                     f"{e['kl_top20']['mean']:.3f} | {ss._fmt_ci(e['top1'], 100, 1)} | "
                     f"{e['answer_agree'] * 100:.1f} | {e['greedy_same'] * 100:.0f} |")
    lines += ["", f"{meta['seconds_per_item']:.1f} s per item on {meta['threads']} thread(s), "
                  f"{meta['wall_s'] / 60:.1f} min in all; prompt {meta['mean_prefix_tokens']:.1f} "
                  f"tokens plain, {meta['mean_layout_tokens']:.1f} in the block_attention layout "
                  f"({meta['mean_layout_only_tokens']:.1f} SSEP/PDEP/PAD); sink "
                  f"{meta['sink_tokens']} tokens"
                  + ("" if meta["all_recomputed_logical_kl_max"] is None else
                     f"; all_recomputed@{LOG} vs the plain prompt: largest per-token KL over "
                     f"every item {meta['all_recomputed_logical_kl_max']:.2g}")
                  + ("" if not meta.get("gaps") else
                     f"; gaps {meta['gaps']} (the mean span distance: "
                     f"{meta['mean_span_distance'] or 0:.1f} tokens)")]
    lines += ss.checks_line(meta, lambda c: (
        f"all_recomputed@{LOG} vs the plain prompt: KL {c['all_recomputed_logical_kl_max']:.2g}, "
        f"|Δ logprob| {c['all_recomputed_logical_max_abs_logprob_diff']:.2g}; today vs "
        f"PicReference.logprobs |Δ logprob| "
        f"{c['today_vs_pic_reference_max_abs_logprob_diff']:.2g}; layout tokens dropped vs kept "
        f"{c['dropped_vs_kept_layout_max_abs_logprob_diff']:.2g}"
        + (f"; APE question-only pass vs whole pass "
           f"{c['ape_cached_vs_whole_max_abs_logprob_diff']:.2g}, at T = 1 vs its base "
           f"{c['ape_t1_vs_base_max_abs_logprob_diff']:.2g}"
           if "ape_t1_vs_base_max_abs_logprob_diff" in c else "")))
    return "\n".join(lines)


def plot(report: dict[str, Any], plt: Any) -> Any:
    """KL per variant, with its CI (``plt``: pyplot; ``selective_signal.write_report`` saves
    it)."""
    s = report["summary"]
    names = list(s)
    means = [s[k]["kl"]["mean"] for k in names]
    low = [m - s[k]["kl"]["ci95"][0] for k, m in zip(names, means, strict=True)]
    high = [s[k]["kl"]["ci95"][1] - m for k, m in zip(names, means, strict=True)]
    colors = ["tab:gray" if k.startswith(ALL) else "tab:blue" for k in names]
    fig, ax = plt.subplots(figsize=(9, 1.5 + 0.42 * len(names)))
    ys = range(len(names))
    ax.barh(ys, means, xerr=[low, high], capsize=3, color=colors)
    for y, m in zip(ys, means, strict=True):
        ax.text(m, y, f" {m:.3f}", ha="left", va="bottom", fontsize=7)
    ax.set_yticks(list(ys))
    ax.set_yticklabels(names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("mean KL(full attention || variant) per answer token, 95% CI")
    ax.set_title(f"Layout levers on the block_attention layout, n = {report['meta']['n']} "
                 f"(gray: everything recomputed)", fontsize=10)
    return fig


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def floats(text: str, what: str, ap: argparse.ArgumentParser) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x]
    except ValueError:
        ap.error(f"{what}: comma-separated numbers")
    if not all(x > 0 for x in out):
        ap.error(f"{what}: positive numbers")
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = ss.argument_parser(__doc__)
    ss.add_fidelity_items(ap, seed_help="data seed of the built-in sets and of the bootstrap "
                                        "(default 0)")
    ap.add_argument("--temps", default="1.1,0.9,0.8",
                    help="APE temperatures T: the question's and answer's logits to span-content "
                         "keys divided by T; empty: none (default 1.1,0.9,0.8)")
    ap.add_argument("--scales", default="1",
                    help="APE scales S (log S added to the same logits), crossed with --temps "
                         "(default 1: none)")
    ap.add_argument("--temp-bases", default=f"{SINK},{ADJ}",
                    help="the variants the temperatures apply to (comma-separated; default "
                         "both sink forms). Each costs a pass of the question and answer rows "
                         "only, over the base pass's cached K/V")
    ap.add_argument("--gaps", default="",
                    help="virtual gaps G between a span's sink copy and its first real token: "
                         "comma-separated integers >= 0, and/or 'mean' (the run's mean distance "
                         "from the opening to a span in the plain prompt); each adds the "
                         f"variant {ADJ}+gap<G> (default: none)")
    ap.add_argument("--levers", default=",".join(LEVERS),
                    help="the base variants to compute, comma-separated (default: all; "
                         f"`{TODAY}` is always computed, the table's reference). --check needs "
                         "all of them")
    ap.add_argument("--keep-layout-tokens", action="store_true",
                    help="keep the invisible layout tokens in the rule-1 passes (default: drop "
                         "them, which is exact and ~18%% faster; --check asserts it)")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="minutes: take no new item after this and write what ran (default: "
                         "none)")
    args = ss.parse_common(
        ap, argv, out="results/layout_levers",
        check_help="per item (one extra pass): assert all_recomputed with invisible markers and "
                   f"logical positions equals the plain prompt (KL < {CHECK_KL:g}, |Δ logprob| "
                   f"< {CHECK_LOGPROB:g}) and that `today` equals tests/support/pic_reference.py's "
                   "PicReference.logprobs")
    args.temps = floats(args.temps, "--temps", ap)
    args.scales = floats(args.scales, "--scales", ap) or [1.0]
    args.temp_bases = [b for b in args.temp_bases.split(",") if b]
    if bad := [b for b in args.temp_bases if b not in (SINK, ADJ)]:
        ap.error(f"--temp-bases: {bad} not in {SINK}, {ADJ}")
    args.levers = {TODAY, *(x for x in args.levers.split(",") if x)}
    if bad := sorted(args.levers - set(LEVERS)):
        ap.error(f"--levers: {bad} not among {', '.join(LEVERS)}")
    if bad := [b for b in args.temp_bases if b not in args.levers]:
        ap.error(f"--temp-bases {bad} need those --levers")
    if args.check and args.levers != set(LEVERS):
        ap.error("--check needs every lever (leave --levers out)")
    try:
        args.gaps = [x if x == "mean" else int(x) for x in args.gaps.split(",") if x]
    except ValueError:
        ap.error("--gaps: comma-separated integers >= 0, or 'mean'")
    if any(g != "mean" and g < 0 for g in args.gaps):
        ap.error("--gaps: integers >= 0")
    return args


def mean_span_distance(builder: Any, items: Sequence[Any]) -> float:
    """The mean, over every span of ``items``, of the distance in the plain prompt from the
    opening's end to the span's first token (0 for a first span): how far full attention puts
    each span from its sink."""
    distances = []
    for item in items:
        plain = builder.build(mode="prefix", question=item.question, system=item.system,
                              spans=list(item.documents))
        starts = [seg.start for seg in plain.segments if seg.kind == "span"]
        distances += [start - starts[0] for start in starts]
    return float(np.mean(distances))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started, model_dir, builder, model = ss.setup(args, ATTN, lever_attention)
    # the layouts without the SDK's sink: the sink variants place their own copies of it
    builder = builder.without_sink()
    from support.pic_reference import PicReference

    # its own eager model: the --check cross-reference
    reference = PicReference(model_dir) if args.check else None
    mean_distance = None
    if "mean" in args.gaps:
        mean_distance = mean_span_distance(builder, ss.load_items(args)[0])
        print(f"--gaps mean: {mean_distance:.1f} tokens, taken as {round(mean_distance)}")
        args.gaps = list(dict.fromkeys(round(mean_distance) if g == "mean" else g
                                       for g in args.gaps))
    records, errors, requested = ss.run_items(
        args, lambda _, item: evaluate_item(model, builder, item, args, reference), started,
        args.time_limit)
    if not records:
        return 1
    wall = time.perf_counter() - started
    names = variant_names(args)
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python benchmarks/layout_levers.py " + " ".join(sys.argv[1:]),
        "args": {k: (str(v) if isinstance(v, Path) else sorted(v) if isinstance(v, set) else v)
                 for k, v in vars(args).items()},
        "n": len(records), "data": args.data, "model": model_dir,
        "model_name": Path(model_dir).name, "dtype": "float32", "block_size": 32,
        "max_tokens": args.max_tokens, "temps": args.temps, "scales": args.scales,
        "temp_bases": args.temp_bases, "items_requested": requested,
        "gaps": args.gaps, "mean_span_distance": mean_distance,
        "sink": "the plain prompt's tokens before the first document (chat template head + "
                "system prompt + user-turn header); its first token is the tokenizer's BOS",
        "sink_tokens": sorted({r["sink_tokens"] for r in records}),
        "sink_starts_with_bos": all(r["sink_starts_with_bos"] for r in records),
        "mean_prefix_tokens": float(np.mean([r["prefix_tokens"] for r in records])),
        "mean_layout_tokens": float(np.mean([r["layout_tokens"] for r in records])),
        "mean_layout_only_tokens": float(np.mean([r["layout_only_tokens"] for r in records])),
        **ss.run_meta(records, wall, processor=True),
        "variants": names,
        "all_recomputed_logical_kl_max": (max(r["variants"][f"{ALL}@{LOG}"]["kl_max"]
                                              for r in records)
                                          if f"{ALL}@{LOG}" in names else None),
    }
    if args.check:
        meta["check"] = {k: max(r["check"][k] for r in records) for k in records[0]["check"]}
    ss.write_report(args.out, "levers", meta, summarize(records, names, seed=args.seed), errors,
                    records, table, plot, wall)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
