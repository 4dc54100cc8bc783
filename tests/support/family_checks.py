"""What every supported model family must show in a real engine (issue 52's per-family oracle).

For one family's tiny model (``support/model_families.py``), in one engine:

* its verdict is position-free, every attention layer converted;
* warm finals (spans from their own prefills, read at new offsets), cold finals (an empty cache)
  and finals after an *unprefilled* prompt that left the same spans cached at other offsets all
  equal the layout-rule transformers reference (``support/pic_reference.py``);
* ``selective@1`` (every span token computed in context) equals the plain prompt;
* a wrong reference, the layout tokens visible to every query, is told apart: the oracle can
  fail; on a sliding-window model so are a window counted in physical slots and none at all
  (the window counts real tokens, design §2; the prompts are longer than the window).

Refused families get the refusal in the front-end instead, and a plain request still answers.
"""

from __future__ import annotations

import random
from typing import Any

from support.model_families import Family, family_dir
from support.pic_engine import generate, pic_sampling, prefill, prompt_over, random_bodies
from support.pic_reference import PicReference, prompt_error, reference_error

# A reference that shows the layout tokens must be this far off (a marker seen by every query
# moves a 2-layer random model's logprobs by 1e-2 and more; the engine is within its family's
# ``reference_tol``, 1e-4 or 3e-4).
WRONG_MIN = 1e-3
# the KV space of a family engine: tiny models, short prompts (the default 2 GiB would add up
# beside each lane's shared engines)
FAMILY_KV_GIB = "1"


class FamilyRunner:
    """One process of its own that starts each family's engine in-process, one after another, and
    runs its checks there (``run``); failures come back as the test's own exception.

    Why: an engine's EngineCore process re-imports vLLM, ~16 s of a tiny model's ~25 s start on 2
    idle cores (~40 s busy), twelve times over. In-process (vLLM's own
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) a tiny family starts in ~3 s. Not in the test lane's
    process: minipic's plugin is installed once per process with the first engine's features
    (``engine_ext/plugin.py``) and a lane also builds stock and hash-only engines, and vLLM's
    in-process CPU worker replaces ``torch.set_num_threads`` for its whole process.
    """

    def __init__(self) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self._pool = ProcessPoolExecutor(max_workers=1,
                                         mp_context=multiprocessing.get_context("spawn"))

    def run(self, name: str, seed: int) -> None:
        from concurrent.futures.process import BrokenProcessPool

        try:
            self._pool.submit(run_family, name, seed).result()
        except BrokenProcessPool:  # the process died (the engine crashed it): a new one next time
            self.close()
            self.__init__()  # type: ignore[misc]
            raise

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def run_family(name: str, seed: int) -> None:
    """The family's engine, started in this process, checked as its verdict says (supported:
    equal to the reference; refused: refused per request), closed, and its distributed state and
    KV cache freed for the next one."""
    import gc

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    try:
        _start_check_close(name, seed)
    finally:
        gc.collect()
        cleanup_dist_env_and_memory()


def _start_check_close(name: str, seed: int) -> None:
    from minipic.span_contract.engine_config import close_llm
    from support.model_families import BY_NAME, warm_model_infos

    family = BY_NAME[name]
    warm_model_infos((family,))
    llm = start(family)
    try:
        (check_supported if family.position_free else check_refused)(llm, family, seed)
    finally:
        close_llm(llm)


def start(family: Family) -> Any:
    """The family's engine with its EngineCore in this process (``FamilyRunner``)."""
    from minipic.engine_ext import plugin
    from minipic.span_contract.engine_config import EngineSettings, build_llm, patched_environ

    settings = EngineSettings(model=str(family_dir(family)), pic=True, max_model_len=1024,
                              extra=dict(family.engine_extra))
    with patched_environ({"VLLM_CPU_KVCACHE_SPACE": FAMILY_KV_GIB,
                          "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}):
        llm = build_llm(settings)
    # vLLM installs the plugin once per process: every family must share the first one's span
    # configuration (they all carry SmolLM2's tokenizer), or this engine would run another's
    installed = plugin.active_state().get("config")
    assert installed == llm.minipic_settings.span_config, \
        f"{family.name}: span configuration {llm.minipic_settings.span_config} differs from " \
        f"the one this process's plugin was installed with ({installed}): run it in its own process"
    return llm


def check_supported(llm: Any, family: Family, seed: int) -> None:
    from minipic.engine_ext.vllm_surface import request_gate

    support = request_gate.fetch_sync(llm.llm_engine)
    assert support.position_free and support.converted == support.layers > 0, \
        f"{family.name}: {support}"
    ref = PicReference(llm.minipic_settings.model)
    rng = random.Random(seed)
    vocab = ref.vocab_size
    sys_body, a_body, b_body = random_bodies(llm, rng, vocab, [12, 50, 40])
    target = prompt_over(llm, rng, vocab, [sys_body, a_body, b_body])
    other = prompt_over(llm, rng, vocab, [sys_body, b_body, a_body])  # A and B elsewhere
    params = pic_sampling(max_tokens=4, logprobs=10)

    llm.reset_prefix_cache()
    (cold,) = generate(llm, [target.token_ids], params)
    llm.reset_prefix_cache()
    generate(llm, [other.token_ids], params)  # no prefills: its spans computed in context
    (after_other,) = generate(llm, [target.token_ids], params)
    llm.reset_prefix_cache()
    prefill(llm, target.span_prefills)
    (warm,) = generate(llm, [target.token_ids], params)

    assert warm.num_cached_tokens == target.span_tokens, f"{family.name} seed={seed}"
    assert after_other.num_cached_tokens == target.span_tokens, \
        f"{family.name}: the other prompt's spans were not reused (seed={seed})"
    for name, out in (("cold", cold), ("after another prompt", after_other), ("warm", warm)):
        err = prompt_error(out, target, ref)
        assert err < family.reference_tol, \
            f"{family.name} {name}: off by {err:.2e} (seed={seed})"
    model = llm.minipic_settings.model
    visible = reference_error(warm, target.token_ids, target.spans,
                              PicReference(model, layout_ids=()))
    assert visible > WRONG_MIN, \
        f"{family.name}: the layout-visible reference is not told apart ({visible:.2e})"
    if getattr(ref.model.config, "sliding_window", None):  # the window counts real tokens
        for rule in ("physical", "none"):
            wrong = reference_error(warm, target.token_ids, target.spans,
                                    PicReference(model, window=rule))
            assert wrong > WRONG_MIN, \
                f"{family.name}: a window counted as {rule!r} is not told apart ({wrong:.2e})"
    _check_selective_one(llm, family, ref, rng, seed)
    # a plain request (never opted in) is the stock causal model, past the window too
    plain = random_bodies(llm, rng, vocab, [150])[0]
    (out,) = generate(llm, [plain], pic_sampling(max_tokens=4, logprobs=10, opt_in=False))
    err = reference_error(out, plain, (), ref, opted_in=False)
    assert err < family.reference_tol, \
        f"{family.name} plain request: off by {err:.2e} (seed={seed})"


def _check_selective_one(llm: Any, family: Family, ref: PicReference, rng: random.Random,
                         seed: int) -> None:
    """``selective@1`` equals the plain prompt (rule 1: markers and pads are never seen)."""
    from minipic.prompt_builder import PromptBuilder
    from support.pic_engine import random_documents

    cfg = llm.minipic_settings.span_config
    builder = PromptBuilder.from_pretrained(llm.minipic_settings.model,
                                            block_size=cfg.block_size, max_model_len=1024)
    common = dict(system="Answer from the documents.", spans=random_documents(rng)[:2],
                  question="Which word comes first?")
    plain = builder.build(mode="prefix", **common).prompt_token_ids
    recomputed = builder.build(mode="selective@1", **common).prompt_token_ids
    params = pic_sampling(max_tokens=4, logprobs=10)
    (out,) = generate(llm, [recomputed], params)
    err = reference_error(out, plain, (), ref)
    assert err < family.reference_tol, \
        f"{family.name} selective@1: off the plain prompt by {err:.2e} (seed={seed})"


def check_refused(llm: Any, family: Family, seed: int) -> None:
    """The verdict names the reason; an opted-in request is refused before the worker, and a
    plain request on the same engine still answers."""
    import pytest
    from vllm.exceptions import VLLMValidationError

    from minipic.engine_ext.vllm_surface import request_gate

    support = request_gate.fetch_sync(llm.llm_engine)
    assert not support.position_free and family.expect in (support.reason or ""), \
        f"{family.name}: {support}"
    rng = random.Random(seed)
    prompt = prompt_over(llm, rng, 1000, random_bodies(llm, rng, 1000, [20, 30]))
    with pytest.raises(VLLMValidationError, match="not position-free"):
        generate(llm, [prompt.token_ids], pic_sampling())
    if family.plain_runs_on_cpu:
        (plain,) = generate(llm, [prompt.token_ids], pic_sampling(opt_in=False))
        assert len(plain.outputs[0].token_ids) == 4
