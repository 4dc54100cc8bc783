"""The examples and the demo print their own output on stdout, and nothing of vLLM's.

vLLM logs at INFO to stdout by default, from the script's process and from each engine process;
``examples/agent_tool_memory.py`` used to interleave dozens of those lines with its own. Each
test runs the real script in a subprocess on the tiny model and reads its stdout.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from support.background import Background

from minipic.engine_logs import KNOWN_NOISE

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
# vLLM's log format: "(EngineCore pid=123) INFO 12-01 11:20:59 [core.py:91] ..."
VLLM_LOG = re.compile(r"\((\w|-)+ pid=\d+\) (DEBUG|INFO|WARNING|ERROR) ")
# ... and its progress bars (tqdm, on stderr: fine there, not on stdout)
VLLM_LINE = re.compile(VLLM_LOG.pattern + "|Loading safetensors")


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("VLLM_LOGGING_LEVEL", None)
    env.pop("VLLM_LOGGING_STREAM", None)
    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both scripts, started together (``tests/support/background.py``)."""
    folder = tmp_path_factory.mktemp("quiet")
    log = folder / "engine.log"
    demo = ["-m", "minipic.cli", "demo", "--model", "tiny-llama", "--eager", "--questions", "1",
            "--max-tokens", "2", "--engine-log", str(log)]
    return {
        "agent": Background(folder, "agent", [sys.executable, "examples/agent_tool_memory.py",
                                              "--model", "tiny-llama"], _env(), ROOT),
        "demo": Background(folder, "demo", [sys.executable, *demo], _env(), ROOT),
        "engine_log": log,
    }


def engine_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if VLLM_LINE.search(line)]


def test_agent_example_stdout_is_its_own(runs: dict[str, Any]) -> None:
    done = runs["agent"].result()
    assert done.returncode == 0, done.stderr[-3000:]
    assert engine_lines(done.stdout) == []
    assert done.stdout.startswith("turn 1: ")
    assert re.search(r"^cached \d+ of \d+ prompt tokens", done.stdout, re.M)
    # vLLM's known CPU noise is filtered out of stderr (the filter lets every other warning
    # and every error through: tests/app/test_engine_noise_filter.py)
    assert [e for e in KNOWN_NOISE if e.seen_in(done.stderr)] == []


def test_demo_stdout_is_its_own(runs: dict[str, Any]) -> None:
    log = runs["engine_log"]
    done = runs["demo"].result()
    assert done.returncode == 0, done.stderr[-3000:]
    assert engine_lines(done.stdout) == []
    assert "summary" in done.stdout and "TTFT ratio" in done.stdout
    assert not VLLM_LOG.search(done.stderr), "--engine-log: no engine log on the terminal"
    assert "INFO" in log.read_text()  # ... they are in the file, INFO included
