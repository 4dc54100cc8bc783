"""Self-distillation: the model under a span layout learns to answer as it does with full
attention.

Per item, with the SDK's real layouts (``PromptBuilder``):

* the **teacher** is the frozen model (the LoRA adapter switched off) on the plain prompt
  (``prefix`` layout) followed by its own greedy answer ``A``: no labels are needed;
* the **student** is the model with the adapter, on the ``block_attention`` layout of the same
  item followed by ``A``, under the mask and positions the engine computes (``layout.py``:
  block attention, and rule 1: the layout's markers and pads invisible and position-free, so
  no capacity goes into learning to ignore them);
* the loss is KL(teacher ‖ student) over the full vocabulary, averaged over the positions the two
  sequences share at their end (the question, the chat template's tail and ``A``): those are the
  distributions a cached-document prompt must reproduce, and the answer tokens are the ones
  ``minipic eval`` scores.

Why the question's positions too, and not only ``A``'s: they are as many again, cost nothing
extra (same forward pass), and the answer's first token depends on them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from minipic.tune.layout import additive_mask, isolated_runs, layout_view

STUDENT_MODE = "block_attention"


@dataclass
class Example:
    """One item, laid out twice, with the teacher's answer appended to both."""

    teacher_ids: list[int]  # plain prompt + A
    student_ids: list[int]  # block_attention layout + A
    runs: list[tuple[int, int, str]]  # the student's isolated span runs
    shared: int  # positions at the end both sequences share (question, template tail, A)
    answer: list[int]
    answer_start_teacher: int  # index of A's first token in teacher_ids
    layout_ids: tuple[int, ...] = ()  # the student's SSEP / PDEP / PAD (rule 1 hides them)
    sink_ids: tuple[int, ...] = ()  # the opening each of its spans carries (its sink)
    sink_gap: int = 0  # positions between a span's sink and its first token

    @property
    def student_prompt_len(self) -> int:
        """Where ``A`` starts in ``student_ids``: rule 1 reads the prompt only, so a layout id
        the teacher answered with is a real token (docs/design.md §2), as in the engine."""
        return len(self.student_ids) - len(self.answer)


def common_suffix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


@torch.no_grad()
def greedy_answer(model: Any, prompt: Sequence[int], max_tokens: int, eos: int) -> list[int]:
    """The model's own greedy answer, EOS included when produced (never empty)."""
    ids = torch.tensor([list(prompt)], device=model.device)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                         max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos,
                         pad_token_id=eos)
    answer = out[0, len(prompt):].tolist()
    if eos in answer:
        answer = answer[: answer.index(eos) + 1]
    return answer or [eos]


def layouts(builder: Any, item: Any, max_tokens: int) -> tuple[Any, Any]:
    """``(plain, block)`` builds of one item, as ``minipic eval`` lays them out."""
    common = dict(question=item.question, system=item.system, spans=list(item.documents),
                  max_tokens=max_tokens)
    return builder.build(mode="prefix", **common), builder.build(mode=STUDENT_MODE, **common)


def make_example(teacher: Any, builder: Any, item: Any, max_tokens: int) -> Example:
    """``teacher``: the frozen model (``Student.base()``)."""
    plain, block = layouts(builder, item, max_tokens)
    eos = builder.tokenizer.eos_token_id
    answer = greedy_answer(teacher, plain.prompt_token_ids, max_tokens, eos)
    teacher_ids = list(plain.prompt_token_ids) + answer
    student_ids = list(block.prompt_token_ids) + answer
    return Example(teacher_ids=teacher_ids, student_ids=student_ids, runs=isolated_runs(block),
                   shared=common_suffix(teacher_ids, student_ids), answer=answer,
                   answer_start_teacher=len(plain.prompt_token_ids),
                   layout_ids=layout_ids_of(builder),
                   sink_ids=tuple(builder.span_config.sink_ids),
                   sink_gap=builder.span_config.sink_gap)


def layout_ids_of(builder: Any) -> tuple[int, int, int]:
    """The layout tokens of ``builder``'s span config (what rule 1 hides)."""
    cfg = builder.span_config
    return cfg.ssep_id, cfg.pdep_id, cfg.pad_id


def log_probs(model: Any, ids: Sequence[int], keep: int,
              runs: Sequence[tuple[int, ...]] = (),
              layout_ids: Sequence[int] = (), sink_ids: Sequence[int] = (),
              prompt_len: int | None = None, sink_gap: int = 0) -> torch.Tensor:
    """``[keep, vocab]`` next-token log-probs at the last ``keep`` positions of ``ids``, under
    the block mask of ``runs`` with ``layout_ids`` hidden and each span's ``sink_ids`` seen by
    that span only (``()``, ``()``: plain causal attention). ``prompt_len``: ``ids`` from there
    on is the answer, whose layout ids are real tokens (``layout.layout_view``)."""
    device = model.device
    allowed, positions = layout_view(ids, runs, layout_ids, sink_ids, prompt_len, sink_gap)
    mask = additive_mask(allowed, model.dtype)
    out = model(input_ids=torch.tensor([list(ids)], device=device),
                attention_mask=mask.to(device),
                position_ids=positions.to(device).unsqueeze(0), use_cache=False,
                logits_to_keep=keep)
    return torch.log_softmax(out.logits[0].float(), dim=-1)


def student_log_probs(model: Any, ex: Example) -> torch.Tensor:
    """:func:`log_probs` of ``ex``'s student sequence under its span layout (the engine's)."""
    return log_probs(model, ex.student_ids, ex.shared, ex.runs, ex.layout_ids, ex.sink_ids,
                     ex.student_prompt_len, ex.sink_gap)


def kl_rows(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) per row, from log-probs."""
    return (p_log.exp() * (p_log - q_log)).sum(-1)


def teacher_targets(teacher: Any, ex: Example) -> torch.Tensor:
    """The frozen model's log-probs over the shared positions (no grad)."""
    with torch.no_grad():
        return log_probs(teacher, ex.teacher_ids, ex.shared)


def distillation_loss(model: Any, ex: Example, target: torch.Tensor,
                      keep_full: float = 0.0) -> torch.Tensor:
    """Mean KL(teacher ‖ student) over the shared positions, with grad through what trains.

    ``keep_full`` > 0 adds that weight times the same KL with the student on the *plain* prompt:
    why: tuning for the block mask moves the model's full-attention answers too, and a user
    serves both kinds of request from one model; this term holds the plain ones in place at
    the cost of a second forward pass."""
    student = student_log_probs(model, ex)
    loss = kl_rows(target, student).mean()
    if keep_full:
        plain = log_probs(model, ex.teacher_ids, ex.shared)
        loss = loss + keep_full * kl_rows(target, plain).mean()
    return loss
