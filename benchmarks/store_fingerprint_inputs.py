"""Each input a store entry's KV depends on, changed one at a time, on real engines: the changed
engine loads nothing the first one stored, and answers exactly as a fresh engine does.

    python benchmarks/store_fingerprint_inputs.py     # -> results/span_store/fingerprint_inputs.*

Why a script beside the suite: every row costs two engine starts (~25 s each on 2 cores), and
the suite keeps one such row (other weights, ``tests/span_store/test_span_store.py``); the
fingerprint of every input is checked without an engine in
``tests/span_store/test_span_store_config.py``. This run is the end-to-end proof for the rest.

One base engine (tiny random Llama, fp32, a disk-only store) prefills fresh random spans into a
store directory. Then, for each input, an engine differing from the base in that input alone
runs the final prompt on that directory (its loaded blocks counted by the store), and a fresh
engine of the same configuration runs it on an empty directory; their greedy tokens and
logprobs must be identical. A control row changes nothing: that engine must load the stored
blocks (so a row of zeros is the fingerprint's doing, not a store that never loads). Inputs this
CPU build cannot run (weight quantization needs a quantized checkpoint) are reported as such,
not as passes. Rows that load nothing compute exactly what the fresh engine computes, so their
logprobs must be identical; the control reads loaded KV instead of computing it, a different
summation order, so it must match within the suite's reference tolerance (1e-4).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

# input -> the EngineSettings fields that change it (one input per row)
CONTROL = "nothing (control: the same configuration)"
VARIANTS: dict[str, dict[str, Any]] = {
    CONTROL: {},
    "rotary (hf_overrides rope_theta)": {"extra": {"hf_overrides": {"rope_theta": 12345.0}}},
    "dtype (bfloat16)": {"dtype": "bfloat16"},
    "block size (64)": {"block_size": 64},
    "revision": {"extra": {"revision": "other-revision"}},
    "prefix-cache hash (sha256_cbor)": {"extra": {"prefix_caching_hash_algo": "sha256_cbor"}},
    # the same folder, other weights: random ones (how servers are often benchmarked)
    "load format (dummy)": {"extra": {"load_format": "dummy"}},
    "loader options": {"extra": {"model_loader_extra_config": {"enable_multithread_load": True}}},
    "compilation (torch.compile, not eager)": {"enforce_eager": False},
}
NOT_RUNNABLE = {
    "vLLM / torch versions": "one version of each is installed here; the fingerprint's version "
                             "fields are checked without an engine "
                             "(tests/span_store/test_span_store_config.py)",
    "LoRA adapter": "not an input: LoRA requests neither load nor save (an adapter is named by "
                    "name and path, not by its weights)",
    "quantization": "no quantized checkpoint of the test models, and vLLM CPU 0.32 quantizes "
                    "weights only from such checkpoints; the fingerprint's quantization field is "
                    "checked without an engine (tests/span_store/test_span_store_config.py)",
}


def _engine(store_dir: Path, **fields: Any) -> Any:
    from minipic.span_contract.engine_config import EngineSettings, build_llm
    from minipic.span_contract.span_store_config import SpanStoreConfig

    return build_llm(EngineSettings(model="tiny-llama", pic=True, max_model_len=2048,
                                    span_store=SpanStoreConfig(dir=str(store_dir), ram_mib=0),
                                    **fields))


def _store_counts(llm: Any) -> dict[str, int]:
    from minipic.engine_ext.recurrent.checkpoints import call_engine
    from minipic.span_contract.engine_utilities import SPAN_STORE_STATS_UTILITY

    stats = call_engine(llm, SPAN_STORE_STATS_UTILITY)
    return {**dict(stats["counts"]), "fingerprint": stats["fingerprint"]}


def _run(llm: Any, ids: list[int]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from minipic.span_contract.span_config import SPANS_OPT_IN_KEY

    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=5,
                            extra_args={SPANS_OPT_IN_KEY: True})
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    return {"tokens": list(completion.token_ids), "cached": out.num_cached_tokens,
            "logprobs": [{str(k): v.logprob for k, v in step.items()}
                         for step in completion.logprobs]}


def _max_diff(got: dict[str, Any], want: dict[str, Any]) -> float:
    """Largest logprob difference over the tokens both runs rank (inf if the rankings differ)."""
    worst = 0.0
    for a, b in zip(got["logprobs"], want["logprobs"], strict=True):
        if set(a) != set(b):
            return float("inf")
        worst = max(worst, *(abs(a[k] - b[k]) for k in a))
    return worst


def _prompt(llm: Any, rng: random.Random) -> tuple[list[int], list[list[int]]]:
    from support.pic_reference import build_pic_prompt, random_ordinary_ids

    cfg = llm.minipic_settings.span_config
    vocab = llm.llm_engine.model_config.get_vocab_size()
    avoid = (cfg.ssep_id, cfg.pdep_id, cfg.pad_id)
    bodies = [random_ordinary_ids(rng, n, vocab, avoid) for n in (70, 45, 90)]
    prompt = build_pic_prompt(cfg, bodies, random_ordinary_ids(rng, 12, vocab, avoid))
    return prompt.token_ids, prompt.span_prefills


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "results" / "span_store"))
    ap.add_argument("--seed", type=int, default=None, help="default: a fresh one")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)

    from tqdm import tqdm

    from minipic.span_contract.engine_config import close_llm

    work = Path(tempfile.mkdtemp(prefix="minipic-fingerprint-"))
    shared, rows = work / "store", []
    started = time.monotonic()
    try:
        base = _engine(shared)
        try:
            ids, spans = _prompt(base, random.Random(seed))
            _run(base, spans[0][:1])  # warm-up
            for span in spans:
                _run(base, span)
            base_counts = _store_counts(base)
            base_final = _run(base, ids)
        finally:
            close_llm(base)
        saved = base_counts.get("saved_blocks", 0)
        assert saved > 0, "the base engine stored nothing"
        for name, fields in tqdm(VARIANTS.items(), desc="inputs", unit="input"):
            row: dict[str, Any] = {"input": name, "settings": fields}
            try:
                changed = _engine(shared, **fields)
            except Exception as exc:  # an input this build cannot run: say so, not a pass
                rows.append({**row, "runnable": False, "why": f"{type(exc).__name__}: {exc}"})
                continue
            try:
                if "block_size" in fields:  # the layout follows the engine's block size
                    ids_v, _ = _prompt(changed, random.Random(seed))
                else:
                    ids_v = ids
                before = _store_counts(changed)
                got = _run(changed, ids_v)
                after = _store_counts(changed)
            finally:
                close_llm(changed)
            fresh = _engine(work / f"fresh-{len(rows)}", **fields)
            try:
                want = _run(fresh, ids_v)
            finally:
                close_llm(fresh)
            loaded = after.get("loaded_blocks", 0) - before.get("loaded_blocks", 0)
            loaded_tokens = sum(after.get(k, 0) - before.get(k, 0)
                                for k in ("tokens_disk", "tokens_ram"))
            rows.append({**row, "runnable": True, "fingerprint_differs":
                         after["fingerprint"] != base_counts["fingerprint"],
                         "loaded": loaded, "loaded_tokens": loaded_tokens,
                         "cached_tokens": got["cached"],
                         "max_logprob_diff": _max_diff(got, want),
                         "equals_fresh_engine": got["tokens"] == want["tokens"] and (
                             _max_diff(got, want) <= (1e-4 if name == CONTROL else 0.0)),
                         "tokens": got["tokens"], "fresh_tokens": want["tokens"]})
        for name, why in NOT_RUNNABLE.items():
            rows.append({"input": name, "runnable": False, "why": why})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {"meta": {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "seed": seed,
                       "machine": f"{platform.machine()}, {platform.processor() or '?'}",
                       "model": "tiny-llama (fp32 base)", "wall_s": round(
                           time.monotonic() - started, 1), "base_saved_blocks": saved,
                       "base_final_cached": base_final["cached"]},
              "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fingerprint_inputs.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = ["# Store entries under changed inputs: loads and answers", "",
             f"Seed {seed}; the base engine stored {saved} blocks, and its own final found "
             f"{base_final['cached']} tokens cached. "
             "`python benchmarks/store_fingerprint_inputs.py`.",
             "", "| input changed | fingerprint differs | blocks loaded | = fresh engine "
             "| max logprob diff |",
             "|---|---|---|---|---|"]
    for r in rows:
        if r["runnable"]:
            lines.append(f"| {r['input']} | {r['fingerprint_differs']} | {r['loaded']} | "
                         f"{r['equals_fresh_engine']} | {r['max_logprob_diff']:.1e} |")
        else:
            lines.append(f"| {r['input']} | not runnable here: {r['why']} | | | |")
    (out / "fingerprint_inputs.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    ok = all((r["loaded"] == saved and not r["fingerprint_differs"]) if r["input"] == CONTROL
             else (r["loaded"] == r["loaded_tokens"] == 0 and r["fingerprint_differs"])
             for r in rows if r["runnable"])
    ok = ok and all(r["equals_fresh_engine"] for r in rows if r["runnable"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
