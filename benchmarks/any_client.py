"""TTFT of a plain OpenAI client sending documents, vs the same prompt as plain text, vs the SDK.

    python benchmarks/any_client.py                     # 24 questions, ~4 min on 2 cores
    python benchmarks/any_client.py --questions 48 --passages 5

One ``minipic serve`` (SmolLM2-135M, the default; compiled as served, unless ``--eager``), three
ways to ask the same RAG questions over the offline Wikipedia corpus, in one run, in turn per
question (so a slower patch of the machine hits all three alike):

* ``documents``: the official ``openai`` client, ``/v1/chat/completions`` with the retrieved
  passages in ``extra_body={"documents": [...]}`` (the server lays them out as spans,
  ``serving/documents``);
* ``plain_text``: the same client and route, the passages pasted into the user message before
  the question (what a RAG stack sends today): stock prefix caching only;
* ``sdk``: minipic's SDK (``Orchestrator.connect``, streaming), the same passages.

Questions draw ``--passages`` passages from a pool of ``--pool`` (shuffled: documents recur at
other positions, as retrieval returns them), with the SmolLM2 chat template and a fixed system
prompt. TTFT is client-side: request sent -> first content token received (a stream). Each path
gets its own cache salt so none warms the others' spans. Output: ``results/any_client/
any_client.json`` (per question and summaries: TTFT p50 / mean, hit rate = cached / prompt
tokens, ratios against plain text) and ``any_client.png`` (TTFT per question, per path).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

SYSTEM = "Answer the question from the documents, in one short sentence."
PATHS = ("documents", "plain_text", "sdk")


def _chat_stream(client: Any, body: dict[str, Any], salt: str) -> dict[str, Any]:
    sent = time.perf_counter()
    first = None
    text, usage = [], None
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                            extra_body={**body.pop("extra_body", {}),
                                                        "cache_salt": salt}, **body)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    done = time.perf_counter()
    cached = (usage.prompt_tokens_details.cached_tokens or 0) if usage else 0
    return {"ttft_s": (first or done) - sent, "text": "".join(text),
            "prompt_tokens": usage.prompt_tokens if usage else 0, "cached_tokens": cached}


async def _sdk_stream(orc: Any, question: str, docs: list[str], salt: str,
                      max_tokens: int) -> dict[str, Any]:
    from minipic.orchestrator.results import Answer
    from minipic.orchestrator.streaming import stream_answer

    sent = time.perf_counter()
    first = None
    answer = None
    async for item in stream_answer(orc, question, docs, SYSTEM, cache_salt=salt,
                                    max_tokens=max_tokens):
        if isinstance(item, Answer):
            answer = item
        elif item and first is None:
            first = time.perf_counter()
    assert answer is not None
    done = time.perf_counter()
    return {"ttft_s": (first or done) - sent, "text": answer.text,
            "prompt_tokens": answer.prompt_tokens, "cached_tokens": answer.cached_tokens}


class Ask:
    """One question's three requests (the same passages, the same question)."""

    def __init__(self, client: Any, orc: Any, loop: asyncio.AbstractEventLoop, question: str,
                 passages: list[Any], max_tokens: int) -> None:
        self.client, self.orc, self.loop = client, orc, loop
        self.question, self.passages, self.max_tokens = question, passages, max_tokens

    def _messages(self, user: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]

    def documents(self) -> dict[str, Any]:
        docs = [{"title": p.title, "text": p.text} for p in self.passages]
        return _chat_stream(self.client, {
            "model": "minipic", "messages": self._messages(self.question), "temperature": 0,
            "max_tokens": self.max_tokens, "extra_body": {"documents": docs}}, "documents")

    def plain_text(self) -> dict[str, Any]:
        pasted = "\n\n".join(p.as_document for p in self.passages)
        return _chat_stream(self.client, {
            "model": "minipic", "messages": self._messages(f"{pasted}\n\n{self.question}"),
            "temperature": 0, "max_tokens": self.max_tokens}, "plain")

    def sdk(self) -> dict[str, Any]:
        return self.loop.run_until_complete(_sdk_stream(
            self.orc, self.question, [p.as_document for p in self.passages], "sdk",
            self.max_tokens))


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ttft = [r["ttft_s"] for r in rows]
    prompt = sum(r["prompt_tokens"] for r in rows)
    return {"ttft_p50_ms": statistics.median(ttft) * 1e3,
            "ttft_mean_ms": statistics.fmean(ttft) * 1e3,
            "hit_rate": sum(r["cached_tokens"] for r in rows) / prompt if prompt else 0.0,
            "prompt_tokens_mean": prompt / len(rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=24)
    ap.add_argument("--passages", type=int, default=4, help="documents per question")
    ap.add_argument("--pool", type=int, default=10, help="distinct passages the questions draw")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eager", action="store_true", help="serve eager (faster start)")
    ap.add_argument("--out", default=str(ROOT / "results" / "any_client"))
    args = ap.parse_args()

    from openai import OpenAI
    from support.servers import ServerProcess
    from tqdm import tqdm

    from minipic.orchestrator import Orchestrator
    from minipic.orchestrator.corpus import load_passages, load_qa_items

    rng = random.Random(args.seed)
    passages = load_passages()
    pool = rng.sample(passages, args.pool)
    items = rng.sample(load_qa_items(), args.questions)
    server_args = ["--max-model-len", "2048"]
    server = ServerProcess(*server_args, eager=args.eager)
    server.start(timeout=900)
    rows: dict[str, list[dict[str, Any]]] = {p: [] for p in PATHS}
    try:
        client = OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0,
                        timeout=600)
        loop = asyncio.new_event_loop()
        orc = loop.run_until_complete(_connect(Orchestrator, server.base_url))
        for i, item in enumerate(tqdm(items, desc="questions", unit="q")):
            chosen = rng.sample(pool, args.passages)
            ask = Ask(client, orc, loop, item.question, chosen, args.max_tokens)
            order = list(PATHS) if i % 2 == 0 else list(reversed(PATHS))
            for path in order:
                rows[path].append({"question": i, **getattr(ask, path)()})
        loop.run_until_complete(orc.backend.aclose())
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
    finally:
        server.stop()

    summary = {p: _summary(rows[p]) for p in PATHS}
    base = summary["plain_text"]["ttft_p50_ms"]
    for p in PATHS:
        summary[p]["ttft_p50_vs_plain_text"] = summary[p]["ttft_p50_ms"] / base
    same_text = sum(a["text"] == b["text"] for a, b in zip(rows["documents"], rows["sdk"],
                                                            strict=True))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"machine": {"cpu": platform.processor() or platform.machine(),
                          "python": platform.python_version()},
              "args": vars(args), "summary": summary,
              "documents_text_equals_sdk": f"{same_text}/{len(items)}", "rows": rows}
    (out / "any_client.json").write_text(json.dumps(result, indent=2))
    _plot(rows, summary, out / "any_client.png")
    for p in PATHS:
        s = summary[p]
        print(f"{p:11s} TTFT p50 {s['ttft_p50_ms']:7.1f} ms ({s['ttft_p50_vs_plain_text']:.2f}x "
              f"plain text)  hit rate {s['hit_rate']:.1%}")
    print(f"documents text == SDK text: {same_text}/{len(items)}; wrote {out}")


async def _connect(cls: Any, url: str) -> Any:
    return await asyncio.to_thread(cls.connect, url)


def _plot(rows: dict[str, list[dict[str, Any]]], summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for p in PATHS:
        ax.plot([r["question"] for r in rows[p]], [r["ttft_s"] * 1e3 for r in rows[p]],
                marker="o", ms=3, label=f"{p} (p50 {summary[p]['ttft_p50_ms']:.0f} ms, "
                                        f"hit {summary[p]['hit_rate']:.0%})")
    ax.set_xlabel("question (in order; documents recur at new positions)")
    ax.set_ylabel("TTFT, client-side (ms)")
    ax.set_title("Plain OpenAI client: documents field vs pasted text vs minipic SDK")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
