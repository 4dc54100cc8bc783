"""Driving a minipic engine (``vllm.LLM``) from a test: span-opted-in greedy sampling, token-id
prompts (salted or not), span prefills, and fresh random PIC prompts for the engine's own span
configuration. Shared by ``tests/engine/test_span_reuse.py``, ``test_hole_steps_engine.py``,
``test_position_free.py`` and ``tests/span_store/test_span_store.py``; what the outputs are
checked against is ``support.pic_reference``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from support.pic_reference import PicPrompt, build_pic_prompt, random_ordinary_ids


def pic_sampling(max_tokens: int = 4, logprobs: int = 5, opt_in: bool = True,
                 ignore_eos: bool = False, logit_bias: dict[int, float] | None = None) -> Any:
    """Greedy ``SamplingParams`` returning top-``logprobs`` entries; ``opt_in``: the request asks
    for span semantics (else it gets stock hashing and attention). ``logit_bias``: added to
    those ids' logits at every step (forces a token); the logprobs returned stay the model's
    raw ones (vLLM's ``raw_logprobs``), so they still compare with the reference."""
    from vllm import SamplingParams

    from minipic.span_contract.span_config import SPANS_OPT_IN_KEY

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs,
                          ignore_eos=ignore_eos, logit_bias=logit_bias,
                          extra_args={SPANS_OPT_IN_KEY: True} if opt_in else None)


def generate(llm: Any, prompts: Sequence[Sequence[int]], params: Any,
             salt: str | None = None) -> list:
    """``llm.generate`` on token-id prompts, each under ``cache_salt`` when ``salt`` is given."""
    from vllm.inputs import TokensPrompt

    batch = []
    for ids in prompts:
        prompt = TokensPrompt(prompt_token_ids=list(ids))
        if salt:
            prompt["cache_salt"] = salt
        batch.append(prompt)
    return llm.generate(batch, params, use_tqdm=False)


def prefill(llm: Any, spans: Sequence[Sequence[int]], salt: str | None = None) -> None:
    """Span prefills: each span alone, one token, no logprobs."""
    generate(llm, spans, pic_sampling(max_tokens=1, logprobs=0), salt)


def random_bodies(llm: Any, rng: random.Random, vocab: int,
                  lengths: Sequence[int]) -> list[list[int]]:
    """Fresh span bodies of these lengths: ordinary ids, never the engine's SSEP / PDEP / PAD."""
    cfg = llm.minipic_settings.span_config
    avoid = (cfg.ssep_id, cfg.pdep_id, cfg.pad_id)
    return [random_ordinary_ids(rng, n, vocab, avoid) for n in lengths]


def prompt_over(llm: Any, rng: random.Random, vocab: int, bodies: Sequence[Sequence[int]],
                question_len: int = 12) -> PicPrompt:
    """The PIC prompt of ``bodies`` (span 0 plays the system prompt) and a fresh random
    question of ``question_len`` ordinary ids."""
    cfg = llm.minipic_settings.span_config
    avoid = (cfg.ssep_id, cfg.pdep_id, cfg.pad_id)
    return build_pic_prompt(cfg, bodies, random_ordinary_ids(rng, question_len, vocab, avoid))


def random_prompt(llm: Any, rng: random.Random, vocab: int, lengths: Sequence[int]) -> PicPrompt:
    """Fresh bodies of these lengths, then a fresh 12-id question (drawn in that order, so a
    seed replays the same prompt)."""
    return prompt_over(llm, rng, vocab, random_bodies(llm, rng, vocab, lengths))


WORDS = ("amber basalt cedar delta ember fjord granite harbor iris juniper kelp lumen moss "
         "nickel onyx pine quartz reed slate thistle umber vale willow").split()


def random_documents(rng: random.Random) -> list[str]:
    """Four fresh documents of random words: one short (all head, or no head block at a small
    share), three of 20-140 words, in a random order."""
    lengths = [rng.randrange(3, 12), *(rng.randrange(20, 140) for _ in range(3))]
    rng.shuffle(lengths)
    return [" ".join(rng.choice(WORDS) for _ in range(n)) for n in lengths]


def selective_prompt(llm: Any, rng: random.Random, share: float, question: str,
                     docs: Sequence[str] | None = None
                     ) -> tuple[Any, list[tuple[int, int, str]]]:
    """A ``selective@share`` prompt of fresh random documents (some short enough to be all head
    or to get no head block) laid out by the SDK's builder for the engine's span config, and its
    reference runs: every span part with its name (``minipic/tune/layout.py``: a whole span is
    isolated, hiding the copy of the head computed in context right before it; heads, system
    and question attend to everything shown before them)."""
    from minipic.prompt_builder import PromptBuilder
    from support.pic_reference import span_part_runs

    cfg = llm.minipic_settings.span_config
    builder = PromptBuilder.from_pretrained(None, block_size=cfg.block_size,
                                            chat_template=False, sink_gap=cfg.sink_gap)
    assert builder.span_config == cfg
    if docs is None:
        docs = random_documents(rng)
    built = builder.build(system="Answer from the documents.", spans=list(docs),
                          question=question, mode=f"selective@{share}")
    return built, span_part_runs(built)
