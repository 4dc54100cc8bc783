"""A model that is not position-free never takes the server down (issue 52).

A real ``minipic serve`` on a tiny OLMo 2 (run by vLLM's Transformers backend, whose attention
rotates inside transformers' code: refused, docs/models.md). It
says so at start and in ``GET /minipic/config``; then 100 requests, concurrently and mixed:
raw span-opted-in completions (``vllm_xargs``) get a 400 naming the refused layer and why,
plain completions answer, documents requests answer as the plain prompt (the response's
``minipic.fallback`` says so) with exactly the tokens the plain prompt gets. After all of them
the server is up and still answers. Before this, the first opted-in request stopped the
EngineCore and every later request failed.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from support.model_families import BY_NAME, family_dir
from support.servers import ServerProcess

pytestmark = pytest.mark.server

FAMILY = BY_NAME["OLMo 2"]
WORDS = "amber basalt cedar delta ember fjord granite harbor iris juniper kelp lumen".split()


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--model", str(family_dir(FAMILY)), "--max-model-len", "1024",
                         "--kv-cache-gib", "1", "--span-store", "off").start()
    yield proc
    proc.stop()


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def test_refused_at_start_and_in_config(server: ServerProcess) -> None:
    config = httpx.get(server.base_url + "/minipic/config", timeout=30).json()
    support = config["model_support"]
    assert support["position_free"] is False and FAMILY.expect in support["reason"]
    with open(server.log_path) as fh:
        log = fh.read()
    assert "NOT position-free" in log and FAMILY.expect in log


def test_mixed_concurrent_requests_leave_the_server_up(server: ServerProcess, seed: int) -> None:
    from minipic.prompt_builder import PromptBuilder

    rng = random.Random(seed)
    url = server.base_url
    builder = PromptBuilder.from_pretrained(str(family_dir(FAMILY)), block_size=32,
                                            max_model_len=1024)
    cfg = builder.span_config
    kinds = ["raw", "plain", "documents"] * 34
    rng.shuffle(kinds)
    kinds = kinds[:100]
    docs = [{"text": _text(rng, rng.randint(10, 40))} for _ in range(3)]
    question = "Which word comes first?"

    def body(kind: str, i: int) -> tuple[str, dict[str, Any]]:
        if kind == "documents":
            return "/v1/completions", {"model": "minipic", "max_tokens": 4, "temperature": 0,
                                       "minipic": {"question": question, "documents": docs}}
        ids = [rng.randrange(100, 1000) for _ in range(40)]
        out = {"model": "minipic", "prompt": ids, "max_tokens": 4, "temperature": 0}
        if kind == "raw":  # a span layout, opted in by hand
            out["prompt"] = [cfg.ssep_id, *ids, *[cfg.pad_id] * 23, cfg.pdep_id, 200]
            out["vllm_xargs"] = {"minipic_spans": True}
        return "/v1/completions", out

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(client.post(url + path, json=payload)
                                          for path, payload in (body(k, i)
                                                                for i, k in enumerate(kinds))))

    responses = asyncio.run(run())
    for kind, response in zip(kinds, responses, strict=True):
        if kind == "raw":
            assert response.status_code == 400, response.text
            message = response.json()["error"]["message"]
            assert "not position-free" in message and FAMILY.expect in message
            assert "self_attn" in message  # names the layer
        else:
            assert response.status_code == 200, (kind, response.text)
            assert len(response.json()["choices"][0]["text"]) >= 0
        if kind == "documents":
            evidence = response.json()["minipic"]
            assert evidence["fallback"]["served_as"] == "plain prompt"
            assert evidence["prefills_sent"] == 0
    assert httpx.get(url + "/health", timeout=30).status_code == 200

    # documents are answered exactly as their plain prompt
    plain = builder.build(question=question, spans=[d["text"] for d in docs], mode="prefix")
    doc_answer = next(r for k, r in zip(kinds, responses, strict=True) if k == "documents")
    again = httpx.post(url + "/v1/completions", timeout=300, json={
        "model": "minipic", "prompt": plain.prompt_token_ids, "max_tokens": 4, "temperature": 0,
        "return_token_ids": True}).json()
    assert doc_answer.json()["minipic"]["prompt_tokens"] == len(plain.prompt_token_ids)
    assert doc_answer.json()["choices"][0]["text"] == again["choices"][0]["text"]


def test_official_client_documents_on_a_refused_model(server: ServerProcess) -> None:
    """A chat client that sends documents gets an answer and the reason it was plain."""
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(
        model="minipic", max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": "Which word comes first?"}],
        extra_body={"documents": [{"title": "a", "text": "amber basalt cedar"}]})
    evidence = reply.model_extra["minipic"]
    assert evidence["fallback"]["served_as"] == "plain prompt"
    assert FAMILY.expect in evidence["fallback"]["reason"]


def test_sdk_answers_documents_as_the_plain_prompt(server: ServerProcess) -> None:
    """``Orchestrator.connect``: documents answered from the plain prompt, never opted in, with
    ``Answer.fallback`` saying why; the same tokens as the plain prompt sent by hand."""
    from minipic.orchestrator import SyncOrchestrator

    docs = ["amber basalt cedar delta", "ember fjord granite harbor"]
    with SyncOrchestrator.connect(server.base_url) as orc:
        support = orc.check_model()
        assert support is not None and not support.position_free
        answer = orc.answer("Which word comes first?", docs, max_tokens=4)
        plain = orc.build("Which word comes first?", docs, mode="prefix")
    assert answer.mode.value == "prefix" and answer.prefills_sent == 0
    assert answer.fallback is not None and FAMILY.expect in answer.fallback
    direct = httpx.post(server.base_url + "/v1/completions", timeout=300, json={
        "model": "minipic", "prompt": plain.prompt_token_ids, "max_tokens": 4,
        "temperature": 0}).json()
    assert answer.text == direct["choices"][0]["text"]
