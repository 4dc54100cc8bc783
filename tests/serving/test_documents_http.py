"""Any OpenAI client gets spans: documents on the standard routes of a real ``minipic serve``
(``serving/documents``), with fresh random documents every run.

* the official ``openai`` client, documents in ``extra_body``: cold and warm outputs equal, the
  cached tokens and the text equal the SDK's for the same inputs, streamed text equals unstreamed;
* ``n``, logprobs, stop and ``max_tokens`` behave as on the plain routes;
* 50 concurrent requests sharing 5 cold documents compute each span once;
* ``langchain-openai``'s ``ChatOpenAI`` in an LCEL chain, streamed and not;
* LlamaIndex: a query engine over a retriever answers, streams and reports cached tokens;
* bad bodies get an OpenAI-format 400 naming the item, and the server keeps serving; a plain
  request is stock.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from support.servers import ServerProcess

pytestmark = [pytest.mark.server, pytest.mark.shares("smol_server")]

VOCAB = ["river", "stone", "lamp", "orbit", "cedar", "quartz", "harbor", "violet", "ember",
         "glacier", "meadow", "copper", "falcon", "lantern", "tundra", "saffron", "basalt"]


@pytest.fixture(scope="module")
def server(smol_server: ServerProcess) -> ServerProcess:
    return smol_server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def sdk(server: ServerProcess) -> Iterator[Any]:
    from minipic.orchestrator import SyncOrchestrator

    orc = SyncOrchestrator.connect(server.base_url)
    yield orc
    orc.close()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(n))


def documents(rng: random.Random, n: int) -> list[dict[str, str]]:
    return [{"title": words(rng, 2).title(), "text": words(rng, rng.randint(25, 70))}
            for _ in range(n)]


def as_span_text(doc: dict[str, str]) -> str:
    return f"{doc['title']}: {doc['text']}" if doc.get("title") else doc["text"]


def stats(server: ServerProcess) -> dict[str, Any]:
    return httpx.get(server.base_url + "/minipic/documents", timeout=30).json()


def chat(client: Any, messages: list[dict[str, str]], docs: list[dict[str, str]],
         **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model="minipic", messages=messages,
        extra_body={"documents": docs, **kwargs.pop("extra_body", {})},
        **{"max_tokens": 8, "temperature": 0, **kwargs})


def test_openai_chat_cold_warm_stream_and_sdk_agree(server, client, sdk, seed) -> None:
    rng = random.Random(seed)
    # SmolLM2 sometimes answers with EOS first (seed 1251024259): an empty answer would make the
    # text comparisons further down vacuous, so inputs are drawn until the model says
    # something -- and every draw, the empty ones too, must give the same cold and warm answer
    # with the same cache evidence (a draw thrown away unchecked could hide a difference).
    for _ in range(4):
        docs = documents(rng, 3)
        system, question = words(rng, 6), words(rng, 5) + "?"
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        cold = chat(client, messages, docs)
        warm = chat(client, messages, docs)
        evidence = cold.model_extra["minipic"]
        assert [s["status"] for s in evidence["spans"]] == ["cold"] * 4  # system + 3 documents
        assert [s["status"] for s in warm.model_extra["minipic"]["spans"]] == ["warm"] * 4
        assert warm.model_extra["minipic"]["prefills_sent"] == 0
        assert warm.choices[0].message.content == cold.choices[0].message.content
        assert warm.choices[0].finish_reason == cold.choices[0].finish_reason
        expected = evidence["expected_cached_tokens"]
        # the server prefilled before the final went: cold and warm finals hit alike
        for response in (cold, warm):
            assert response.usage.prompt_tokens_details.cached_tokens == expected > 0
            assert response.usage.prompt_tokens == evidence["prompt_tokens"]
        if cold.choices[0].message.content:
            break
    text = cold.choices[0].message.content
    assert text, "four fresh draws all answered with EOS first"

    answer = sdk.answer(question, [as_span_text(d) for d in docs], system, max_tokens=8)
    assert answer.text == text
    assert answer.prompt_tokens == warm.usage.prompt_tokens
    assert answer.cached_tokens == warm.usage.prompt_tokens_details.cached_tokens
    assert answer.expected_cached_tokens == expected

    stream = list(chat(client, messages, docs, stream=True))
    assert "minipic" in (stream[0].model_extra or {})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_completions_route_takes_a_minipic_object(server, client, sdk, seed) -> None:
    rng = random.Random(seed + 1)
    docs = documents(rng, 2)
    question = words(rng, 4) + "?"
    body = {"minipic": {"question": question, "documents": docs}}
    first = client.completions.create(model="minipic", prompt="", max_tokens=6, temperature=0,
                                      extra_body=body)
    again = client.completions.create(model="minipic", prompt="", max_tokens=6, temperature=0,
                                      extra_body=body)
    assert first.choices[0].text == again.choices[0].text
    expected = first.model_extra["minipic"]["expected_cached_tokens"]
    assert again.usage.prompt_tokens_details.cached_tokens == expected > 0
    answer = sdk.answer(question, [as_span_text(d) for d in docs], max_tokens=6)
    assert answer.text == first.choices[0].text and answer.cached_tokens == expected
    # a budgeted mode in the request object: the SDK's layout and answer, byte for byte
    body["minipic"]["mode"] = "selective@0.5"
    chosen = client.completions.create(model="minipic", prompt="", max_tokens=6, temperature=0,
                                       extra_body=body)
    assert chosen.model_extra["minipic"]["mode_spec"] == "selective@0.5"
    same = sdk.answer(question, [as_span_text(d) for d in docs], mode="selective@0.5",
                      max_tokens=6)
    assert same.text == chosen.choices[0].text, (same.text, chosen.choices[0].text)
    assert chosen.model_extra["minipic"]["expected_cached_tokens"] == same.expected_cached_tokens


def test_sampling_options_behave_as_on_the_plain_route(server, client, seed) -> None:
    rng = random.Random(seed + 2)
    docs = documents(rng, 2)
    messages = [{"role": "user", "content": words(rng, 5) + "?"}]
    several = chat(client, messages, docs, n=2, max_tokens=5, temperature=1.0, seed=seed)
    assert [c.index for c in several.choices] == [0, 1]
    assert all(c.message.content is not None for c in several.choices)
    assert several.usage.completion_tokens <= 2 * 5
    again = chat(client, messages, docs, n=2, max_tokens=5, temperature=1.0, seed=seed)
    assert ([c.message.content for c in again.choices]
            == [c.message.content for c in several.choices])  # seeded: as reproducible
    lp = chat(client, messages, docs, logprobs=True, top_logprobs=2, max_tokens=4)
    content = lp.choices[0].logprobs.content
    assert 1 <= len(content) <= 4 and all(len(t.top_logprobs) == 2 for t in content)
    full = chat(client, messages, docs, max_tokens=12).choices[0].message.content
    cut = next((w for w in full.split() if len(w) > 2), None)
    if cut is not None:
        stopped = chat(client, messages, docs, max_tokens=12, stop=[cut])
        assert stopped.choices[0].message.content == full[:full.index(cut)]
        assert stopped.choices[0].finish_reason == "stop"
    short = chat(client, messages, docs, max_tokens=2)
    assert short.usage.completion_tokens <= 2


def test_concurrent_requests_compute_each_cold_span_once(server, sdk, seed) -> None:
    """50 requests over 5 cold documents: the server sends one prefill per distinct span (the
    SDK's own layout of the same 50 requests says how many distinct spans there are), and every
    final finds all of them cached."""
    from openai import AsyncOpenAI

    rng = random.Random(seed + 3)
    docs = documents(rng, 5)
    system = words(rng, 7)
    requests = [(words(rng, 4) + "?", rng.sample(docs, rng.randint(2, 4))) for _ in range(50)]
    keys = set()
    for question, chosen in requests:
        built = sdk.build(question, [as_span_text(d) for d in chosen], system, max_tokens=2)
        keys.update(built.prefill_keys)
    before = stats(server)

    async def burst() -> list[Any]:
        aclient = AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0,
                              timeout=600)
        try:
            return await asyncio.gather(*(aclient.chat.completions.create(
                model="minipic", max_tokens=2, temperature=0,
                messages=[{"role": "system", "content": system},
                          {"role": "user", "content": question}],
                extra_body={"documents": chosen}) for question, chosen in requests))
        finally:
            await aclient.close()

    responses = asyncio.run(burst())
    after = stats(server)
    assert after["requests"] - before["requests"] == 50
    assert after["prefills_sent"] - before["prefills_sent"] == len(keys)
    for response in responses:
        assert (response.usage.prompt_tokens_details.cached_tokens
                == response.model_extra["minipic"]["expected_cached_tokens"])


def test_langchain_openai_chat_model_in_an_lcel_chain(server, client, seed) -> None:
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_openai import ChatOpenAI

    rng = random.Random(seed + 4)
    docs = documents(rng, 2)
    system, question = words(rng, 5), words(rng, 5) + "?"
    llm = ChatOpenAI(base_url=server.base_url + "/v1", api_key="none", model="minipic",
                     temperature=0, max_tokens=8, max_retries=0,
                     extra_body={"documents": docs})
    chain = ChatPromptTemplate.from_messages([("system", system), ("human", "{q}")]) | llm | (
        StrOutputParser())
    text = chain.invoke({"q": question})
    assert text and "".join(chain.stream({"q": question})) == text
    reference = chat(client, [{"role": "system", "content": system},
                              {"role": "user", "content": question}], docs)
    assert reference.choices[0].message.content == text
    message = (ChatPromptTemplate.from_messages([("system", system), ("human", "{q}")]) | llm
               ).invoke({"q": question})
    details = message.usage_metadata["input_token_details"]
    assert details["cache_read"] == reference.model_extra["minipic"]["expected_cached_tokens"]


def test_llamaindex_query_engine_answers_streams_and_reports_cache(server, sdk) -> None:
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.core.callbacks import CallbackManager, TokenCountingHandler
    from llama_index.core.embeddings import MockEmbedding

    from minipic.integrations.llamaindex import (
        MinipicLLM,
        SpanSynthesizer,
        WikiRetriever,
        span_query_engine,
    )

    engine = span_query_engine(WikiRetriever(k=2), sdk, answer_kwargs={"max_tokens": 8})
    query = "Which river flows through Paris?"
    first = engine.query(query)
    second = engine.query(query)
    assert str(first) and str(second) == str(first)
    assert len(first.source_nodes) == 2
    usage = second.metadata["minipic"]["usage"]
    expected = second.metadata["minipic"]["expected_cached_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == expected > 0

    counter = TokenCountingHandler()
    streaming = span_query_engine(WikiRetriever(k=2), sdk, streaming=True,
                                  answer_kwargs={"max_tokens": 8},
                                  callback_manager=CallbackManager([counter]))
    streamed = streaming.query(query)
    assert "".join(streamed.response_gen) == str(first)
    assert streamed.metadata["minipic"]["usage"]["prompt_tokens"] == usage["prompt_tokens"]
    assert counter.prompt_llm_token_count == usage["prompt_tokens"]  # LlamaIndex's own event

    # any index takes the synthesizer: as_query_engine over a VectorStoreIndex
    texts = ["The Seine flows through Paris.", "The Thames flows through London."]
    index = VectorStoreIndex.from_documents([Document(text=t) for t in texts],
                                            embed_model=MockEmbedding(embed_dim=8))
    llm = MinipicLLM(orchestrator=sdk, answer_kwargs={"max_tokens": 6})
    qe = index.as_query_engine(llm=llm, response_synthesizer=SpanSynthesizer(llm=llm),
                               similarity_top_k=2)
    response = qe.query("Which river flows through Paris?")
    spans = response.metadata["minipic"]["spans"]
    assert str(response) and [s["index"] for s in spans if s["kind"] == "span"] == [0, 1]


BAD_CHAT = [
    ({"documents": [{"text": 5}]}, "documents[0].text"),
    ({"documents": [{"text": "a", "body": "b"}]}, "documents[0].body"),
    ({"documents": ["ok", 3]}, "documents[1]"),
    ({"documents": []}, "documents"),
    ({"documents": "one string"}, "documents"),
    ({"documents": [{"text": "x"}], "minipic": {"mode": "nope"}}, "minipic.mode"),
    ({"documents": [{"text": "x"}], "minipic": {"mode": "selective@2"}}, "minipic.mode"),
    ({"documents": [{"text": "x"}], "minipic": {"mode": "block_attention@3"}}, "minipic.mode"),
    ({"documents": [{"text": "x"}], "minipic": {"budget": "never"}}, "minipic.budget"),
    ({"documents": [{"text": "x"}], "minipic": {"colour": 1}}, "minipic.colour"),
    ({"documents": [{"text": "x"}], "tools": [{"type": "function",
                                               "function": {"name": "f"}}]}, "tools"),
    ({"minipic": {"mode": "prefix"}}, "documents"),
    ({"documents": ["x"], "messages": [{"role": ["user"], "content": "q?"}]}, "messages[0].role"),
    ({"documents": ["x"], "messages": [{"role": {"r": 1}, "content": "q?"}]}, "messages[0].role"),
    ({"documents": ["x"] * 1025}, "documents"),  # over --max-documents (1024)
    ({"documents": ["ok", "y" * 1_000_001]}, "documents[1].text"),  # over --max-document-chars
]


@pytest.mark.parametrize(("extra", "param"), BAD_CHAT)
def test_bad_bodies_get_a_400_naming_the_item(server, extra, param) -> None:
    body = {"model": "minipic", "messages": [{"role": "user", "content": "which river?"}],
            "max_tokens": 2, **extra}
    response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "BadRequestError", error


def test_budget_errors_and_other_bad_bodies_leave_the_server_serving(server, client) -> None:
    huge = " ".join(["river stone lamp"] * 1200)  # far over max_model_len 2048
    over = httpx.post(server.base_url + "/v1/chat/completions", json={
        "model": "minipic", "messages": [{"role": "user", "content": "which?"}],
        "documents": [{"text": huge}]}, timeout=60)
    assert over.status_code == 400 and "2048" in over.json()["error"]["message"], over.text
    dropped = httpx.post(server.base_url + "/v1/chat/completions", json={
        "model": "minipic", "messages": [{"role": "user", "content": "which?"}], "max_tokens": 2,
        "documents": [{"text": huge}, {"text": "a short one"}],
        "minipic": {"budget": "drop"}}, timeout=120)
    assert dropped.status_code == 200, dropped.text
    assert dropped.json()["minipic"]["budget"]["dropped"]
    no_question = httpx.post(server.base_url + "/v1/completions", json={
        "model": "minipic", "minipic": {"documents": ["x"]}}, timeout=60)
    assert no_question.status_code == 400
    assert no_question.json()["error"]["param"] == "minipic.question"
    both = httpx.post(server.base_url + "/v1/completions", json={
        "model": "minipic", "prompt": "hi", "minipic": {"question": "q", "documents": ["x"]}},
        timeout=60)
    assert both.status_code == 400 and both.json()["error"]["param"] == "prompt"
    garbage = httpx.post(server.base_url + "/v1/chat/completions", content=b"\xff{",
                         headers={"content-type": "application/json"}, timeout=60)
    assert garbage.status_code == 400  # vLLM's own answer to bytes that are not JSON

    # a plain request, untouched: no minipic object, the chat template's own prompt
    from transformers import AutoTokenizer

    from minipic.span_contract.models import resolve_model

    messages = [{"role": "user", "content": "Which river flows through Paris?"}]
    plain = client.chat.completions.create(model="minipic", messages=messages, max_tokens=3,
                                           temperature=0)
    assert "minipic" not in (plain.model_extra or {})
    rendered = AutoTokenizer.from_pretrained(resolve_model(None)).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True)
    ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
    assert plain.usage.prompt_tokens == len(ids)


def test_a_body_over_the_limit_gets_a_413_and_the_server_keeps_serving(server, client) -> None:
    """A client declaring a 64 MiB body (the limit is 32 MiB) is refused before the body is
    read: a raw HTTP request, so the body need not be sent at all."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(server.base_url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 67108864\r\n\r\n{")
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), reply[:300]
    error = json.loads(payload)["error"]
    assert error["type"] == "RequestTooLargeError" and "--max-body-mib" in error["message"]
    plain = client.completions.create(model="minipic", prompt="river", max_tokens=1)
    assert plain.choices[0].text is not None


def test_health_answers_while_a_large_request_is_laid_out(server, seed) -> None:
    """Documents are tokenized off the event loop: /health, sent while a request of ~8 MB of
    documents is being laid out, answers before that request does (it then fails its budget:
    far over max_model_len). Were the layout on the loop, /health would wait for all of it."""
    rng = random.Random(seed)
    docs = [{"text": words(rng, 150_000)[:990_000]} for _ in range(8)]
    body = {"model": "minipic", "messages": [{"role": "user", "content": "which river?"}],
            "max_tokens": 1, "documents": docs}
    order: list[str] = []

    async def run() -> tuple[int, float]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as http:
            async def big() -> int:
                response = await http.post("/v1/chat/completions", json=body)
                order.append("documents")
                return response.status_code

            task = asyncio.create_task(big())
            await asyncio.sleep(1.0)  # the body is sent and being laid out (several seconds)
            assert not task.done(), "the layout finished before /health was sent: too small"
            started = asyncio.get_running_loop().time()
            health = await http.get("/health")
            waited = asyncio.get_running_loop().time() - started
            order.append("health")
            assert health.status_code == 200
            return await task, waited

    status, waited = asyncio.run(run())
    assert status == 400  # the budget: 8 documents of ~160k tokens each
    assert order == ["health", "documents"], (order, f"/health waited {waited:.2f} s")


def test_documents_for_an_unknown_model_are_refused_before_any_prefill(server) -> None:
    before = stats(server)["prefills_sent"]
    response = httpx.post(server.base_url + "/v1/chat/completions", json={
        "model": "no-such-adapter", "messages": [{"role": "user", "content": "which?"}],
        "documents": [{"text": f"a cold document {random.random()}"}]}, timeout=60)
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert error["param"] == "model" and "no-such-adapter" in error["message"]
    assert stats(server)["prefills_sent"] == before  # nothing was prefilled for it
