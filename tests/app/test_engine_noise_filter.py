"""The known-noise filter drops exactly the listed warnings, on their own loggers, below ERROR.

Real ``logging`` records through real loggers and a real handler; the messages are the ones vLLM
0.32 (CPU) printed during ``minipic demo`` (its stderr, read when the list was made).
"""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from minipic.engine_logs import (
    KNOWN_NOISE,
    NOISE_FILTER_ENV,
    KnownNoiseFilter,
    install_noise_filter,
)

pytestmark = pytest.mark.fast


@pytest.fixture(autouse=True)
def _filters_put_back() -> Iterator[None]:
    """``install_noise_filter`` changes process-wide state (logger filters, warning filters);
    the tests here put it back, so a later module's logs reach its ``caplog``."""
    loggers = {name: logging.getLogger(name) for name in {e.logger for e in KNOWN_NOISE}}
    before = {name: list(logger.filters) for name, logger in loggers.items()}
    with warnings.catch_warnings():
        yield
    for name, logger in loggers.items():
        logger.filters[:] = before[name]
ROOT = Path(__file__).resolve().parents[2]

# (logger, message as vLLM formats it) copied from the demo's stderr
DEMO_NOISE = [
    ("vllm.v1.worker.cpu_worker", "libtcmalloc is not found in LD_PRELOAD. For best "
     "performance, please follow the section `set LD_PRELOAD` in https://docs.vllm.ai/..."),
    ("vllm.v1.worker.cpu_worker", "libiomp is not found in LD_PRELOAD. For best performance"),
    ("minipic.span_contract.cpu_runtime", "CPU runtime: tcmalloc: not found (Debian/Ubuntu package "
     "libtcmalloc-minimal4; ...); the engine runs without it"),
    ("vllm.triton_utils.importing",
     "Triton is installed, but doesn't include CPU backend. Disabling Triton."),
    ("vllm.platforms.cpu", "Triton is not installed. triton-cpu is expected on x86 CPUs."),
    ("vllm.config.vllm", "Model Runner V2 requires Triton; using the V1 model runner instead."),
    ("vllm.config.vllm", "Inductor compilation was disabled by user settings, optimizations "
     "settings that are only active during inductor compilation will be ignored."),
    ("vllm.config.vllm", "Enforce eager set, disabling torch.compile, CUDAGraphs, and JIT "
     "kernel warmup."),
    ("vllm.v1.engine.input_processor", "Passing raw prompts to InputProcessor is deprecated "
     "and will be removed in the future."),
    ("minipic.plugin", "minipic plugin active in pid 3168: features=hash,holes,rope "
     "block_size=32 ssep_id=5 pdep_id=11 pad_id=16"),
]


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    """A stream handler on the ``vllm`` and ``minipic`` loggers, filters removed afterwards."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    names = sorted({entry.logger for entry in KNOWN_NOISE} | {"vllm", "minipic"})
    saved = {name: (logging.getLogger(name).filters[:], logging.getLogger(name).level)
             for name in names}
    for root in ("vllm", "minipic"):
        logging.getLogger(root).addHandler(handler)
        logging.getLogger(root).setLevel(logging.INFO)
    yield stream
    for root in ("vllm", "minipic"):
        logging.getLogger(root).removeHandler(handler)
    for name, (filters, level) in saved.items():
        logging.getLogger(name).filters[:] = filters
        logging.getLogger(name).setLevel(level)


def test_every_demo_noise_line_is_dropped(captured: io.StringIO) -> None:
    install_noise_filter()
    for name, message in DEMO_NOISE:
        logging.getLogger(name).warning("%s", message)
    assert captured.getvalue() == ""


def test_every_entry_is_seen_in_real_terminal_lines() -> None:
    """``seen_in`` (what the engine tests check stderr with) finds each entry behind vLLM's
    prefix, so those checks cannot pass for want of a match."""
    output = "\n".join(f"(EngineCore pid=3326) WARNING 12-02 04:29:30 [x.py:1] {message}"
                       for _, message in DEMO_NOISE)
    assert [entry for entry in KNOWN_NOISE if not entry.seen_in(output)] == []
    assert not any(entry.seen_in("(Worker pid=1) WARNING [a.py:2] all is well")
                   for entry in KNOWN_NOISE)


def test_lazy_format_args_are_matched_after_formatting(captured: io.StringIO) -> None:
    install_noise_filter()
    # vLLM logs this one as "%s is not found in LD_PRELOAD. ..." with the library as argument
    logging.getLogger("vllm.v1.worker.cpu_worker").warning(
        "%s is not found in LD_PRELOAD. For best performance", "libtcmalloc")
    assert captured.getvalue() == ""


def test_other_warnings_and_all_errors_still_show(captured: io.StringIO) -> None:
    install_noise_filter()
    worker = logging.getLogger("vllm.v1.worker.cpu_worker")
    worker.warning("KV cache space is too small for max_model_len")  # not listed: shown
    worker.error("libtcmalloc is not found in LD_PRELOAD")  # listed text, but an ERROR: shown
    # listed text on another logger: that entry does not cover it
    logging.getLogger("vllm.engine.arg_utils").warning("Model Runner V2 requires Triton")
    logging.getLogger("vllm.v1.engine.core").info("[shutdown] EngineCore: start")  # INFO shown
    lines = captured.getvalue().splitlines()
    assert lines == ["KV cache space is too small for max_model_len",
                     "libtcmalloc is not found in LD_PRELOAD",
                     "Model Runner V2 requires Triton",
                     "[shutdown] EngineCore: start"]


def test_install_is_idempotent() -> None:
    install_noise_filter()
    install_noise_filter()
    for name in {entry.logger for entry in KNOWN_NOISE}:
        filters = logging.getLogger(name).filters
        assert sum(isinstance(f, KnownNoiseFilter) for f in filters) == 1, name


def test_known_python_warning_is_ignored_and_others_are_not() -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        install_noise_filter()  # its filters go in front of "always"
        module = {"__name__": "vllm.triton_utils.dispatcher"}
        warnings.warn_explicit("`torch.distributed.reduce_op` is deprecated, please use "
                               "`torch.distributed.ReduceOp` instead", FutureWarning,
                               "dispatcher.py", 138, module="vllm.triton_utils.dispatcher",
                               module_globals=module)
        warnings.warn_explicit("something else is deprecated", FutureWarning, "dispatcher.py",
                               139, module="vllm.triton_utils.dispatcher", module_globals=module)
    assert [str(w.message) for w in seen] == ["something else is deprecated"]


def _child(env: dict[str, str], code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env}, timeout=60)


# what an engine process does: import minipic (its re-imported __main__ does), then log
CHILD = ("import logging, minipic; "
         "logging.getLogger('vllm.triton_utils.importing').warning("
         "\"Triton is installed, but doesn't include CPU backend. Disabling Triton.\"); "
         "logging.getLogger('vllm.triton_utils.importing').warning('a genuine warning')")


@pytest.mark.parametrize(("flag", "noise_shown"), [("1", False), ("0", True), ("", True)])
def test_engine_process_installs_the_filter_from_the_environment(flag: str,
                                                                 noise_shown: bool) -> None:
    done = _child({NOISE_FILTER_ENV: flag}, CHILD)
    assert done.returncode == 0, done.stderr
    assert ("Triton is installed" in done.stderr) is noise_shown
    assert "a genuine warning" in done.stderr  # Python's last-resort handler, unfiltered


def test_quiet_default_sets_the_flag_verbose_and_log_file_clear_it(tmp_path: Path) -> None:
    code = ("import os, sys; from minipic.engine_logs import quiet_engine_logs; "
            "quiet_engine_logs(verbose=sys.argv[1] == 'v', "
            "log_file=sys.argv[2] if len(sys.argv) > 2 else None); "
            f"print(os.environ['{NOISE_FILTER_ENV}'])")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(NOISE_FILTER_ENV, None)

    def flag(*argv: str) -> str:
        done = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert flag("q") == "1"
    assert flag("v") == "0"
    assert flag("q", str(tmp_path / "engine.log")) == "0"
