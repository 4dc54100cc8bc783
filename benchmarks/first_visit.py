"""A document's first visit against a plain prompt of the same tokens, on every path a user
walks, measured side by side in one run (docs/design.md §2; issue "a document's first visit at
stock speed").

    python benchmarks/first_visit.py --out results/first_visit          # ~25 min on 2 cores
    python benchmarks/first_visit.py --quick --out /tmp/first_visit     # ~5 min

Two sides, each in its own process and engine (SmolLM2-135M fp32, eager, EngineCore in its own
process as ``minipic serve`` runs it), alternating by round: ``kernel`` (a span's own tokens on
vLLM's kernel over a copy of their span's keys: this checkout) and ``masked`` (the same
checkout with ``MINIPIC_SPAN_ROWS=masked``: the masked torch path every span token took before).
Every figure is a ratio against a plain prompt that did not opt in, with the same number of
tokens, measured in the same process:

* ``prefill_<N>``: a span prefill of an ``N``-token document (a fresh one: nothing cached), its
  TTFT and the EngineCore's peak RSS during it above its idle RSS (``VmHWM`` reset before each
  request; the plain prompt of the size runs first);
* ``cold_final``: a ``block_attention`` final of 3 documents never prefilled (the spans are
  computed in place, isolated);
* ``decode_c<C>``: output tokens/s of ``C`` warm span finals decoding together against ``C``
  warm plain prompts of the same lengths (both fully cached: the time is decode), the median of
  interleaved repeats' ratios;
* ``index``: a batch of span prefills of fresh documents, as ``minipic index`` sends them,
  documents/s against the same documents sent as plain prompts (``index_per_token``: the same
  per token, the span prefills' SSEP, sink and pads counted);
* ``selective`` / ``boundary``: warm TTFT of ``selective@0.25`` and ``boundary_recompute`` finals
  over ``block_attention`` finals of the same documents (reported: their recomputed heads run
  in the final).

Targets (the kernel side): prefill and its RSS growth <= 1.1x, cold final <= 1.15x, decode >=
0.9x, index >= 0.9x. Writes ``first_visit.json`` and ``first_visit.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _provenance import git_state

REPO = Path(__file__).resolve().parents[1]
WORDS = ("amber basalt cedar delta ember fjord granite harbor iris juniper kelp lumen moss "
         "nickel onyx pine quartz reed slate thistle umber vale willow").split()
SIDES = ("kernel", "masked")
TARGETS = {"prefill": ("<=", 1.1), "prefill_rss": ("<=", 1.1), "cold_final": ("<=", 1.15),
           "decode": (">=", 0.9), "index": (">=", 0.9)}


class Engine:
    """One engine of a side, the plain-prompt baseline beside it."""

    def __init__(self, max_model_len: int, seed: int) -> None:
        from vllm import SamplingParams  # noqa: F401 (imported before the engine starts)

        from minipic.prompt_builder import PromptBuilder
        from minipic.span_contract.engine_config import EngineSettings, build_llm

        self.llm = build_llm(EngineSettings(max_model_len=max_model_len))
        self.builder = PromptBuilder.from_pretrained(self.llm.minipic_settings.model,
                                                     max_model_len=max_model_len)
        self.tokenizer = self.llm.get_tokenizer()
        self.rng = random.Random(seed)
        self.core = _engine_core_pid()
        self.idle = 0

    def params(self, tokens: int, opted: bool):
        from vllm import SamplingParams

        from minipic.span_contract.span_config import SPANS_OPT_IN_KEY

        return SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True,
                              extra_args={SPANS_OPT_IN_KEY: True} if opted else None)

    def run(self, prompts: list[list[int]], tokens: int, opted: bool) -> tuple[float, int]:
        """Seconds for the batch, and the EngineCore's peak RSS during it above its RSS when
        idle after the warm-up (bytes). Why above that and not above the RSS just before:
        the allocator keeps what an earlier request freed, so a request that needs no more
        than its predecessor shows no growth of its own; its peak still shows what it used."""
        from vllm.inputs import TokensPrompt

        _reset_peak(self.core)
        t0 = time.perf_counter()
        self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                          self.params(tokens, opted), use_tqdm=False)
        seconds = time.perf_counter() - t0
        return seconds, max(_peak(self.core) - self.idle, 0)

    def document(self, tokens: int) -> str:
        words, text = max(tokens // 2, 8), ""
        while True:
            text = " ".join(self.rng.choice(WORDS) for _ in range(words))
            have = len(self.tokenizer.encode(text, add_special_tokens=False))
            if have >= tokens:
                return text
            words = int(words * tokens / max(have, 1)) + 4

    def plain(self, length: int) -> list[int]:
        vocab = self.tokenizer.vocab_size
        return [self.rng.randrange(100, vocab) for _ in range(length)]

    def built(self, docs: list[str], mode: str = "block_attention"):
        question = f"Which word comes first, {self.rng.choice(WORDS)} or {self.rng.choice(WORDS)}?"
        return self.builder.build(system="Answer from the documents.", spans=docs,
                                  question=question, mode=mode)

    def kept_stats(self) -> dict[str, int]:
        """The worker's kept-copy pool, summed over its groups."""
        from minipic.span_contract.engine_utilities import KEY_SHADOW_STATS_RPC

        return self.llm.collective_rpc(KEY_SHADOW_STATS_RPC)[0]

    def close(self) -> None:
        from minipic.span_contract.engine_config import close_llm

        close_llm(self.llm)


def _engine_core_pid() -> int | None:
    import psutil

    children = psutil.Process().children(recursive=True)
    return max(children, key=lambda p: p.memory_info().rss).pid if children else None


def _reset_peak(pid: int | None) -> int:
    """Reset the process's peak RSS to its current RSS (Linux ``clear_refs`` 5); its RSS now."""
    if pid is None:
        return 0
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        pass
    return _status(pid, "VmRSS")


def _peak(pid: int | None) -> int:
    return 0 if pid is None else _status(pid, "VmHWM")


def _status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def measure(args: argparse.Namespace) -> dict:
    """One side, one round, in this process (``--worker``)."""
    engine = Engine(args.max_model_len, args.seed)
    out: dict[str, list[float]] = {}

    def note(key: str, value: float) -> None:
        out.setdefault(key, []).append(value)

    engine.run([engine.plain(64)], 1, False)  # warm-up: the first request pays lazy set-up
    engine.run([engine.built([engine.document(64)]).prompt_token_ids], 1, True)
    engine.idle = _reset_peak(engine.core)
    for _ in range(args.reps):
        for size in args.sizes:  # ascending: the plain prompt first grows what its size needs
            prefill = engine.built([engine.document(size)]).span_prefills[-1]
            plain_s, plain_rss = engine.run([engine.plain(len(prefill))], 1, False)
            seconds, rss = engine.run([prefill], 1, True)
            note(f"prefill_{size}_tokens", len(prefill))
            note(f"prefill_{size}_s", seconds)
            note(f"prefill_{size}_plain_s", plain_s)
            note(f"prefill_{size}_rss_mib", rss / 2**20)
            note(f"prefill_{size}_plain_rss_mib", plain_rss / 2**20)
        final = engine.built([engine.document(args.doc_tokens) for _ in range(3)])
        seconds, _ = engine.run([final.prompt_token_ids], 1, True)
        note("cold_final_tokens", len(final.prompt_token_ids))
        note("cold_final_s", seconds)
        note("cold_final_plain_s", engine.run([engine.plain(len(final.prompt_token_ids))], 1,
                                              False)[0])
        docs = [engine.document(args.doc_tokens) for _ in range(3)]
        for mode, key in (("block_attention", "block"), ("selective@0.25", "selective"),
                          ("boundary_recompute", "boundary")):
            built = engine.built(docs, mode)
            engine.run(built.span_prefills, 1, True)  # each mode's own prefills (warm finals)
            note(f"{key}_ttft_s", engine.run([built.prompt_token_ids], 1, True)[0])
        docs = [engine.document(args.doc_tokens) for _ in range(args.index_docs)]
        prefills = [engine.built([d]).span_prefills[-1] for d in docs]
        seconds, _ = engine.run(prefills, 1, True)
        plain = [engine.tokenizer.encode(d, add_special_tokens=False) for d in docs]
        plain = [[*p[:-1], engine.rng.randrange(100, 1000)] for p in plain]  # no prefix hit
        note("index_docs_per_s", len(docs) / seconds)
        note("index_plain_docs_per_s", len(docs) / engine.run(plain, 1, False)[0])
        # the span prefills' own tokens (SSEP, sink, pads) over the documents' plain tokens
        note("index_token_ratio", sum(map(len, prefills)) / sum(map(len, plain)))
    for concurrency in args.concurrency:
        finals = []
        for _ in range(concurrency):
            built = engine.built([engine.document(args.doc_tokens // 2) for _ in range(3)])
            engine.run(built.span_prefills, 1, True)
            finals.append(built.prompt_token_ids)
        plains = [engine.plain(len(f)) for f in finals]
        sides = [("span", finals, True), ("plain", plains, False)]
        for _, prompts, opted in sides:
            engine.run(prompts, 1, opted)  # everything cached after this
        transient = engine.kept_stats()["kept_transient_rows"]
        speeds: dict[str, list[float]] = {"span": [], "plain": []}
        for repeat in range(args.decode_repeats):  # interleaved: this box drifts by +-10%
            for key, prompts, opted in (sides if repeat % 2 == 0 else sides[::-1]):
                long = engine.run(prompts, args.decode_tokens + 1, opted)[0]
                short = engine.run(prompts, 1, opted)[0]
                speeds[key].append(concurrency * args.decode_tokens / max(long - short, 1e-9))
        for key, values in speeds.items():
            note(f"decode_c{concurrency}_{key}_tok_s", statistics.median(values))
        # the kept copies (engine_ext/attention/kept_pool.py, in KV blocks reserved with each
        # request): rows with none (their copy was built for the step) during the timed runs
        stats = engine.kept_stats()
        note(f"decode_c{concurrency}_transient_rows", stats["kept_transient_rows"] - transient)
        note(f"decode_c{concurrency}_kept_peak_pages", stats["kept_peak_pages"])
        note(f"decode_c{concurrency}_ratio", statistics.median(
            a / b for a, b in zip(speeds["span"], speeds["plain"], strict=True)))
    engine.close()
    return {k: statistics.median(v) for k, v in out.items()}


def ratios(med: dict, args: argparse.Namespace) -> dict[str, float]:
    """Each figure over its plain baseline (decode, index: the span side's speed over plain)."""
    r = {}
    for size in args.sizes:
        r[f"prefill_{size}"] = med[f"prefill_{size}_s"] / med[f"prefill_{size}_plain_s"]
        r[f"prefill_{size}_rss"] = (med[f"prefill_{size}_rss_mib"]
                                    / max(med[f"prefill_{size}_plain_rss_mib"], 1.0))
    r["cold_final"] = med["cold_final_s"] / med["cold_final_plain_s"]
    for c in args.concurrency:
        r[f"decode_c{c}"] = med[f"decode_c{c}_ratio"]
    r["index"] = med["index_docs_per_s"] / med["index_plain_docs_per_s"]
    r["index_per_token"] = r["index"] * med["index_token_ratio"]  # (reported, no target)
    r["selective_over_block"] = med["selective_ttft_s"] / med["block_ttft_s"]
    r["boundary_over_block"] = med["boundary_ttft_s"] / med["block_ttft_s"]
    return r


def verdicts(r: dict[str, float]) -> dict[str, bool]:
    """Each target figure of the kernel side: met or not."""
    out = {}
    for name, value in r.items():
        kind = ("prefill_rss" if name.endswith("_rss") else name.split("_c")[0]
                if name.startswith("decode") else name.rsplit("_", 1)[0]
                if name.startswith("prefill") else name)
        if kind in TARGETS:
            op, bound = TARGETS[kind]
            out[name] = value <= bound if op == "<=" else value >= bound
    return out


def side_run(side: str, args: argparse.Namespace, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "side.json"
        from minipic.span_contract.env import SPAN_ROWS_ENV

        env = {**os.environ, SPAN_ROWS_ENV: side}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--json", str(path),
               "--seed", str(seed), "--reps", str(args.reps),
               "--sizes", *map(str, args.sizes), "--concurrency", *map(str, args.concurrency),
               "--doc-tokens", str(args.doc_tokens), "--index-docs", str(args.index_docs),
               "--decode-tokens", str(args.decode_tokens),
               "--decode-repeats", str(args.decode_repeats),
               "--max-model-len", str(args.max_model_len)]
        subprocess.run(cmd, env=env, cwd=REPO, check=True)
        return json.loads(path.read_text())


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary["ratios"]["kernel"])
    fig, ax = plt.subplots(figsize=(8, 0.32 * len(names) + 1.4))
    height = 0.4
    for k, side in enumerate(SIDES):
        values = [summary["ratios"][side][n] for n in names]
        ys = [i + k * height for i in range(len(names))]
        ax.barh(ys, values, height=height, label=side)
        for y, v in zip(ys, values, strict=True):
            ax.text(v, y, f" {v:.2f}", va="center", fontsize=7)
    ax.set_yticks([i + height / 2 for i in range(len(names))], names, fontsize=8)
    for x in (0.9, 1.0, 1.1):
        ax.axvline(x, color="black", lw=0.6 if x != 1.0 else 1.0, ls="--" if x != 1.0 else "-")
    ax.invert_yaxis()
    ax.legend(fontsize=8)
    ax.set_xlabel("span request / plain prompt of the same tokens (decode, index: speed ratio)")
    ax.set_title("A document's first visit, SmolLM2-135M fp32, CPU (median over rounds)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "results" / "first_visit")
    ap.add_argument("--quick", action="store_true",
                    help="1k and 3k tokens, concurrency 1 and 8, one round of one rep")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per side")
    ap.add_argument("--reps", type=int, default=2, help="items per round (median)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 3072, 6144, 7552])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--doc-tokens", type=int, default=400, help="a final's documents")
    ap.add_argument("--index-docs", type=int, default=8)
    ap.add_argument("--decode-tokens", type=int, default=96)
    ap.add_argument("--decode-repeats", type=int, default=3,
                    help="interleaved span / plain decode runs per concurrency (median ratio)")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.json.write_text(json.dumps(measure(args)))
        return
    if args.quick:
        args.sizes, args.concurrency, args.rounds, args.reps = [1024, 3072], [1, 8], 1, 1
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for r in range(args.rounds):
        for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
            print(f"round {r + 1}/{args.rounds}: {side} side", flush=True)
            runs[side].append(side_run(side, args, seed + r))
    med = {side: {k: statistics.median(run[k] for run in runs[side]) for k in runs[side][0]}
           for side in SIDES}
    ratio = {side: ratios(med[side], args) for side in SIDES}
    state = git_state("engine_ext", "kernels")
    summary = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "commit": state[0] if state else None, "dirty": state[1] if state else None,
        "seed": seed, "rounds": args.rounds, "reps": args.reps, "sizes": args.sizes,
        "concurrency": args.concurrency, "doc_tokens": args.doc_tokens,
        "decode_tokens": args.decode_tokens, "targets": TARGETS,
        "ratios": ratio, "targets_met": verdicts(ratio["kernel"]), "median": med, "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "first_visit.json").write_text(json.dumps(summary, indent=2))
    plot(summary, args.out / "first_visit.png")
    for side in SIDES:
        print(side, {k: round(v, 3) for k, v in ratio[side].items()})
    print("targets met:", summary["targets_met"])


if __name__ == "__main__":
    main()
