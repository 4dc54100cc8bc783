"""Reference for PIC prompts: one transformers forward pass with a block-structured mask.

docs/design.md §2 defines what a PIC prompt means: a span's tokens (from its SSEP to the end
of its padding) attend only within their span, every other token attends causally to everything
before it; and (rule 1) the layout tokens -- SSEP, PDEP, PAD -- are attended by no query but their
own and take no position: a real token sits at the number of real tokens before it. Because RoPE
is relative, computing a span alone (its span prefill) and reading its keys at another offset
equals computing it there under this mask -- so this single forward pass is what the engine must
reproduce, whatever it reused from the cache. Nothing here shares code with vLLM or minipic's
engine side (the mask is ``minipic.tune.layout``'s, the definition the student trains under).

Also builds PIC prompts from SpanConfig ids (SSEP at each span start, PAD to the block size,
PDEP before the question) and draws fresh random ordinary token ids.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from minipic.span_contract.span_config import SpanConfig
from minipic.span_contract.special_tokens import span_config_for_model
from minipic.tune.layout import additive_mask, block_attention_allowed, layout_view
from minipic.tune.layout import isolated_runs as span_part_runs

__all__ = ["PicPrompt", "PicReference", "REFERENCE_TOL", "block_attention_allowed",
           "build_pic_prompt", "greedy_error", "max_logprob_error", "pad_span", "prompt_error",
           "random_ordinary_ids", "reference_error", "span_part_runs"]


@dataclass
class PicPrompt:
    """Token ids of a final prompt, where its spans are, and each span's own prefill."""

    token_ids: list[int]
    spans: list[tuple[int, int]]  # [start, end) of each span: SSEP .. end of its padding
    span_prefills: list[list[int]] = field(default_factory=list)

    @property
    def span_tokens(self) -> int:
        return sum(end - start for start, end in self.spans)


def pad_span(config: SpanConfig, body: Sequence[int]) -> list[int]:
    """``[SSEP] + body + PAD...`` up to a multiple of the block size."""
    span = [config.ssep_id, *body]
    span += [config.pad_id] * (-len(span) % config.block_size)
    return span


def build_pic_prompt(config: SpanConfig, span_bodies: Sequence[Sequence[int]],
                     question: Sequence[int]) -> PicPrompt:
    """``[span 0][span 1]... [PDEP + question]``; span 0 plays the system prompt."""
    ids: list[int] = []
    spans, prefills = [], []
    for body in span_bodies:
        span = pad_span(config, body)
        spans.append((len(ids), len(ids) + len(span)))
        prefills.append(span)
        ids += span
    ids += [config.pdep_id, *question]
    return PicPrompt(token_ids=ids, spans=spans, span_prefills=prefills)


def random_ordinary_ids(rng: random.Random, n: int, vocab_size: int,
                        avoid: Sequence[int], low: int = 17) -> list[int]:
    """``n`` ids from the ordinary vocabulary (``>= low``, never one of ``avoid``)."""
    banned = set(avoid)
    out: list[int] = []
    while len(out) < n:
        tid = rng.randrange(low, vocab_size)
        if tid not in banned:
            out.append(tid)
    return out


class PicReference:
    """fp32 transformers model from the engine's own model folder.

    ``window``: how a sliding-window layer's window counts ("logical": real tokens, the layout
    rule of docs/design.md §2; "physical" / "none": wrong rules, for tests that must tell them
    apart).

    ``layout_ids``: the tokens rule 1 hides (default: the model's own SSEP / PDEP / PAD, as the
    engine derives them); ``sink_ids``: the opening a span may carry after its SSEP, seen only
    by that span (default: the model's own, as the engine derives it); ``sink_gap``: positions
    between a span's sink and its first token (default: the model folder's, as the engine's)."""

    def __init__(self, model_dir: str, layout_ids: Sequence[int] | None = None,
                 sink_ids: Sequence[int] | None = None, window: str = "logical",
                 sink_gap: int | None = None) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        self.vocab_size = self.model.config.vocab_size
        if layout_ids is None or sink_ids is None or sink_gap is None:
            cfg = span_config_for_model(model_dir)
            if layout_ids is None:
                layout_ids = (cfg.ssep_id, cfg.pdep_id, cfg.pad_id)
            sink_ids = cfg.sink_ids if sink_ids is None else sink_ids
            sink_gap = cfg.sink_gap if sink_gap is None else sink_gap
        self.layout_ids = tuple(layout_ids)
        self.sink_ids = tuple(sink_ids)
        self.sink_gap = sink_gap
        # how a sliding window counts: "logical" (real tokens, the layout rule), or the wrong
        # rules a test must tell apart: "physical" (slots, markers and pads included), "none"
        self.window = window

    @torch.inference_mode()
    def logprobs(self, token_ids: Sequence[int], spans: Sequence[tuple[int, int]] = (),
                 opted_in: bool = True, prompt_len: int | None = None) -> torch.Tensor:
        """``[len, vocab]`` log-softmax of the next-token logits at every position.

        ``spans=()`` with no layout token gives the plain causal model (what stock vLLM
        computes). ``opted_in=False``: a request that never opted in to span semantics, whose
        layout tokens (if any) are ordinary tokens to the engine. ``prompt_len``: the tokens
        from there on are the engine's output (teacher forcing), which rule 1 never hides: a
        generated SSEP / PDEP / PAD is a real token (None: all of ``token_ids`` is prompt).
        """
        allowed, positions = layout_view(token_ids, spans, self.layout_ids if opted_in else (),
                                         self.sink_ids, prompt_len, self.sink_gap)
        out = self.model(
            input_ids=torch.tensor([list(token_ids)]),
            attention_mask=self._masks(allowed, positions),
            position_ids=positions.unsqueeze(0),
            use_cache=False,
        )
        return torch.log_softmax(out.logits[0].float(), dim=-1)


    def _masks(self, allowed: torch.Tensor, positions: torch.Tensor) -> object:
        """The additive mask, or one per layer type for a model with sliding-window layers:
        the window counts real tokens (docs/design.md §2), a query at logical ``p`` seeing keys
        at ``p - window < position``, the rule transformers applies to plain prompts
        (``sliding_window_overlay``), here at the layout's logical positions. transformers takes
        a 4-D mask as given, so the window has to be in it."""
        config = self.model.config
        window = getattr(config, "sliding_window", None)
        if not window or self.window == "none":
            return additive_mask(allowed)
        at = positions if self.window == "logical" else torch.arange(len(positions))
        near = at[None, :] > at[:, None] - window
        windowed = additive_mask(allowed & (near | torch.eye(len(positions), dtype=torch.bool)))
        types = getattr(config, "layer_types", None)
        if not types:  # every layer windowed (Mistral v0.1 style)
            return windowed
        return {kind: windowed if kind == "sliding_attention" else additive_mask(allowed)
                for kind in set(types)}


def max_logprob_error(completion: object, prompt_len: int, ref: torch.Tensor) -> float:
    """Largest |engine - reference| over every logprob the engine returned.

    ``completion`` is a vLLM ``CompletionOutput`` with ``logprobs``; ``ref`` the reference
    log-probabilities of ``prompt + completion.token_ids`` (teacher forcing on the engine's
    own tokens, so near-ties in greedy choice cannot make the comparison fail).
    """
    worst = 0.0
    for step, entries in enumerate(completion.logprobs):  # type: ignore[attr-defined]
        row = ref[prompt_len - 1 + step]
        for token_id, lp in entries.items():
            worst = max(worst, abs(lp.logprob - float(row[token_id])))
    return worst


# max |delta logprob| over every returned top-k entry, engine vs this reference in fp32: the
# kernels and the summation order differ (measured <= 2e-6)
REFERENCE_TOL = 1e-4


def reference_error(out: object, token_ids: Sequence[int], spans: Sequence[tuple[int, int]],
                    ref: PicReference, opted_in: bool = True) -> float:
    """``max_logprob_error`` of a vLLM ``RequestOutput`` for the prompt ``token_ids`` whose
    isolated spans are ``spans`` (``()``: the plain causal model), teacher-forced on the
    engine's own tokens (``opted_in``: as in :meth:`PicReference.logprobs`; the engine's
    tokens are output, never layout)."""
    completion = out.outputs[0]  # type: ignore[attr-defined]
    full = list(token_ids) + list(completion.token_ids)
    return max_logprob_error(completion, len(token_ids),
                             ref.logprobs(full, spans, opted_in, prompt_len=len(token_ids)))


def prompt_error(out: object, prompt: PicPrompt, ref: PicReference) -> float:
    """``reference_error`` for a ``PicPrompt``."""
    return reference_error(out, prompt.token_ids, prompt.spans, ref)


def greedy_error(prompt_ids: Sequence[int], span_runs: Sequence[tuple[int, int]],
                 output_ids: Sequence[int], ref: PicReference) -> float:
    """How far an answer decoded greedily by the engine is from the reference's own choices,
    where only the answer's tokens are known (an SDK ``Answer``, no logprobs): the largest, over
    the answer's steps, of the reference's best logprob minus its logprob of the engine's
    token, teacher-forced on the engine's tokens. 0 where the engine took the reference's
    argmax at every step; an engine within ``REFERENCE_TOL`` of the reference per logprob can
    only pick another token among near-ties, within ``2 * REFERENCE_TOL``."""
    full = list(prompt_ids) + list(output_ids)
    lp = ref.logprobs(full, span_runs, True, prompt_len=len(prompt_ids))
    worst = 0.0
    for step, token in enumerate(output_ids):
        row = lp[len(prompt_ids) - 1 + step]
        worst = max(worst, float(row.max() - row[token]))
    return worst
