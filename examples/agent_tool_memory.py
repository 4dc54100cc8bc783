"""An agent loop whose tool descriptions and memory entries are cached spans, reused every turn.

Each model call sees the agent's tool descriptions, ordered by relevance to the user's message
(so their order changes from turn to turn), and its memory entries, newest first (so each entry
moves back one place per turn). Every description and every memory is a span: prefilled once,
then taken from the KV cache wherever it sits in a later prompt — no re-prefill because the order
changed, which a plain prefix cache cannot do. Per model call the script prints prompt and cached
tokens, the TTFT and how many span prefills had to run.

Runs on the embedded default model (SmolLM2-135M-Instruct, in-process vLLM). That model is a weak
tool user: when its reply names no known tool, a keyword router picks one, and the line says so.
Engine logs go to stderr at WARNING (``--verbose``: INFO; ``--engine-log FILE``: to a file), so
stdout holds the script's own lines only.

    python examples/agent_tool_memory.py [--model tiny-llama] [--verbose]
"""

from __future__ import annotations

import argparse
import ast
import datetime
import operator
import re
from collections.abc import Callable

from minipic.engine_logs import quiet_engine_logs
from minipic.orchestrator import Answer, SyncOrchestrator
from minipic.orchestrator.corpus import default_corpus
from minipic.prompt_builder import Span

SYSTEM = ("You are an assistant with tools. The documents describe your tools and your memory "
          "of earlier turns.")
USER_TURNS = [
    "What is 17 * 23?",
    "Who wrote Hamlet?",
    "How tall is K2 in metres?",
    "Convert 8611 metres to feet.",
    "What time is it now?",
]


def calculator(expression: str) -> str:
    """Arithmetic only: + - * / and parentheses over numbers (no names, no calls)."""
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.USub: operator.neg}

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in ops:
            return ops[type(node.op)](ev(node.operand))
        raise ValueError("not arithmetic")

    cleaned = re.sub(r"[^0-9+\-*/(). ]", "", expression).strip(" .")
    try:
        return f"{ev(ast.parse(cleaned, mode='eval').body):g}"
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"


def wiki(topic: str) -> str:
    passage = default_corpus().search(topic or "?", 1)[0]
    return f"{passage.title}: {passage.text[:160]}"


def clock(_: str) -> str:
    return datetime.datetime.now().strftime("%Y-%m-%d %H:%M")


def metres_to_feet(value: str) -> str:
    numbers = re.findall(r"[\d.,]+", value)
    return f"{float(numbers[0].replace(',', '')) * 3.28084:.0f} ft" if numbers else "error"


TOOLS: dict[str, tuple[str, Callable[[str], str]]] = {
    "calculator": ("Tool calculator: evaluates arithmetic with + - * / and parentheses. "
                   "Input: the expression, for example 17 * 23.", calculator),
    "wiki": ("Tool wiki: looks a person, place or thing up in an encyclopedia and returns its "
             "first sentences. Input: the topic, for example Hamlet.", wiki),
    "clock": ("Tool clock: tells the current date and time. Input: nothing.", clock),
    "units": ("Tool units: converts a length in metres to feet. Input: the number of metres.",
              metres_to_feet),
}


def route(message: str) -> tuple[str, str]:
    """Keyword fallback when the model names no tool."""
    low = message.lower()
    if "feet" in low or "convert" in low:
        return "units", message
    if "time" in low or "date" in low:
        return "clock", ""
    if re.search(r"\d\s*[-+*/]\s*\d", message):
        return "calculator", message
    return "wiki", message  # BM25 ignores the question words


def choose_tool(reply: str, message: str) -> tuple[str, str, str]:
    """(tool, input, who chose): the model's ``TOOL name: input`` line if it gave one."""
    found = re.search(r"TOOL\s+(\w+)\s*:?\s*(.*)", reply, re.IGNORECASE)
    if found and found.group(1).lower() in TOOLS:
        return found.group(1).lower(), found.group(2).strip() or message, "model"
    tool, arg = route(message)
    return tool, arg, "router"


def tool_spans(message: str) -> list[Span]:
    """Tool descriptions, most relevant first: the order changes with every message."""
    words = set(re.findall(r"\w+", message.lower()))

    def score(name: str) -> tuple[int, str]:
        return (-len(words & set(re.findall(r"\w+", TOOLS[name][0].lower()))), name)

    return [Span(text=TOOLS[name][0], id=f"tool:{name}") for name in sorted(TOOLS, key=score)]


def report(turn: int, call: str, a: Answer) -> None:
    warm = sum(s.status == "warm" for s in a.spans)
    print(f"  turn {turn} {call:<6} prompt {a.prompt_tokens:4d} tok | cached {a.cached_tokens:4d} "
          f"(layout: {a.expected_cached_tokens:4d}) | TTFT {a.ttft_s * 1e3:5.0f} ms | "
          f"span prefills {a.prefills_sent} | spans warm {warm}/{len(a.spans)}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model folder or alias (default: SmolLM2)")
    p.add_argument("--verbose", action="store_true", help="engine logs at INFO on stderr")
    p.add_argument("--engine-log", default=None, metavar="FILE", help="engine logs to FILE")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    quiet_engine_logs(args.verbose, args.engine_log)  # before the engine starts
    memory: list[Span] = []
    totals = [0, 0]
    with SyncOrchestrator.embedded(args.model) as agent:
        for turn, message in enumerate(USER_TURNS, 1):
            spans = tool_spans(message) + memory[::-1]  # newest memory first
            plan = agent.answer(
                f"User: {message}\nWhich tool fits, with what input? Reply as: "
                "TOOL <name>: <input>", spans, SYSTEM, max_tokens=20)
            tool, arg, chooser = choose_tool(plan.text, message)
            result = TOOLS[tool][1](arg)
            reply = agent.answer(
                f"User: {message}\nTool {tool} returned: {result}\nAnswer the user in one "
                "short sentence.", spans, SYSTEM, max_tokens=40)
            print(f"turn {turn}: {message}\n  {tool}({arg!r}) by {chooser} -> {result[:70]!r}\n"
                  f"  reply: {' '.join(reply.text.split())[:100]}")
            for call, answer in (("plan", plan), ("reply", reply)):
                report(turn, call, answer)
                totals[0] += answer.cached_tokens
                totals[1] += answer.prompt_tokens
            memory.append(Span(text=f"Memory of turn {turn}: the user asked {message!r}; "
                                    f"{tool} gave {result[:80]!r}.", id=f"memory:{turn}"))
    print(f"cached {totals[0]} of {totals[1]} prompt tokens over {len(USER_TURNS)} turns")


if __name__ == "__main__":
    main()
