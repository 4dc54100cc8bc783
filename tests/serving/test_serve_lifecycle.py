"""`minipic serve` as an operator runs it: killed, stopped, and asked to empty its cache; and a
script holding an embedded engine, killed.

Real processes throughout: ``minipic serve`` with the tiny model (vLLM's API server and its
EngineCore, which runs the worker: ``EngineSettings.executor_args``), signalled the way a crash,
``kill`` or Ctrl-C would. The process tree is read with psutil before the signal, and every
process of it must be gone a few seconds after.
The fast test drives the supervisor with a stand-in server (a Python process and a child in its
process group) so the guard logic is checked without an engine.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import psutil
import pytest
from support.servers import ServerProcess

from minipic.orchestrator import SyncOrchestrator

TINY = ("--model", "tiny-llama", "--max-model-len", "2048")
API_KEY = "lifecycle-test-key"
LORA = "tiny-lora"


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def alive(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid}:{p.name()}")
        except psutil.NoSuchProcess:
            pass
    return out


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := alive(procs)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def names(procs: list[psutil.Process]) -> list[str]:
    return [p.name() for p in procs]


def kill_all(procs: list[psutil.Process]) -> None:
    """Test clean-up only: whatever survived a failed assertion must not outlive the test."""
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def log_tail(path: str, lines: int = 60) -> str:
    """A failed start-up's story for the assertion message (CI keeps no server logs)."""
    with open(path, errors="replace") as f:
        kept = [line for line in f if "dispatcher.py" not in line]  # vLLM's kernel noise
    return f"{path}, last {lines} lines:\n" + "".join(kept[-lines:])


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture
def leftovers() -> Iterator[list[psutil.Process]]:
    procs: list[psutil.Process] = []
    yield procs
    kill_all(procs)


# -- the supervisor alone ---------------------------------------------------------------------

STAND_IN = textwrap.dedent("""
    import subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("ready", flush=True)
    time.sleep(600)
""")


@pytest.mark.fast
def test_supervisor_killed_takes_its_server_group_along(leftovers) -> None:
    runner = ("import os, sys; from serving.supervise import supervise; "
              f"sys.exit(supervise([sys.executable, '-c', {STAND_IN!r}], os.environ))")
    sup = subprocess.Popen([sys.executable, "-c", runner], stdout=subprocess.PIPE,
                           start_new_session=True)
    assert sup.stdout is not None and sup.stdout.readline().strip() == b"ready"
    time.sleep(0.3)  # the stand-in's child exists once it printed; give psutil a moment
    procs = tree(sup.pid)
    leftovers.extend(procs)
    assert len(procs) == 4, names(procs)  # supervisor, guard, stand-in server, its child
    os.kill(sup.pid, signal.SIGKILL)
    sup.wait()
    assert wait_gone(procs, 10) == []


# a server that sits on the first stop signal (a vLLM API server whose engine died under it in
# start-up) and exits cleanly on the second
DEAF_ONCE = textwrap.dedent("""
    import signal, sys, time
    seen = []
    def on_stop(signum, frame):
        seen.append(signum)
        if len(seen) == 2:
            sys.exit(0)
    signal.signal(signal.SIGINT, on_stop)
    print("ready", flush=True)
    while True:
        time.sleep(0.05)
""")


@pytest.mark.fast
def test_a_server_deaf_to_the_first_ctrl_c_gets_a_second(leftovers) -> None:
    grace = 4.0
    runner = ("import os, sys; from serving.supervise import Supervisor; "
              f"sys.exit(Supervisor([sys.executable, '-c', {DEAF_ONCE!r}], os.environ, "
              f"grace_s={grace}).run())")
    sup = subprocess.Popen([sys.executable, "-c", runner], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, start_new_session=True)
    assert sup.stdout is not None and sup.stdout.readline().strip() == b"ready"
    leftovers.extend(tree(sup.pid))
    sup.send_signal(signal.SIGINT)
    _, err = sup.communicate(timeout=30)
    # 0: the server exited by itself (killed at the grace's end it would be 137)
    assert sup.returncode == 0, err.decode()
    assert b"sending it once more" in err and b"killing it" not in err, err.decode()


# -- real servers -------------------------------------------------------------------------------


def wait_for_engine(pid: int, timeout: float = 300) -> list[psutil.Process]:
    """The tree once the EngineCore exists (it then imports vLLM and loads the model)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        procs = tree(pid)
        if "VLLM::EngineCore" in {n.split("_")[0] for n in names(procs)}:
            return procs
        time.sleep(0.2)
    raise AssertionError(f"no EngineCore under {pid}: {names(tree(pid))}")


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[dict[str, Future]]:
    """The two servers the tests below take apart, booting together from the module's first
    test on (each start is mostly vLLM's import, on one core: the two overlap). The first also
    serves a LoRA adapter of the tiny model, ``LORA``."""
    from support.lora_adapter import write_zero_lora

    from minipic.span_contract.models import resolve_model

    adapter = write_zero_lora(tmp_path_factory.mktemp("lora"), resolve_model("tiny-llama"))
    boot = ThreadPoolExecutor(2, thread_name_prefix="boot")
    pending = {"plain": ServerProcess(*TINY, "--", "--api-key", API_KEY, "--enable-lora",
                                      "--max-lora-rank", "8", "--lora-modules",
                                      f"{LORA}={adapter}"),
               "reset": ServerProcess(*TINY, "--enable-cache-reset")}
    futures = {name: boot.submit(server.start) for name, server in pending.items()}
    yield futures
    boot.shutdown(wait=True)
    for server in pending.values():
        server.stop()


@pytest.mark.server
def test_sigkill_of_serve_leaves_no_engine_behind(leftovers, servers) -> None:
    server = servers["plain"].result()
    procs = tree(server.proc.pid)
    leftovers.extend(procs)
    assert "VLLM::EngineCore" in {n.split("_")[0] for n in names(procs)}, (
        names(procs))
    # the reset route is off unless the operator asks for it, and says how to turn it on
    resp = httpx.post(server.base_url + "/minipic/reset_prefix_cache", timeout=10)
    assert resp.status_code == 403 and "--enable-cache-reset" in resp.json()["error"]["message"]
    # with --api-key, minipic's routes (store fingerprint, paths, counters) ask for it, as /v1 does
    for path in ("/minipic/config", "/minipic/documents"):
        denied = httpx.get(server.base_url + path, timeout=10)
        assert denied.status_code == 401 and "fingerprint" not in denied.text, (path, denied.text)
    key = {"Authorization": f"Bearer {API_KEY}"}
    config = httpx.get(server.base_url + "/minipic/config", headers=key, timeout=10).json()
    assert config["cache_reset"] is False and config["enabled"] is True
    # documents for a LoRA adapter's name: refused before any span prefill, with the reason
    body = {"model": LORA, "max_tokens": 2, "documents": [{"text": "a document " * 40}],
            "messages": [{"role": "user", "content": "what does the document say?"}]}
    before = httpx.get(server.base_url + "/minipic/documents", headers=key, timeout=10).json()
    lora = httpx.post(server.base_url + "/v1/chat/completions", json=body, headers=key,
                      timeout=60)
    assert lora.status_code == 400, lora.text
    assert "LoRA adapter" in lora.json()["error"]["message"] and LORA in lora.text
    after = httpx.get(server.base_url + "/minipic/documents", headers=key, timeout=10).json()
    assert after == before, (before, after)  # nothing was laid out or prefilled
    plain = {"model": LORA, "prompt": [1, 2, 3], "max_tokens": 1}  # the adapter itself serves
    assert httpx.post(server.base_url + "/v1/completions", json=plain, headers=key,
                      timeout=120).status_code == 200
    os.kill(server.proc.pid, signal.SIGKILL)  # a crash: `minipic serve` gets no say
    server.proc.wait()
    assert wait_gone(procs, 20) == []
    assert port_free(server.port)


def cached(base_url: str, ids: list[int]) -> int:
    body = {"model": "minipic", "prompt": ids, "max_tokens": 1}
    resp = httpx.post(base_url + "/v1/completions", json=body, timeout=120)
    resp.raise_for_status()
    return (resp.json()["usage"]["prompt_tokens_details"] or {}).get("cached_tokens") or 0


@pytest.mark.server
def test_cache_reset_route_and_sigterm(leftovers, servers) -> None:
    server = servers["reset"].result()
    procs = tree(server.proc.pid)
    leftovers.extend(procs)
    base = server.base_url
    assert httpx.get(base + "/minipic/config", timeout=10).json()["cache_reset"] is True
    with SyncOrchestrator.connect(base) as orc:
        tok = orc.aio.builder.tokenizer
        ids = tok.encode(f"reset probe {uuid.uuid4().hex} " + "alpha beta gamma " * 30)
        cached(base, ids)
        assert cached(base, ids) >= 64, "the second send is served from the cache"
        docs = [f"Reset doc {uuid.uuid4().hex}: " + "delta " * 50]
        orc.answer("q?", docs, max_tokens=2)
        assert len(orc.registry) > 0
        orc.reset_cache()  # over HTTP: POST /minipic/reset_prefix_cache
        assert len(orc.registry) == 0
        assert cached(base, ids) == 0, "the server's cache is empty after the reset"
        again = orc.answer("q?", docs, max_tokens=2)
        assert again.prefills_sent == 2 and again.cache_ok  # system + the document, re-warmed
    os.kill(server.proc.pid, signal.SIGTERM)
    assert server.proc.wait(60) == 0, "SIGTERM is a clean shutdown"
    assert wait_gone(procs, 10) == []


@pytest.mark.server
def test_sigint_while_the_engine_loads(leftovers) -> None:
    """Ctrl-C during start-up (the minute an operator is most likely to give up)."""
    server = ServerProcess(*TINY)
    log = open(server.log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "minipic.cli", "serve", "--port", str(server.port), "--eager",
         *TINY],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    procs = wait_for_engine(proc.pid)
    leftovers.extend(procs)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0, log_tail(server.log_path)
    assert wait_gone(procs, 10) == [], log_tail(server.log_path)


EMBEDDED_SCRIPT = textwrap.dedent("""
    if __name__ == "__main__":
        import time
        from minipic.orchestrator import SyncOrchestrator
        orc = SyncOrchestrator.embedded("tiny-llama", max_model_len=1024)
        print("ready", flush=True)
        time.sleep(600)
""")


@pytest.mark.engine
def test_a_killed_script_leaves_no_engine_behind(leftovers, tmp_path) -> None:
    """SIGTERM's default action ends a script without its engine's finalizer: the EngineCore,
    left to itself, kept running (engine_ext/vllm_surface/parent_watch.py)."""
    from minipic.engine_ext.vllm_surface.parent_watch import EXIT_GRACE_S

    script = tmp_path / "embedded.py"
    script.write_text(EMBEDDED_SCRIPT)
    log = tmp_path / "embedded.log"
    with open(log, "wb") as out:  # a file, not a pipe nobody drains: the engine logs too
        proc = subprocess.Popen([sys.executable, str(script)], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while b"ready\n" not in log.read_bytes() and proc.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert b"ready\n" in log.read_bytes(), log_tail(str(log))
    procs = tree(proc.pid)
    leftovers.extend(procs)
    assert "VLLM::EngineCore" in {n.split("_")[0] for n in names(procs)}, names(procs)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == -signal.SIGTERM  # the script itself died at once, no clean-up
    assert wait_gone(procs, EXIT_GRACE_S + 25) == [], log_tail(str(log))
