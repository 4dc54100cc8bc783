"""A worker whose span isolation or position-free attention is bypassed refuses opted-in
requests (``engine_ext/vllm_surface/integration_guard.py``), and minipic's engines run vLLM's V1
runner.

vLLM's V2 model runner (the CUDA default) never calls the method span isolation wraps; it cannot
run on this CPU build, so the bypass is forced the way a vLLM change would make it: a worker
extension (``tests/support/guard_sabotage.py``, imported by vLLM in the worker after the plugin)
gives the CPU runner its own metadata build, or puts vLLM's stock attention backend back. Each
engine: a plain request is answered (stock semantics need none of this), then the first opted-in
request is not answered: where the worker's verdict shows the bypass before any step (a runner
override, a foreign backend) it is refused in the front-end and the engine keeps serving
(``request_gate.py``); a bypass only a step can reveal (a forged patch mark) stops the engine with
``EngineIntegrationError``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
from support.background import Background
from support.seeds import fresh_seed

from minipic.engine_ext.vllm_surface import integration_guard
from minipic.span_contract.errors import EngineIntegrationError
from minipic.span_contract.span_config import SPANS_OPT_IN_KEY

ROOT = Path(__file__).resolve().parents[2]

ENGINE = """
import os, sys
from minipic.span_contract.engine_config import EngineSettings, build_llm, close_llm

if __name__ == "__main__":
    from vllm import SamplingParams
    from minipic.prompt_builder import PromptBuilder
    from minipic.span_contract.models import resolve_model
    from minipic.span_contract.span_config import SPANS_OPT_IN_KEY

    llm = build_llm(EngineSettings(model="tiny-llama", max_model_len=512, extra={
        "worker_extension_cls": "tests.support.guard_sabotage.Sabotage"}))
    builder = PromptBuilder.from_pretrained(resolve_model("tiny-llama"), block_size=32)
    laid = builder.build(system=None, spans=[sys.argv[1]], question="which river?")
    greedy = dict(max_tokens=2, temperature=0)
    plain = llm.generate([{"prompt_token_ids": laid.prompt_token_ids}],
                         SamplingParams(**greedy), use_tqdm=False)
    print("PLAIN", plain[0].outputs[0].token_ids, flush=True)
    try:
        out = llm.generate([{"prompt_token_ids": laid.prompt_token_ids}],
                           SamplingParams(**greedy, extra_args={SPANS_OPT_IN_KEY: True}),
                           use_tqdm=False)
        print("ANSWERED", out[0].outputs[0].token_ids, flush=True)
    except Exception as exc:
        print("REFUSED", type(exc).__name__, " ".join(str(exc).split()), flush=True)
    try:
        again = llm.generate([{"prompt_token_ids": laid.prompt_token_ids}],
                             SamplingParams(**greedy), use_tqdm=False)
        print("STILL UP", again[0].outputs[0].token_ids, flush=True)
    except Exception as exc:
        print("DOWN", type(exc).__name__, flush=True)
    try:
        close_llm(llm)
    finally:
        os._exit(0)
"""


SABOTAGE = {
    "runner-override": "overrides _build_attention_metadata",
    "forged-mark": "built outside GPUModelRunner._build_attention_metadata",
    "foreign-backend": "not minipic's position-free backend",
}
# What the worker's verdict can see before any step (engine_ext/vllm_surface/request_gate.py):
# refused in the front-end, per request, the engine still up. A forged patch mark passes the
# static check; only the run-time check in the worker catches it, and stops the engine.
REFUSED_IN_FRONT = {"runner-override", "foreign-backend"}


@pytest.fixture(scope="module")
def sabotaged_engines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """The three sabotaged engines, started at once (``tests/support/background.py``): each is a
    process of its own, the sabotage imported in its worker."""
    import random

    seed = fresh_seed()
    rng = random.Random(seed)
    folder = tmp_path_factory.mktemp("guard")
    script = folder / "engine.py"
    script.write_text(textwrap.dedent(ENGINE))
    procs = {}
    for mode in SABOTAGE:
        doc = " ".join(rng.choice(["river", "stone", "lamp", "cedar", "harbor"])
                       for _ in range(40))
        env = {k: v for k, v in os.environ.items() if not k.startswith("MINIPIC_")}
        env.update(MINIPIC_TEST_SABOTAGE=mode, VLLM_CPU_KVCACHE_SPACE="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
        procs[mode] = Background(folder, mode, [sys.executable, str(script), doc], env, ROOT)
    runs = {}
    for mode, proc in procs.items():
        done = proc.result()
        runs[mode] = (done.stdout, done.stderr, seed)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(SABOTAGE))
def test_bypassed_hook_refuses_opted_in_requests(mode: str, sabotaged_engines) -> None:
    stdout, stderr, seed = sabotaged_engines[mode]
    tail = f"(seed={seed})\n" + stdout[-2000:] + stderr[-6000:]
    assert "PLAIN" in stdout, tail  # plain requests are served as stock vLLM
    assert "ANSWERED" not in stdout and "REFUSED" in stdout, tail
    refusal = next(line for line in stdout.splitlines() if line.startswith("REFUSED"))
    if mode in REFUSED_IN_FRONT:
        assert "VLLMValidationError" in refusal and SABOTAGE[mode] in refusal, tail
        assert "STILL UP" in stdout, tail  # one refused request leaves the engine serving
    else:
        logs = stdout + stderr  # the worker's traceback goes through vLLM's logger
        assert "EngineIntegrationError" in logs and SABOTAGE[mode] in logs, tail


def _output(new: list[tuple[str, bool]] = (), scheduled: dict[str, int] | None = None,
            finished: set[str] = frozenset()) -> types.SimpleNamespace:
    from vllm import SamplingParams

    reqs = [types.SimpleNamespace(req_id=rid, sampling_params=SamplingParams(
        extra_args={SPANS_OPT_IN_KEY: True} if opted else None)) for rid, opted in new]
    return types.SimpleNamespace(scheduled_new_reqs=reqs, num_scheduled_tokens=scheduled or {},
                                 finished_req_ids=set(finished))


@pytest.mark.fast
def test_guard_checks_exactly_the_steps_that_compute_opted_in_tokens() -> None:
    guard = integration_guard.StepGuard()
    assert not guard.observe(_output([("plain", False)], {"plain": 30}))
    assert guard.observe(_output([("span", True)], {"plain": 1, "span": 64}))
    assert not guard.observe(_output([], {"plain": 1, "span": 0}))  # scheduled nothing of it
    assert guard.observe(_output([], {"span": 1}))  # its decode: still its tokens
    assert not guard.observe(_output([], {"plain": 1}, finished={"span"}))
    assert not guard.opted


@pytest.mark.fast
def test_runner_without_the_hooked_method_is_named() -> None:
    """The V2 runner's shape: no ``_build_attention_metadata`` at all."""

    class ModelRunnerV2:
        pass

    (problem,) = integration_guard.runner_problems(ModelRunnerV2())
    assert "ModelRunnerV2" in problem and "VLLM_USE_V2_MODEL_RUNNER=0" in problem
    with pytest.raises(EngineIntegrationError, match="no model runner"):
        guard = integration_guard.StepGuard()
        no_layers = types.SimpleNamespace(
            compilation_config=types.SimpleNamespace(static_forward_context={}))
        guard.check_static(types.SimpleNamespace(model_runner=None, vllm_config=no_layers))


@pytest.mark.fast
def test_minipic_engines_resolve_the_v1_runner_where_triton_exists() -> None:
    """The runner choice vLLM resolves for minipic's engine config: V2 where Triton exists
    (the CUDA default), V1 with the environment minipic's launchers set."""
    script = """
import os
from minipic.span_contract.engine_config import V2_RUNNER_ENV, EngineSettings
from vllm.engine.arg_utils import EngineArgs
import vllm.config.vllm as resolved

settings = EngineSettings(model="tiny-llama", max_model_len=512).resolved()
config = EngineArgs(**settings.llm_kwargs()).create_engine_config()
print("CPU", config.use_v2_model_runner)
resolved.HAS_TRITON = True  # what a CUDA machine has
os.environ.pop(V2_RUNNER_ENV, None)
print("TRITON_STOCK", config.use_v2_model_runner)
os.environ[V2_RUNNER_ENV] = settings.plugin_env()[V2_RUNNER_ENV]
print("TRITON_MINIPIC", config.use_v2_model_runner)
"""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_USE_V2_MODEL_RUNNER"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    lines = dict(line.split() for line in proc.stdout.splitlines() if line.count(" ") == 1)
    assert lines == {"CPU": "False", "TRITON_STOCK": "True", "TRITON_MINIPIC": "False"}, (
        proc.stdout + proc.stderr[-3000:])
