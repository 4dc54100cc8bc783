"""Compiled (torch.compile) vs eager minipic engines on this machine, side by side in one run.

minipic's settings travel in vLLM's ``additional_config`` (part of vLLM's compile-cache key, with
a hash of the plugin's engine code), so compiled mode is safe; this script measures whether it
is faster. SmolLM2-135M fp32, plugin on (span hashing, position-free attention, holes), one
engine at a time, same prompts:

* **prefill-heavy**: ``--prefills`` prompts of ``--prefill-tokens`` fresh tokens, 1 output token;
* **decode-heavy**: ``--decodes`` prompts of 64 tokens, ``--decode-tokens`` output tokens each.

Writes ``compiled_vs_eager.json`` and ``compiled_vs_eager.png`` under ``--out``. Usage::

    python benchmarks/compiled_vs_eager.py --out results/compiled_vs_eager
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any


def _measure(eager: bool, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from minipic.span_contract.engine_config import EngineSettings, build_llm, close_llm
    from minipic.span_contract.span_config import SPANS_OPT_IN_KEY

    started = time.perf_counter()
    llm = build_llm(EngineSettings(enforce_eager=eager, max_model_len=2048))
    startup = time.perf_counter() - started
    extra = {SPANS_OPT_IN_KEY: True}
    rng = random.Random(seed)

    def prompts(n: int, length: int) -> list[Any]:
        return [TokensPrompt(prompt_token_ids=[rng.randrange(200, 40000) for _ in range(length)])
                for _ in range(n)]

    outputs: list[list[int]] = []

    def timed(batch: list[Any], params: Any) -> float:
        t0 = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        outputs.extend(list(o.outputs[0].token_ids) for o in outs)
        return elapsed

    try:
        one = SamplingParams(max_tokens=1, temperature=0.0, extra_args=extra)
        many = SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True, temperature=0.0,
                              extra_args=extra)
        timed(prompts(2, 64), many)  # warm-up: first-call costs, compiled shapes
        prefill = [timed(prompts(args.prefills, args.prefill_tokens), one)
                   for _ in range(args.rounds)]
        decode = [timed(prompts(args.decodes, 64), many) for _ in range(args.rounds)]
    finally:
        close_llm(llm)
    return {"startup_s": startup, "prefill_s": prefill, "decode_s": decode, "outputs": outputs,
            "prefill_median_s": statistics.median(prefill),
            "decode_median_s": statistics.median(decode)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results/compiled_vs_eager"))
    parser.add_argument("--prefills", type=int, default=4)
    parser.add_argument("--prefill-tokens", type=int, default=768)
    parser.add_argument("--decodes", type=int, default=8)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    seed = random.SystemRandom().randrange(2**31)
    report: dict[str, Any] = {"seed": seed, "args": {k: v for k, v in vars(args).items()
                                                     if k != "out"}}
    report["eager"] = _measure(True, args, seed)
    report["compiled"] = _measure(False, args, seed)
    e, c = report["eager"], report["compiled"]
    report["compiled_speedup"] = {
        "prefill": e["prefill_median_s"] / c["prefill_median_s"],
        "decode": e["decode_median_s"] / c["decode_median_s"],
        "startup_extra_s": c["startup_s"] - e["startup_s"],
    }
    # Same prompts (same seed) on both engines: greedy outputs should agree.
    pairs = list(zip(e.pop("outputs"), c.pop("outputs"), strict=True))
    report["greedy_outputs_agree"] = {"equal": sum(a == b for a, b in pairs), "n": len(pairs)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compiled_vs_eager.json").write_text(json.dumps(report, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.4))
    cases = ["prefill-heavy", "decode-heavy"]
    x = range(len(cases))
    ax.bar([i - 0.2 for i in x], [e["prefill_median_s"], e["decode_median_s"]], 0.4,
           label="eager", color="#999")
    ax.bar([i + 0.2 for i in x], [c["prefill_median_s"], c["decode_median_s"]], 0.4,
           label="compiled", color="#2a7")
    ax.set_xticks(list(x), cases)
    ax.set_ylabel("batch wall time (s, median)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "compiled_vs_eager.png", dpi=120)
    print(json.dumps({**report["compiled_speedup"], **report["greedy_outputs_agree"]}, indent=1))


if __name__ == "__main__":
    main()
