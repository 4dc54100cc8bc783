"""The orchestrator against real ``minipic serve`` processes over HTTP.

``smol_server`` (conftest: default model, plugin on) serves the answer, de-dup and ISPS tests.
Cache resets and the kill-and-restart test get their own tiny-model server, started with
``--enable-cache-reset`` (``POST /minipic/reset_prefix_cache``; it boots in the background while
the other tests run) and killed with SIGKILL mid-batch, then started again on
the same port.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
from support.counting_backend import CountingBackend
from support.documents import SYSTEM, doc
from support.servers import ServerProcess, free_port

from minipic.orchestrator import (
    Answer,
    ConfigMismatchError,
    EngineError,
    EngineUnreachableError,
    MinipicError,
    Orchestrator,
    RetryPolicy,
    SyncOrchestrator,
)
from minipic.orchestrator.corpus import default_corpus
from minipic.orchestrator.http_backend import HttpBackend
from minipic.prompt_builder import PromptBuilder

pytestmark = [pytest.mark.server, pytest.mark.shares("smol_server")]

def test_connect_to_nothing_is_unreachable() -> None:
    # first in the module and server-free: the dev server boots meanwhile (autouse dev_boot)
    started = time.monotonic()
    with pytest.raises(EngineUnreachableError, match="cannot reach"):
        Orchestrator.connect(f"http://127.0.0.1:{free_port()}")
    assert time.monotonic() - started < 10


@pytest.fixture(scope="module")
def smol(smol_server: ServerProcess) -> Iterator[SyncOrchestrator]:
    orc = SyncOrchestrator.connect(smol_server.base_url)
    yield orc
    orc.close()


def test_real_answer_over_http(smol: SyncOrchestrator) -> None:
    question = "What is the height of K2?"
    docs = [p.as_document for p in default_corpus().search(question, 3)]
    salt = uuid.uuid4().hex
    for mode in ("prefix", "block_attention"):
        answer = smol.answer(question, docs, SYSTEM, mode, cache_salt=salt, max_tokens=24)
        # the plain prompt answers right; block_attention approximates it and on this question
        # misses (tests/sdk/test_orchestrator.py::test_real_answer_with_the_default_model)
        assert ("8,611" if mode == "prefix" else "K2") in answer.text, f"{mode}: {answer.text!r}"
        assert answer.cache_ok and 0 < answer.ttft_s < answer.total_s
    again = smol.answer("How tall is K2?", docs[::-1], SYSTEM, cache_salt=salt, max_tokens=8)
    assert again.prefills_sent == 0 and again.cache_ok
    assert again.cached_tokens == again.expected_cached_tokens > 0
    assert {s.status for s in again.spans} == {"warm"}


async def test_async_batch_dedups_and_pipelines(smol_server: ServerProcess) -> None:
    backend = CountingBackend(HttpBackend.connect(smol_server.base_url), owns_inner=True)
    async with Orchestrator(backend, options={"max_in_flight": 3}) as orc:
        shared, salt = doc("Shared"), uuid.uuid4().hex
        batch = [(f"question {i}?", [shared, doc(f"Own{i}")]) for i in range(5)]
        with orc.record_events() as log:
            results = await orc.answer_many(batch, cache_salt=salt, max_tokens=2)
        assert all(isinstance(r, Answer) and r.cache_ok for r in results)
        assert backend.calls.count(tuple(orc.build("q?", [shared]).span_prefills[1])) == 1
        steps = [(e.kind, e.job, e.key) for e in log]
        for job, answer in zip(sorted({e.job for e in log}), results, strict=True):
            final = steps.index(("final_sent", job, None))
            for span in answer.spans:
                assert any(k == "prefill_done" and key == span.prefill_key
                           for k, _, key in steps[:final])


def test_span_config_mismatch_is_refused(smol_server: ServerProcess) -> None:
    backend = HttpBackend.connect(smol_server.base_url)
    ours = backend.info.span_config
    wrong_ids = PromptBuilder.from_pretrained(backend.info.tokenizer, ssep_id=ours.pad_id,
                                              pdep_id=ours.pdep_id, pad_id=ours.ssep_id)
    with pytest.raises(ConfigMismatchError, match="ssep_id"):
        Orchestrator(backend, wrong_ids)
    wrong_blocks = PromptBuilder.from_pretrained(backend.info.tokenizer, block_size=64)
    with pytest.raises(ConfigMismatchError, match="block_size"):
        Orchestrator(backend, wrong_blocks)


def test_reset_needs_the_operators_flag(smol: SyncOrchestrator) -> None:
    with pytest.raises(EngineError, match="--enable-cache-reset") as err:
        smol.reset_cache()
    assert err.value.status_code == 403


def test_server_gone_after_connect(smol_server: ServerProcess) -> None:
    # retried, then reported per question
    dead = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    backend = HttpBackend.connect(smol_server.base_url)
    backend.base_url = dead
    orc = Orchestrator(backend, options={"retry": RetryPolicy(max_attempts=2, backoff_s=0.01)})
    results = asyncio.run(orc.answer_many(["q1?", "q2?"], documents=[doc("Gone")]))
    assert [type(r) for r in results] == [EngineUnreachableError] * 2
    assert time.monotonic() - started < 30


# -- our own server: reset and restart ---------------------------------------------------------


def start_dev(server: ServerProcess) -> ServerProcess:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_SERVER_DEV_MODE", "1")
        return server.start()


class BackgroundBoot:
    """Start a dev-mode server in a thread, so it boots while the smol_server tests run.

    Only the child may see VLLM_SERVER_DEV_MODE: the variable is set until the child process
    exists, then removed, before any other server of the session can be spawned."""

    def __init__(self) -> None:
        self.server = ServerProcess("--model", "tiny-llama", "--max-model-len", "2048",
                                    "--enable-cache-reset")
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._boot, daemon=True)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("VLLM_SERVER_DEV_MODE", "1")
            self.thread.start()
            while self.server.proc is None and self.thread.is_alive():
                time.sleep(0.01)

    def _boot(self) -> None:
        try:
            self.server.start()
        except BaseException as exc:  # re-raised in the test that needs the server
            self.error = exc

    def wait(self) -> ServerProcess:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.server


@pytest.fixture(scope="module", autouse=True)
def dev_boot() -> Iterator[BackgroundBoot]:
    boot = BackgroundBoot()
    yield boot
    boot.thread.join()
    boot.server.stop()


@pytest.fixture(scope="module")
def dev_server(dev_boot: BackgroundBoot) -> ServerProcess:
    return dev_boot.wait()


def test_prefix_cache_reset_over_http(dev_server: ServerProcess) -> None:
    with SyncOrchestrator.connect(dev_server.base_url) as orc:
        docs = [doc("HttpReset1"), doc("HttpReset2")]
        orc.answer("q?", docs, max_tokens=2)
        orc.submit(orc.aio.backend.reset_cache()).result()  # behind the registry's back
        orc.configure(on_cold="retry")  # re-warm and re-send (the default only reports)
        with orc.record_events() as log:
            again = orc.answer("q?", docs, max_tokens=2)
        assert "cold" in [e.kind for e in log] and again.attempts == 2 and again.cache_ok
        orc.reset_cache()
        fresh = orc.answer("q?", docs, max_tokens=2)
        assert fresh.attempts == 1 and fresh.prefills_sent == 3 and fresh.cache_ok


def test_server_killed_and_restarted_mid_batch(dev_server: ServerProcess) -> None:
    patient = RetryPolicy(max_attempts=200, backoff_s=0.5, max_backoff_s=3, give_up_after_s=420)
    # on_cold="retry": a final that still meets a span the crash took re-warms it and is sent
    # again, so every answer below must end warm. (Once, in a full-suite run, one final found a
    # span cold with the default "report"; it did not recur alone or under CPU load.)
    with SyncOrchestrator.connect(dev_server.base_url,
                                  options={"retry": patient, "max_in_flight": 2,
                                           "on_cold": "retry"}) as orc:
        batch = [(f"q{i}?", [doc(f"Kill{i}"), doc("KillShared")]) for i in range(16)]
        with orc.record_events() as log:
            pending = orc.submit(orc.aio.answer_many(batch, max_tokens=96))
            deadline = time.monotonic() + 120
            while sum(e.kind == "final_done" for e in log) < 2:
                assert time.monotonic() < deadline and not pending.done(), "batch too fast"
                time.sleep(0.05)
            os.killpg(dev_server.proc.pid, signal.SIGKILL)  # a crash, not a clean shutdown
            dev_server.proc.wait()
            assert not pending.done()
            start_dev(dev_server)  # same port, empty cache
            results = pending.result(timeout=480)
        kinds = [e.kind for e in log]
    assert len(results) == len(batch)
    assert all(isinstance(r, (Answer, MinipicError)) for r in results)
    assert all(isinstance(r, Answer) for r in results), [r for r in results
                                                         if not isinstance(r, Answer)]
    assert "registry_reset" in kinds and "retry" in kinds
    cold = [(r.question, r.cached_tokens, r.expected_cached_tokens, r.attempts,
             [(s.span_id[:8], s.status, s.hit) for s in r.spans])
            for r in results if not r.cache_ok]
    assert not cold, (cold, [(e.kind, e.job, e.detail[:60]) for e in log][-80:])
