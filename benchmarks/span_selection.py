"""Which span tokens to recompute (issue 55, item 3): selections compared at equal token
budgets on today's layout (rule 1, real-token positions, a sink per span), in transformers (no
vLLM, no engine), one teacher-forced pass per item, selection and budget.

    python benchmarks/span_selection.py --threads 2                 # the 300 fidelity items
    python benchmarks/span_selection.py --n 2 --threads 1 --check   # smoke

Per item (``results/fidelity/items.jsonl`` by default; fp32 SmolLM2-135M; the SDK's layouts,
blocks of 32, max_model_len 2048; the passes of ``benchmarks/layout_levers.py``):

* **reference p**: full attention on the plain prompt, its greedy answer ``A`` (``--max-tokens``)
  and the teacher-forced next-token distributions over ``A``.
* **the cached KV**: the ``block_attention`` layout under the engine's rule (layout_levers'
  ``invisible+logical+sink_adjacent``): each span's real tokens see their span's earlier real
  tokens and a private copy of the model's opening just before the span; every other token sees
  every real token before it; every token at the position the plain prompt gives it. One pass,
  every layer's K/V recorded: budget 0, i.e. ``block_attention``.
* **in context**: the same real tokens under the plain causal mask (which equals the plain
  prompt: ``--check`` asserts it), layer 1's K/V recorded (the deviation signal below).
* **selective**: for each selection and budget ``B`` (a share of the item's span tokens), the
  chosen span tokens, the question and ``A`` are computed again *in context*, over the cached K/V
  of every other token (what the engine's holes compute: an unchosen token is never recomputed,
  and a later token of its span keeps its cached K/V). One pass of the recomputed rows.

The selections, each spending at most ``round(B * N)`` of the item's ``N`` span tokens (the
table gives the share each spent on average):

* ``heads``: each span's first ``round(B * n)`` of its ``n`` tokens (``selective@B`` today);
* ``heads_split``: the same heads, laid out as ``selective@B`` lays them out today: the head in
  the prompt (in context) and the rest of the span cached as a span of its own, with its own sink
  before its first token, so the rest never saw its head (one pass per budget: the head, the
  question and ``A`` see everything, each rest only its sink and itself);
* ``tails``: each span's last ``round(B * n)``;
* ``related_lexical``: whole spans, the most related to the question first, by a retriever's
  score the SDK can compute without the model (distinct question words found in the span, per
  square root of its length; words of three letters or more); the last span that does not fit
  whole gives its head;
* ``related_attention``: as ``related_lexical``, ranked by the question's attention in one cheap
  layer (``--attn-layer``, default 2) of the cached pass: its rows' attention weights, summed
  over the question's rows, averaged over heads, summed over the span's keys;
* ``deviation`` (CacheBlend-like): blocks of ``--block`` span tokens (counted from each span's
  first token) ranked by the mean over their tokens of ``|V_in_context - V_cached|`` at layer 1
  (layer 0's K/V are the same in both), taken while they fit;
* ``random``: the same blocks in a random order (seeded by ``--seed`` and the item), taken while
  they fit: the control every other selection must beat.

Metrics per selection and budget (``selective_signal.compare``): KL(p || selective) over the full
vocabulary, mean over the answer tokens; top-1 agreement with p; ``greedy = full``: every answer
token is the selective pass's argmax. Paired bootstrap 95% CIs of the KL difference against
``random`` and against ``heads`` at the same budget (one index set for the whole run).

``--check`` asserts, per item: the in-context pass equals the plain prompt (KL < 1e-5); budget 0
(nothing chosen) equals the cached pass's own answer rows; every span token chosen equals the
plain prompt; ``heads_split`` at B = 0 equals the cached pass and at B = 1 the plain prompt; all
to float noise.

Writes ``selection.json`` (meta, summary, per-item records), ``selection.md`` and
``selection.png`` (KL against budget per selection) to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import math
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

import layout_levers as ll  # noqa: E402  (after the path set-up)
import selective_signal as ss  # noqa: E402

ATTN = "minipic_span_selection"
SELECTIONS = ("heads", "heads_split", "tails", "related_lexical", "related_attention",
              "deviation", "random")
DEVIATION_LAYER = 1  # layer 0's K/V do not depend on the mask: nothing has attended yet
CHECK_KL = 1e-5
CHECK_LOGPROB = 1e-3


# ---------------------------------------------------------------------------------------------
# the spans of an item, and the selections
# ---------------------------------------------------------------------------------------------


def span_tokens(it: ll.Item) -> list[np.ndarray]:
    """Per span, the item indices of its real tokens (no SSEP, no padding)."""
    return [np.flatnonzero((it.run_of == k) & it.real) for k in range(len(it.runs))]


def per_span(spans: Sequence[np.ndarray], budget: float, tail: bool) -> np.ndarray:
    chosen = []
    for tokens in spans:
        k = round(budget * len(tokens))
        chosen.append(tokens[len(tokens) - k:] if tail else tokens[:k])
    return np.sort(np.concatenate(chosen)) if chosen else np.zeros(0, dtype=np.int64)


def whole_spans(spans: Sequence[np.ndarray], scores: Sequence[float], limit: int) -> np.ndarray:
    """Whole spans, best score first, while they fit; the first that does not fit gives its
    head to the budget left."""
    chosen: list[np.ndarray] = []
    left = limit
    for k in np.argsort(-np.asarray(scores, dtype=float), kind="stable"):
        take = spans[k][:left]
        chosen.append(take)
        left -= len(take)
        if left <= 0:
            break
    return np.sort(np.concatenate(chosen)) if chosen else np.zeros(0, dtype=np.int64)


def split_heads(it: ll.Item, spans: Sequence[np.ndarray], budget: float) -> ll.Item:
    """``it`` with each span's head (its first ``round(budget * n)`` tokens) out of the span:
    what stays a span starts at its first unchosen token."""
    import dataclasses

    runs: list[tuple[int, int]] = []
    run_of = np.full(it.total, -1, dtype=np.int64)
    for (a, b), tokens in zip(it.runs, spans, strict=True):
        head = round(budget * len(tokens))
        if head >= len(tokens):
            continue
        start = a if head == 0 else int(tokens[head])
        run_of[start:b] = len(runs)
        runs.append((start, b))
    return dataclasses.replace(it, runs=runs, run_of=run_of)


def blocks_of(spans: Sequence[np.ndarray], block: int) -> list[np.ndarray]:
    return [tokens[i:i + block] for tokens in spans for i in range(0, len(tokens), block)]


def fill(blocks: Sequence[np.ndarray], order: Sequence[int], limit: int) -> np.ndarray:
    """The blocks in ``order``, each taken when it still fits the budget."""
    chosen: list[np.ndarray] = []
    used = 0
    for b in order:
        if used + len(blocks[b]) <= limit:
            chosen.append(blocks[b])
            used += len(blocks[b])
    return np.sort(np.concatenate(chosen)) if chosen else np.zeros(0, dtype=np.int64)


WORD = re.compile(r"[a-z0-9]{3,}")


def lexical_scores(question: str, documents: Sequence[str]) -> list[float]:
    """Distinct question words found in each document, per square root of its word count."""
    asked = set(WORD.findall(question.lower()))
    out = []
    for doc in documents:
        words = WORD.findall(doc.lower())
        out.append(len(asked & set(words)) / math.sqrt(max(len(words), 1)))
    return out


# ---------------------------------------------------------------------------------------------
# passes
# ---------------------------------------------------------------------------------------------


def pass_index(ps: ll.Pass) -> dict[int, int]:
    """Item index -> index in the pass (the item's tokens the pass kept)."""
    return {int(s): j for j, s in enumerate(ps.src) if s >= 0}


def selective(model: Any, it: ll.Item, chosen: np.ndarray, where: dict[int, int],
              kv: tuple[list[torch.Tensor], list[torch.Tensor]]) -> torch.Tensor:
    """``chosen`` span tokens, the question and ``A`` computed in context (every real token
    before each of them, at the plain prompt's positions) over the cached K/V of every other
    real token before the question; logprobs over ``A``."""
    real = np.flatnonzero(it.real)
    recompute = np.concatenate([np.sort(chosen), real[real >= it.question_start]])
    cached_items = np.setdiff1d(real[real < it.question_start], chosen, assume_unique=True)
    idx = torch.as_tensor([where[int(i)] for i in cached_items], dtype=torch.long)
    cached = ([k[:, :, idx] for k in kv[0]], [v[:, :, idx] for v in kv[1]])
    keys = torch.as_tensor(np.concatenate([cached_items, recompute]))
    allowed = keys[None, :] <= torch.as_tensor(recompute)[:, None]
    row_of = {int(i): j for j, i in enumerate(recompute)}
    rows = [row_of[r] for r in it.rows]
    return ss.forward(model, [it.ids[i] for i in recompute], it.logical[recompute].tolist(),
                      allowed, rows, cached=cached)


def evaluate_item(model: Any, builder: Any, item: Any, index: int, args: argparse.Namespace
                  ) -> dict[str, Any]:
    from support.pic_reference import block_attention_allowed

    timing: dict[str, float] = {}
    t0 = time.perf_counter()
    plain, built, answer, p = ss.reference_pass(model, builder, item, args.max_tokens, timing,
                                                "reference_pass_s")
    it = ll.item_of(built, plain, answer)
    layers = model.config.num_hidden_layers
    t = time.perf_counter()
    cached_pass = ll.adjacent_sink(it, ll.invisible(block_attention_allowed(it.total, it.runs),
                                                    it), drop_layout=True)
    where = pass_index(cached_pass)
    q_start = min(j for i, j in where.items() if i >= it.question_start)
    q_end = where[it.prompt_len - 1] + 1
    q_base = ss.forward(model, cached_pass.ids, cached_pass.pos, cached_pass.allowed,
                        cached_pass.rows(it), record_layers=range(layers),
                        question_rows=slice(q_start, q_end))
    kv = ([ss.PROBE.keys[i] for i in range(layers)], [ss.PROBE.values[i] for i in range(layers)])
    mass = ss.PROBE.mass[args.attn_layer][: len(cached_pass.src)]
    context = ll.make_pass(it, it.logical.tolist(), ll.invisible(ss.causal(it.total), it),
                           drop_layout=True)
    q_context = ss.forward(model, context.ids, context.pos, context.allowed, context.rows(it),
                           record_layers=[DEVIATION_LAYER])
    v_context = ss.PROBE.values[DEVIATION_LAYER]
    timing["cached_and_context_passes_s"] = time.perf_counter() - t

    spans = span_tokens(it)
    total = int(sum(len(s) for s in spans))
    in_context = pass_index(context)
    pick = lambda i: [where[int(x)] for x in i]  # noqa: E731
    deviation = (v_context[0, :, [in_context[int(x)] for x in np.concatenate(spans)]]
                 - kv[1][DEVIATION_LAYER][0, :, pick(np.concatenate(spans))]
                 ).norm(dim=(0, 2)).numpy()
    dev_of = dict(zip(np.concatenate(spans).tolist(), deviation.tolist(), strict=True))
    blocks = blocks_of(spans, args.block)
    block_dev = [float(np.mean([dev_of[int(x)] for x in b])) for b in blocks]
    attn = [float(mass[pick(s)].sum()) for s in spans]
    lexical = lexical_scores(item.question, item.documents)
    rng = np.random.default_rng([args.seed, index])

    selections: dict[str, Callable[[float, int], np.ndarray]] = {
        "heads": lambda b, _: per_span(spans, b, tail=False),
        "tails": lambda b, _: per_span(spans, b, tail=True),
        "related_lexical": lambda _, lim: whole_spans(spans, lexical, lim),
        "related_attention": lambda _, lim: whole_spans(spans, attn, lim),
        "deviation": lambda _, lim: fill(blocks, np.argsort(-np.asarray(block_dev),
                                                            kind="stable"), lim),
        "random": lambda _, lim: fill(blocks, rng.permutation(len(blocks)), lim),
    }
    t = time.perf_counter()
    configs: dict[str, dict[str, float]] = {}
    for budget in args.budgets:
        limit = round(budget * total)
        for name in args.selections:
            if name == "heads_split":
                split = split_heads(it, spans, budget)
                ps = ll.adjacent_sink(split, ll.invisible(
                    block_attention_allowed(split.total, split.runs), split), drop_layout=True)
                q = ss.forward(model, ps.ids, ps.pos, ps.allowed, ps.rows(split))
                spent = len(per_span(spans, budget, tail=False))
            else:
                chosen = selections[name](budget, limit)
                assert len(chosen) <= max(limit, sum(round(budget * len(s)) for s in spans))
                q = selective(model, it, chosen, where, kv)
                spent = len(chosen)
            m = ss.compare(p, q, answer)
            m["greedy_same"] = float(m["answer_agree"] == 1.0)
            m["spent"] = spent / total
            configs[f"{name}@{budget:g}"] = m
    timing["selective_passes_s"] = time.perf_counter() - t
    base = ss.compare(p, q_base, answer)
    base["greedy_same"] = float(base["answer_agree"] == 1.0)
    record: dict[str, Any] = {
        "id": item.id, "documents": len(item.documents), "span_tokens": total,
        "prefix_tokens": len(plain.prompt_token_ids), "answer_tokens": len(answer),
        "answer": builder.decode(answer), "block_attention": base, "configs": configs,
        "related_top_lexical": int(np.argmax(lexical)),
        "related_top_attention": int(np.argmax(attn)),
    }
    check = None
    if args.check:
        def check() -> dict[str, float]:
            none = selective(model, it, np.zeros(0, dtype=np.int64), where, kv)
            every = selective(model, it, np.concatenate(spans), where, kv)
            split = {}
            for budget in (0.0, 1.0):
                it2 = split_heads(it, spans, budget)
                ps = ll.adjacent_sink(it2, ll.invisible(
                    block_attention_allowed(it2.total, it2.runs), it2), drop_layout=True)
                split[budget] = ss.forward(model, ps.ids, ps.pos, ps.allowed, ps.rows(it2))
            out = {"context_vs_plain_kl_max": float((p.exp() * (p - q_context)).sum(-1).max()),
                   "budget0_vs_cached_max_abs_logprob_diff": float((none - q_base).abs().max()),
                   "budget1_vs_plain_max_abs_logprob_diff": float((every - p).abs().max()),
                   "split0_vs_cached_max_abs_logprob_diff": float((split[0.0] - q_base).abs()
                                                                  .max()),
                   "split1_vs_plain_max_abs_logprob_diff": float((split[1.0] - p).abs().max())}
            assert out["context_vs_plain_kl_max"] < CHECK_KL, out
            for key, value in out.items():
                if key.endswith("logprob_diff"):
                    assert value < CHECK_LOGPROB, (key, out)
            return out
    return ss.finish_record(record, timing, t0, check)


# ---------------------------------------------------------------------------------------------
# summary, report
# ---------------------------------------------------------------------------------------------


def summarize(records: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    ci = ss.paired_ci(len(records), 2000, args.seed)

    def series(key: str, metric: str) -> np.ndarray:
        if key == "block_attention":
            return np.array([r["block_attention"][metric] for r in records])
        return np.array([r["configs"][key][metric] for r in records])

    out: dict[str, Any] = {"block_attention": {
        "kl": ci(series("block_attention", "kl")), "top1": ci(series("block_attention", "top1")),
        "greedy_same": float(series("block_attention", "greedy_same").mean())}}
    for budget in args.budgets:
        for name in args.selections:
            key = f"{name}@{budget:g}"
            kl = series(key, "kl")
            entry = {"selection": name, "budget": budget, "kl": ci(kl),
                     "top1": ci(series(key, "top1")),
                     "greedy_same": float(series(key, "greedy_same").mean()),
                     "spent": float(series(key, "spent").mean())}
            for other in ("random", "heads"):
                if other != name and other in args.selections:
                    entry[f"kl_minus_{other}"] = ci(kl - series(f"{other}@{budget:g}", "kl"))
            out[key] = entry
    return out


def table(report: dict[str, Any]) -> str:
    s, meta = report["summary"], report["meta"]
    base = s["block_attention"]
    lines = [f"n = {meta['n']} items ({meta['data']}), {meta['model_name']} fp32, answers of up "
             f"to {meta['max_tokens']} tokens; budget B: share of the item's span tokens "
             "recomputed in context; KL(full attention || selective) over the full vocabulary, "
             "mean over A's tokens (teacher-forced); paired bootstrap 95% CIs",
             "",
             f"Nothing recomputed (`block_attention`): KL {ss._fmt_ci(base['kl'])}, top-1 "
             f"{ss._fmt_ci(base['top1'], 100, 1)} %, greedy = full "
             f"{base['greedy_same'] * 100:.0f} %.",
             "",
             "| B | selection | spent | KL [CI] | ΔKL vs random [CI] | ΔKL vs heads [CI] | "
             "top-1 % [CI] | greedy = full % |",
             "|---|---|---|---|---|---|---|---|"]
    for key, e in s.items():
        if key == "block_attention":
            continue
        vs = {o: ss._fmt_ci(e[f"kl_minus_{o}"]) if f"kl_minus_{o}" in e else "—"
              for o in ("random", "heads")}
        lines.append(f"| {e['budget']:g} | `{e['selection']}` | {e['spent'] * 100:.1f} % | "
                     f"{ss._fmt_ci(e['kl'])} | {vs['random']} | {vs['heads']} | "
                     f"{ss._fmt_ci(e['top1'], 100, 1)} | {e['greedy_same'] * 100:.0f} |")
    lines += ["", f"{meta['seconds_per_item']:.1f} s per item on {meta['threads']} thread(s), "
                  f"{meta['wall_s'] / 60:.1f} min in all; {meta['mean_span_tokens']:.1f} span "
                  f"tokens per item; attention layer {meta['attn_layer']}, blocks of "
                  f"{meta['block']} span tokens"]
    lines += ss.checks_line(meta, lambda c: (
        f"in context vs the plain prompt: KL {c['context_vs_plain_kl_max']:.2g}; nothing "
        f"chosen vs the cached pass |Δ logprob| {c['budget0_vs_cached_max_abs_logprob_diff']:.2g};"
        f" every span token chosen vs the plain prompt "
        f"{c['budget1_vs_plain_max_abs_logprob_diff']:.2g}; heads_split at B = 0 vs the cached "
        f"pass {c['split0_vs_cached_max_abs_logprob_diff']:.2g}, at B = 1 vs the plain prompt "
        f"{c['split1_vs_plain_max_abs_logprob_diff']:.2g}"))
    return "\n".join(lines)


def plot(report: dict[str, Any], plt: Any) -> Any:
    """KL against the budget, one line per selection, 95% CIs; budget 0 is block_attention."""
    s, meta = report["summary"], report["meta"]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    base = s["block_attention"]["kl"]
    for name in meta["selections"]:
        xs, ys, lo, hi = [0.0], [base["mean"]], [0.0], [0.0]
        for budget in meta["budgets"]:
            e = s[f"{name}@{budget:g}"]["kl"]
            xs.append(budget)
            ys.append(e["mean"])
            lo.append(e["mean"] - e["ci95"][0])
            hi.append(e["ci95"][1] - e["mean"])
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=name,
                    linestyle="--" if name == "random" else "-")
    ax.set_xlabel("budget B: share of span tokens recomputed in context")
    ax.set_ylabel("mean KL(full attention || selective)")
    ax.set_title(f"Which span tokens to recompute, n = {meta['n']} ({meta['model_name']})",
                 fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = ss.argument_parser(__doc__)
    ss.add_fidelity_items(ap, seed_help="data seed of the built-in sets, of random's order "
                                        "and of the bootstrap (default 0)")
    ap.add_argument("--budgets", default="0.1,0.25,0.5",
                    help="shares of span tokens to recompute (default 0.1,0.25,0.5)")
    ap.add_argument("--selections", default=",".join(SELECTIONS),
                    help=f"which selections (default all: {', '.join(SELECTIONS)})")
    ap.add_argument("--attn-layer", type=int, default=2,
                    help="the layer whose question attention ranks spans for "
                         "related_attention (default 2)")
    ap.add_argument("--block", type=int, default=32,
                    help="span tokens per block of deviation and random (default 32)")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="minutes: take no new item after this and write what ran")
    ap.add_argument("--resume", action="store_true",
                    help="keep the items --out's selection.json already holds (a run stopped "
                         "by --time-limit; it may have had more --selections) and run the "
                         "rest, as one run would")
    args = ss.parse_common(
        ap, argv, out="results/span_selection",
        check_help="per item: assert the in-context pass equals the plain prompt, nothing "
                   "chosen equals the cached pass and every span token chosen equals the plain "
                   "prompt")
    args.budgets = ll.floats(args.budgets, "--budgets", ap)
    if any(b > 1 for b in args.budgets):
        ap.error("--budgets: shares in (0, 1]")
    args.selections = [x for x in args.selections.split(",") if x]
    if bad := [x for x in args.selections if x not in SELECTIONS]:
        ap.error(f"--selections: {bad} not among {', '.join(SELECTIONS)}")
    if args.block < 1:
        ap.error("--block: at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started, model_dir, builder, model = ss.setup(args, ATTN, ss.probe_attention)
    # the layouts without the SDK's sink: the cached pass places its own copy per span
    builder = builder.without_sink()
    if not 0 <= args.attn_layer < model.config.num_hidden_layers:
        raise SystemExit(f"--attn-layer: the model has {model.config.num_hidden_layers} layers")
    settings = {"data": args.data, "max_tokens": args.max_tokens, "budgets": args.budgets,
                "selections": args.selections, "attn_layer": args.attn_layer,
                "block": args.block, "model": model_dir}
    done = None
    if args.resume:  # the earlier run may have had more selections: each record holds them all
        done = ss.earlier_records(args.out / "selection.json", settings,
                                  [k for k in settings if k != "selections"])
        short = [r for r in done.values()
                 if any(f"{s}@{b:g}" not in r["configs"]
                        for s in args.selections for b in args.budgets)]
        if short:
            raise SystemExit(f"--resume: item {short[0]['id']} lacks some of --selections "
                             f"{args.selections}; use another --out")
    records, errors, requested = ss.run_items(
        args, lambda index, item: evaluate_item(model, builder, item, index, args), started,
        args.time_limit, done)
    if not records:
        return 1
    wall = time.perf_counter() - started
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python benchmarks/span_selection.py " + " ".join(sys.argv[1:]),
        "n": len(records), "items_requested": requested, **settings,
        "model_name": Path(model_dir).name, "dtype": "float32", "block_size": 32,
        "resumed_items": len(done or {}),
        "mean_span_tokens": float(np.mean([r["span_tokens"] for r in records])),
        **ss.run_meta(records, wall, processor=True),
    }
    if args.check:
        meta["check"] = {k: max(r["check"][k] for r in records) for k in records[0]["check"]}
    ss.write_report(args.out, "selection", meta, summarize(records, args), errors, records,
                    table, plot, wall)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
