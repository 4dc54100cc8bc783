"""A sink gap (``SpanConfig.sink_gap``) on a real engine: each span's sink sits G positions
before its text, in the span's own prefill and in every final that reuses or recomputes it.

Real vLLM on CPU (fp32, tiny Llama, G = 40: no multiple of the block), SDK-built prompts whose
spans carry the model's opening as their sink, fresh random documents every run, against the
transformers reference of docs/design.md §2 (``minipic/tune/layout.py`` with the same G):

* block_attention: the final after its spans' prefills (every span reused), and the same final
  sent cold (every span computed in place), equal the reference with G, and the reference with
  G = 0 is far from both (the gap is applied, not ignored);
* selective@B: the heads computed in context, the whole spans reused after them with their
  hidden copy of the head, cold and warm, equal the reference with G;
* room: a gap that would move positions past the model's rotary table is refused to span
  requests with the reason (``model_support``), never run into an index error mid-step.

Tolerance: ``REFERENCE_TOL`` on every returned top-k logprob (fp32 kernels vs transformers).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
from support.pic_engine import generate, pic_sampling, prefill, random_documents, selective_prompt
from support.pic_reference import REFERENCE_TOL, PicReference, max_logprob_error, span_part_runs

pytestmark = [pytest.mark.engine, pytest.mark.shares("tiny_pic_gap")]


@pytest.fixture(scope="module")
def gap_engine(engines) -> object:
    return engines.get("tiny_pic_gap")


@pytest.fixture(scope="module")
def references(gap_engine) -> Iterator[tuple[PicReference, PicReference]]:
    """The reference with the engine's gap, and the same model with none."""
    model = gap_engine.minipic_settings.model
    gap = gap_engine.minipic_settings.span_config.sink_gap
    assert gap == 40
    yield PicReference(model, sink_gap=gap), PicReference(model, sink_gap=0)


def _error(ref: PicReference, out, ids, runs) -> float:
    full = list(ids) + list(out.outputs[0].token_ids)
    lp = ref.logprobs(full, runs, prompt_len=len(ids))
    return max_logprob_error(out.outputs[0], len(ids), lp)


def test_block_attention_places_each_sink_a_gap_before_its_span(gap_engine, references,
                                                                 seed) -> None:
    from minipic.prompt_builder import PromptBuilder

    with_gap, without = references
    cfg = gap_engine.minipic_settings.span_config
    builder = PromptBuilder.from_pretrained(None, block_size=cfg.block_size,
                                            chat_template=False, sink_gap=cfg.sink_gap)
    assert builder.span_config == cfg and cfg.sink_ids
    rng = random.Random(seed)
    built = builder.build(system="Answer from the documents.", spans=random_documents(rng),
                          question="Which word comes first?", mode="block_attention")
    ids, runs = built.prompt_token_ids, span_part_runs(built)
    gap_engine.reset_prefix_cache()
    cold = generate(gap_engine, [ids], pic_sampling())[0]
    prefill(gap_engine, built.span_prefills)
    warm = generate(gap_engine, [ids], pic_sampling())[0]
    assert warm.num_cached_tokens == built.expected_cached_tokens, f"seed={seed}"
    for name, out in {"cold": cold, "warm": warm}.items():
        err = _error(with_gap, out, ids, runs)
        assert err < REFERENCE_TOL, f"{name}: off the reference by {err:.2e} (seed={seed})"
    off = _error(without, cold, ids, runs)
    assert off > 100 * REFERENCE_TOL, f"the gap changed nothing ({off:.2e}, seed={seed})"


def test_selective_hides_its_copy_and_its_sink_with_the_gap(gap_engine, references,
                                                             seed) -> None:
    with_gap, _ = references
    rng = random.Random(seed)
    share = rng.choice([0.25, 0.5])
    built, runs = selective_prompt(gap_engine, rng, share, "Which word comes last?")
    ids = built.prompt_token_ids
    assert any(s.part == "head" for s in built.segments), f"share {share} (seed={seed})"
    gap_engine.reset_prefix_cache()
    cold = generate(gap_engine, [ids], pic_sampling())[0]
    gap_engine.reset_prefix_cache()  # the cold final cached its heads too
    prefill(gap_engine, built.span_prefills)
    warm = generate(gap_engine, [ids], pic_sampling())[0]
    assert warm.num_cached_tokens == built.expected_cached_tokens, f"seed={seed}"
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids, f"seed={seed}"
    for name, out in {"cold": cold, "warm": warm}.items():
        err = _error(with_gap, out, ids, runs)
        assert err < REFERENCE_TOL, (f"{name}: off the reference by {err:.2e} "
                                     f"(share {share}, seed={seed})")


def test_a_gap_past_the_rotary_table_is_refused_with_the_reason(gap_engine) -> None:
    from minipic.engine_ext.vllm_surface import request_gate
    from minipic.span_contract.model_support import MODEL_SUPPORT_UTILITY, ModelSupport

    assert request_gate.fetch_sync(gap_engine.llm_engine).position_free
    config = gap_engine.llm_engine.model_config
    room = config.hf_config.max_position_embeddings - config.max_model_len  # the table's rows
    client = gap_engine.llm_engine.engine_core
    fits, past = (ModelSupport.from_dict(client.call_utility(MODEL_SUPPORT_UTILITY, gap))
                  for gap in (room, room + 1))
    assert fits.position_free, fits.reason
    assert not past.position_free and f"sink_gap={room + 1}" in past.reason, past.reason
