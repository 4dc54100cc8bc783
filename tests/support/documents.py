"""The system prompt and the synthetic documents the SDK tests send (``test_orchestrator.py``,
``test_orchestrator_http.py``)."""

from __future__ import annotations

# the demo's system prompt (minipic/demo.py): the real-answer tests check the default model's
# answer with it
SYSTEM = ("You are a concise assistant. Answer the question using only the documents provided. "
          "Reply with a short phrase, not a sentence.")


def doc(name: str, words: int = 40) -> str:
    """``"<name>: <name>0 <name>1 ..."`` with ``words`` numbered words: one name, one document
    (its span), and answers the tests can ask for (``"What is alpha3?"``)."""
    return f"{name}: " + " ".join(f"{name.lower()}{i}" for i in range(words))
