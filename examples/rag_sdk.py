"""RAG over offline Wikipedia through `minipic serve`, with the async SDK.

    minipic serve --port 8000 &        # then:
    python examples/rag_sdk.py http://127.0.0.1:8000
"""

import asyncio
import sys

from minipic import Orchestrator
from minipic.orchestrator.corpus import default_corpus

SYSTEM = "Answer using only the documents provided. Reply with a short phrase."
QUESTIONS = ["What is the height of K2?", "What is the headquarter of Microsoft?"]


async def main(base_url: str) -> None:
    async with Orchestrator.connect(base_url) as orc:
        batch = [(q, [p.as_document for p in default_corpus().search(q, 3)]) for q in QUESTIONS]
        for a in await orc.answer_many(batch, system=SYSTEM, max_tokens=32):
            print(f"{a.question} -> {a.text.strip()!r} (TTFT {a.ttft_s * 1e3:.0f} ms, "
                  f"cached {a.cached_tokens}/{a.prompt_tokens} prompt tokens)")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"))
