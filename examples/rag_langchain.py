"""The same RAG as an LCEL chain: WikiRetriever -> SpanRAGRunnable -> a formatter.

    minipic serve --port 8000 &        # then:
    python examples/rag_langchain.py http://127.0.0.1:8000
"""

import sys

from langchain_core.runnables import RunnableLambda

from minipic import SyncOrchestrator
from minipic.integrations.langchain import SpanRAGRunnable, WikiRetriever

SYSTEM = "Answer using only the documents provided. Reply with a short phrase."


if __name__ == "__main__":
    base_url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"
    with SyncOrchestrator.connect(base_url) as orc:
        # output="answer": the full Answer (default "text": the reply, for StrOutputParser
        # and tools; "message": an AIMessage with usage_metadata)
        rag = SpanRAGRunnable(retriever=WikiRetriever(k=3), orchestrator=orc, output="answer",
                              system=SYSTEM, answer_kwargs={"max_tokens": 32})
        chain = rag | RunnableLambda(lambda a: f"{a.question} -> {a.text.strip()!r} "
                                               f"[cached {a.cached_tokens}/{a.prompt_tokens}]")
        for line in chain.batch(["What is the height of K2?", "What is the origin city of Queen?"]):
            print(line)
