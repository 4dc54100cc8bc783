"""Outages, seen from the orchestrator (issue 14, items 2 and 10): a server that is down costs a
bounded number of sends, and a server that comes back with another span configuration is named.

Real parts only: ``HttpBackend`` against a closed port (connection refused, as when
``minipic serve`` is down), a small real HTTP server that answers ``/health`` and
``/minipic/config`` only (the circuit's probe and re-check; completions are not needed to test
them), and — in the ``server`` test — a real ``minipic serve`` restarted on the same port with
another ``--block-size``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from support.counting_backend import CountingBackend
from support.servers import ServerProcess, free_port

from minipic.orchestrator import (
    Answer,
    BackendInfo,
    BadInputError,
    ConfigMismatchError,
    EngineUnreachableError,
    Orchestrator,
    RetryPolicy,
    SyncOrchestrator,
)
from minipic.orchestrator.http_backend import HttpBackend
from minipic.prompt_builder import PromptBuilder, SpanConfig


def doc(name: str, words: int = 30) -> str:
    return f"{name}: " + " ".join(f"{name.lower()}{i}" for i in range(words))


@pytest.fixture(scope="module")
def builder() -> PromptBuilder:
    return PromptBuilder.from_pretrained("tiny-llama", max_model_len=2048)


def http_backend(url: str, config: SpanConfig) -> CountingBackend:
    """A real ``HttpBackend`` as ``connect`` would have made it for a server that is gone now."""
    info = BackendInfo(kind="http", model="tiny", tokenizer="tiny-llama", max_model_len=2048,
                       span_config=config)
    return CountingBackend(HttpBackend(url, info), owns_inner=True)


class ConfigServer:
    """A real HTTP server on ``port`` that answers ``GET /health`` (200) and ``GET
    /minipic/config`` (``config``, changeable while it runs); anything else is 404. ``seen``
    lists every request as ``"METHOD /path"``."""

    def __init__(self, port: int, config: SpanConfig) -> None:
        self.config = config
        self.seen: list[str] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                owner.seen.append(f"GET {self.path}")
                if self.path == "/health":
                    self._answer(200, {})
                elif self.path == "/minipic/config":
                    self._answer(200, {"enabled": True,
                                       "span_config": owner.config.model_dump()})
                else:
                    self._answer(404, {"error": {"message": "not here"}})

            def do_POST(self) -> None:  # noqa: N802
                owner.seen.append(f"POST {self.path}")
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self._answer(404, {"error": {"message": "no completions on this server"}})

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> ConfigServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


# -- item 2: a retry storm ---------------------------------------------------------------------


@pytest.mark.fast
async def test_an_outage_costs_a_bounded_number_of_sends(builder) -> None:
    """20 questions against a server that stays down for the whole retry budget (3 s).

    Before: every question retried on its own timer — several hundred sends in 3 s. Now: the
    first wave (at most ``max_in_flight`` requests, sent before anyone knew) and then none; the
    circuit alone probes ``/health``, with backoff, and each question gives up on its own
    budget."""
    backend = http_backend(f"http://127.0.0.1:{free_port()}", builder.span_config)
    policy = RetryPolicy(max_attempts=10_000, backoff_s=0.05, max_backoff_s=0.4,
                         give_up_after_s=3.0)
    orc = Orchestrator(backend, builder, options={"retry": policy, "max_in_flight": 8})
    batch = [(f"q{i}?", [doc(f"Down{i}"), doc("DownShared")]) for i in range(20)]
    started = time.monotonic()
    with orc.record_events() as log:
        results = await orc.answer_many(batch, max_tokens=2)
    elapsed = time.monotonic() - started
    await orc.aclose()
    assert [type(r) for r in results] == [EngineUnreachableError] * 20
    assert [r.question_index for r in results] == list(range(20))
    assert "still failing after" in str(results[0])
    assert len(backend.calls) <= 8, f"{len(backend.calls)} sends during the outage"
    # backoff 0.05 s doubling to 0.4 s (jittered to >= half): at most ~3 + 3 / 0.2 probes
    assert 3 <= backend.health_checks <= 18, backend.health_checks
    kinds = [e.kind for e in log]
    assert kinds.count("circuit_open") == 1 and kinds.count("registry_reset") == 1
    assert 3.0 <= elapsed < 6.0, "each question waits its own budget, all at the same time"


# -- item 10: a server back with another span configuration ---------------------------------


@pytest.mark.fast
async def test_server_back_with_another_config_is_refused_without_sending(builder) -> None:
    port = free_port()
    ours = builder.span_config
    backend = http_backend(f"http://127.0.0.1:{port}", ours)
    policy = RetryPolicy(max_attempts=10_000, backoff_s=0.05, max_backoff_s=0.2,
                         give_up_after_s=30)
    orc = Orchestrator(backend, builder, options={"retry": policy})
    batch = [(f"q{i}?", [doc(f"Cfg{i}")]) for i in range(3)]
    with orc.record_events() as log:
        pending = asyncio.create_task(orc.answer_many(batch, max_tokens=2))
        async with asyncio.timeout(10):
            while "circuit_open" not in [e.kind for e in log]:  # the server is down ...
                await asyncio.sleep(0.01)
        sent_while_down = len(backend.calls)
        other = ours.model_copy(update={"block_size": 2 * ours.block_size})
        with ConfigServer(port, other) as server:  # ... and comes back with 64-token blocks
            results = await asyncio.wait_for(pending, 20)
            assert [type(r) for r in results] == [ConfigMismatchError] * 3
            assert "block_size 32 -> 64" in str(results[0])
            assert len(backend.calls) == sent_while_down, "nothing sent to the changed server"
            assert not [r for r in server.seen if r.startswith("POST")]
            with pytest.raises(ConfigMismatchError):  # later calls too, still without a send
                await orc.answer("again?", [doc("Cfg0")], max_tokens=2)
            assert not [r for r in server.seen if r.startswith("POST")]
            # restarted with our configuration again: requests go through (this server has no
            # completions, so the engine's 404 comes back as bad input — but it was sent)
            server.config = ours
            await asyncio.sleep(1.1)  # RECHECK_S: the configuration is re-read at most that often
            with pytest.raises(BadInputError, match="404"):
                await orc.answer("back?", [doc("Cfg0")], max_tokens=2)
            assert [r for r in server.seen if r.startswith("POST")]
    await orc.aclose()


@pytest.fixture
def restartable() -> Iterator[ServerProcess]:
    server = ServerProcess("--model", "tiny-llama", "--max-model-len", "2048")
    yield server
    server.stop()


@pytest.mark.server
def test_minipic_serve_restarted_with_another_block_size(restartable: ServerProcess) -> None:
    """The issue's run: connect to a block-32 server, restart it with ``--block-size 64`` on the
    same port. ``busy`` has a batch waiting through the restart (a lost connection: the circuit
    re-reads the configuration before sending again); ``idle`` sent nothing meanwhile (its next
    final finds every span cold, which re-reads it too). Both get ``ConfigMismatchError``."""
    server = restartable.start()
    patient = RetryPolicy(max_attempts=1000, backoff_s=0.2, max_backoff_s=2,
                          give_up_after_s=300)
    with (SyncOrchestrator.connect(server.base_url, options={"retry": patient}) as busy,
          SyncOrchestrator.connect(server.base_url) as idle):
        for orc in (busy, idle):
            first = orc.answer("q?", [doc("Restart1"), doc("Restart2")], max_tokens=2)
            assert isinstance(first, Answer) and first.cache_ok
        server.stop()
        with busy.record_events() as log:
            pending = busy.submit(busy.aio.answer_many(
                [(f"q{i}?", [doc("Restart1"), doc(f"Restart{i}")]) for i in range(3)],
                max_tokens=2))
            deadline = time.monotonic() + 30
            while "circuit_open" not in [e.kind for e in log]:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            server.args = (*server.args, "--block-size", "64")
            server.start()
            results = pending.result(timeout=300)
        assert [type(r) for r in results] == [ConfigMismatchError] * 3, results
        assert "block_size 32 -> 64" in str(results[0])
        with pytest.raises(ConfigMismatchError, match="block_size 32 -> 64"):
            idle.answer("q?", [doc("Restart1"), doc("Restart2")], max_tokens=2)
