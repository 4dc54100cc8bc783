"""``minipic demo``: a small RAG run on the real default model, in-process.

Real questions (fanoutqa sub-questions answerable from the offline Wikipedia corpus), BM25
retrieval of a few passages, answers from SmolLM2-135M-Instruct on vLLM, and per question the
time to first token and how many prompt tokens the engine found in its prefix cache.
"""

from __future__ import annotations

import argparse
import time

SYSTEM_PROMPT = (
    "You are a concise assistant. Answer the question using only the documents provided. "
    "Reply with a short phrase, not a sentence."
)


def add_subparser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="answer real questions over the offline Wikipedia corpus with the default model",
        description=(
            "Runs a small retrieval-augmented QA job in-process: BM25 retrieves passages from "
            "10k offline Wikipedia lead sections, SmolLM2-135M-Instruct answers on vLLM (CPU), "
            "and each answer is printed with its time to first token and cached prompt tokens."
        ),
    )
    p.add_argument("--questions", type=int, default=6, help="how many questions (default: 6)")
    p.add_argument("--k", type=int, default=3, help="passages retrieved per question (default: 3)")
    p.add_argument("--max-tokens", type=int, default=24, help="answer length cap (default: 24)")
    p.add_argument("--model", default=None, help="model folder (default: embedded SmolLM2)")
    p.set_defaults(func=run)


def build_messages(question: str, passages: list) -> list[dict[str, str]]:
    docs = "\n\n".join(f"[{i + 1}] {p.as_document}" for i, p in enumerate(passages))
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": f"Documents:\n{docs}\n\nQuestion: {question}"},
    ]


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from minipic.engine_config import build_llm, close_llm
    from orchestrator.corpus import default_corpus, load_qa_items

    console = Console()
    console.print("[bold]minipic demo[/] — loading corpus, model and engine (about a minute)…")
    items = load_qa_items()[: args.questions]
    corpus = default_corpus()
    llm = build_llm(model=args.model)
    table = Table(title="RAG answers (SmolLM2-135M-Instruct, vLLM CPU)")
    for col in ("question", "answer", "gold", "ok", "TTFT ms", "prompt tok", "cached tok"):
        table.add_column(col, overflow="fold")
    started = time.perf_counter()
    try:
        correct = _answer_all(llm, items, corpus, args, table, console)
    finally:
        close_llm(llm)
    console.print(table)
    console.print(f"{correct}/{len(items)} answers contain the gold answer; "
                  f"{time.perf_counter() - started:.1f} s total.")
    return 0


def _answer_all(llm, items, corpus, args, table, console) -> int:
    from rich.progress import track
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tokenizer = llm.get_tokenizer()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    correct = 0
    for item in track(items, description="answering", console=console):
        passages = corpus.search(item.question, args.k)
        text_prompt = tokenizer.apply_chat_template(
            build_messages(item.question, passages), add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer.encode(text_prompt, add_special_tokens=False)
        out = llm.generate([TokensPrompt(prompt_token_ids=list(ids))], params, use_tqdm=False)[0]
        text = out.outputs[0].text.strip()
        ok = item.answer.lower() in text.lower()
        correct += ok
        ttft = out.metrics.first_token_latency * 1000 if out.metrics else float("nan")
        table.add_row(item.question, text, item.answer, "✓" if ok else "✗", f"{ttft:.0f}",
                      str(len(out.prompt_token_ids)), str(out.num_cached_tokens))
    return correct
