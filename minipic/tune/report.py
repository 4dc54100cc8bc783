"""What tuning bought and what it cost, on held-out items, in transformers.

For each held-out item (never tuned on), against the *base* model's full attention on the plain
prompt and its greedy answer ``A`` (the answer a user would get without minipic):

* ``base_block``: the base model under the block_attention layout (what minipic serves today);
* ``tuned_block``: the tuned model under the same layout (what it serves after tuning);
* ``tuned_full``: the tuned model on the plain prompt: the cost of tuning to the model's own
  full-attention behaviour, KL(base prefix ‖ tuned prefix).

Per answer token: KL(base full ‖ row) and top-1 agreement; per item, F1 against the gold answer
of the greedy answers of the base and tuned models on the plain prompt. Paired bootstrap CIs
(``minipic.eval.metrics``). ``minipic eval --model DIR`` measures the merged model on the engine.

``minipic tune`` scores the model it saved (``SavedModel``): the weights read back from the
output folder, in the base model's dtype, not the float32 weights tuning left in memory; when
saving rounded them, the rounded-away weights are scored too (``unrounded_block``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from minipic.eval import metrics
from minipic.span_contract.errors import BadInputError
from minipic.tune import objective

ROWS = ("base_block", "tuned_block", "tuned_full")


class SavedModel:
    """What the closing report of ``minipic tune`` scores, in ``score_item``'s place of a
    student: the tuned model as saved (``model``: the folder's weights, ``weights_dtype``,
    loaded back in ``compute_dtype``), the untuned base beside it, and ``unrounded``: the tuned
    weights before saving rounded them to ``weights_dtype`` (None when saving kept them as
    they were).

    Why: a user serves the saved folder; weights that existed only in memory (float32 while
    tuning, the base's bfloat16 on disk) are not the model that was tuned, as far as they go."""

    def __init__(self, model: Any, base: Any, weights_dtype: str, compute_dtype: str,
                 unrounded: Any = None) -> None:
        self.model = model
        self._base = base
        self.weights_dtype = weights_dtype
        self.compute_dtype = compute_dtype
        self.unrounded = unrounded

    @contextmanager
    def base(self) -> Iterator[Any]:
        yield self._base

    def describe(self) -> dict[str, Any]:
        """For the report's meta: what the tuned rows scored."""
        return {"weights": "as saved", "weights_dtype": self.weights_dtype,
                "compute_dtype": self.compute_dtype,
                "unrounded_scored": self.unrounded is not None}


@torch.no_grad()
def score_item(student: Any, builder: Any, item: Any, max_tokens: int) -> dict[str, Any]:
    """``student``: a ``trainer.Student`` (the tuned weights in memory and their base) or a
    ``SavedModel`` (the saved weights, their base, and the weights before saving rounded them:
    the extra row ``unrounded_block``)."""
    with student.base() as base:
        ex = objective.make_example(base, builder, item, max_tokens)
        reference = objective.log_probs(base, ex.teacher_ids, ex.shared)
        base_block = objective.student_log_probs(base, ex)
    model = student.model
    tuned_block = objective.student_log_probs(model, ex)
    tuned_full = objective.log_probs(model, ex.teacher_ids, ex.shared)
    rows = [("base_block", base_block), ("tuned_block", tuned_block), ("tuned_full", tuned_full)]
    unrounded = getattr(student, "unrounded", None)
    if unrounded is not None:
        rows.append(("unrounded_block", objective.student_log_probs(unrounded, ex)))
    answer_rows = slice(-len(ex.answer) - 1, -1)  # the rows that predict A's tokens
    p = reference[answer_rows]
    record: dict[str, Any] = {"id": item.id, "answer_tokens": len(ex.answer)}
    for name, q in rows:
        q = q[answer_rows]
        record[name] = {"kl": float(objective.kl_rows(p, q).mean()),
                        "top1": float((p.argmax(-1) == q.argmax(-1)).float().mean())}
    if item.answer is not None:
        tokenizer = builder.tokenizer
        plain = ex.teacher_ids[: ex.answer_start_teacher]
        tuned_answer = objective.greedy_answer(model, plain, max_tokens,
                                               tokenizer.eos_token_id)
        record["f1_base"] = metrics.f1(tokenizer.decode(ex.answer, skip_special_tokens=True),
                                       item.answer)
        record["f1_tuned"] = metrics.f1(tokenizer.decode(tuned_answer, skip_special_tokens=True),
                                        item.answer)
    return record


def summarize(records: list[dict[str, Any]], seed: int = 0) -> dict[str, Any]:
    n = len(records)
    if n == 0:
        raise BadInputError("no held-out item could be scored")
    idx = metrics.bootstrap_indices(n, seed=seed)

    def ci(values: list[float]) -> dict[str, float]:
        mean, low, high = metrics.bootstrap_ci(values, indices=idx)
        return {"mean": mean, "low": low, "high": high}

    out: dict[str, Any] = {"n": n}
    for row in ROWS:
        out[row] = {k: ci([r[row][k] for r in records]) for k in ("kl", "top1")}
    out["tuned_minus_base_block_kl"] = ci([r["tuned_block"]["kl"] - r["base_block"]["kl"]
                                          for r in records])
    if all("unrounded_block" in r for r in records):
        out["unrounded_block"] = {k: ci([r["unrounded_block"][k] for r in records])
                                  for k in ("kl", "top1")}
        # what saving in a narrower dtype cost (or gained) against the weights tuning made
        out["saved_minus_unrounded_block_kl"] = ci(
            [r["tuned_block"]["kl"] - r["unrounded_block"]["kl"] for r in records])
    with_gold = [r for r in records if "f1_base" in r]
    if with_gold:
        gold_idx = metrics.bootstrap_indices(len(with_gold), seed=seed)
        for key in ("f1_base", "f1_tuned"):
            mean, low, high = metrics.bootstrap_ci([r[key] for r in with_gold], indices=gold_idx)
            out[key] = {"mean": mean, "low": low, "high": high}
        mean, low, high = metrics.bootstrap_ci([r["f1_tuned"] - r["f1_base"] for r in with_gold],
                                               indices=gold_idx)
        out["f1_tuned_minus_base"] = {"mean": mean, "low": low, "high": high}
    return out


def _fmt(entry: dict[str, float], digits: int = 3, scale: float = 1.0) -> str:
    if entry is None or math.isnan(entry["mean"]):
        return "n/a"
    return (f"{entry['mean'] * scale:.{digits}f} "
            f"[{entry['low'] * scale:.{digits}f}, {entry['high'] * scale:.{digits}f}]")


def table(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [f"# minipic tune: {meta['model_name']} → {meta['out']}", "",
             f"{meta['steps']} steps × {meta['batch']} items, {meta['method']}, "
             f"lr {meta['lr']}, {meta['train_items']} tuning items, "
             f"{meta['wall_s'] / 60:.1f} min on {meta['threads']} threads.", "",
             f"Held-out items: n = {summary['n']}, scored against the base model's full "
             f"attention (its plain prompt and greedy answer). 95% paired bootstrap CIs.", "",
             *_scored_line(meta),
             "| row | KL(base full ‖ row) per answer token | top-1 agreement, % |",
             "|---|---|---|"]
    names = {"base_block": "base, block_attention", "tuned_block": "tuned, block_attention",
             "tuned_full": "tuned, full attention (the cost)"}
    for row in ROWS:
        lines.append(f"| {names[row]} | {_fmt(summary[row]['kl'])} | "
                     f"{_fmt(summary[row]['top1'], 1, 100)} |")
    lines += ["", f"Tuned − base under block_attention, KL: "
                  f"{_fmt(summary['tuned_minus_base_block_kl'])}"]
    if "unrounded_block" in summary:
        what = meta.get("scored", {})
        lines.append(f"Before saving rounded them to {what.get('weights_dtype', '?')}, the "
                     f"tuned weights ({what.get('compute_dtype', '?')}) under block_attention, "
                     f"KL: {_fmt(summary['unrounded_block']['kl'])}; saved − unrounded: "
                     f"{_fmt(summary['saved_minus_unrounded_block_kl'])}")
    if "f1_base" in summary:
        lines.append(f"F1 against gold, plain prompt: base {_fmt(summary['f1_base'])}, tuned "
                     f"{_fmt(summary['f1_tuned'])} (difference "
                     f"{_fmt(summary['f1_tuned_minus_base'])})")
    return "\n".join(lines)


def _scored_line(meta: dict[str, Any]) -> list[str]:
    what = meta.get("scored")
    if not what:
        return []
    return [f"Tuned rows score the saved model: its {what['weights_dtype']} weights read back "
            f"from {meta['out']}, computed in {what['compute_dtype']} (the base too).", ""]


def plot(losses: list[float], summary: dict[str, Any], path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.plot(range(1, len(losses) + 1), losses, lw=1, alpha=0.5, label="per step")
    window = max(1, len(losses) // 10)
    if len(losses) >= window:
        smooth = [statistics.fmean(losses[max(0, i - window + 1): i + 1])
                  for i in range(len(losses))]
        left.plot(range(1, len(losses) + 1), smooth, lw=2, label=f"mean of {window}")
    left.set(xlabel="optimizer step", ylabel="KL(teacher ‖ student), tuning items",
             title="training loss")
    left.legend()
    names = ["base\nblock", "tuned\nblock", "tuned\nfull"]
    means = [summary[r]["kl"]["mean"] for r in ROWS]
    errs = [[m - summary[r]["kl"]["low"] for r, m in zip(ROWS, means, strict=True)],
            [summary[r]["kl"]["high"] - m for r, m in zip(ROWS, means, strict=True)]]
    right.bar(names, means, yerr=errs, capsize=4, color=["#999", "#2a7", "#c73"])
    right.set(ylabel="KL vs base full attention, held out", title=f"n = {summary['n']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
