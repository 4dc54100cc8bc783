"""Keep vLLM's log lines out of a program's own output.

Why: vLLM logs at INFO to *stdout* by default, from this process and from every EngineCore and
worker process it starts, so an example or the demo that prints its results on stdout had them
interleaved with dozens of engine lines. vLLM reads ``VLLM_LOGGING_*`` from the environment when
it is imported, and the engine processes inherit the environment, so this must run before vLLM
is imported and before an engine starts: call it first thing in ``main``.

Default: WARNING and above, on stderr. ``verbose=True``: INFO, on stderr. ``log_file``: every
engine line (INFO and above) goes to that file instead, nothing to the terminal. A variable the
user already set wins over the quiet default.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import sys
import tempfile

FORMAT = "(%(process)d) %(levelname)s %(asctime)s [%(name)s] %(message)s"


def _file_config(path: str) -> str:
    """A ``VLLM_LOGGING_CONFIG_PATH`` file that sends vLLM's loggers to ``path``."""
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": FORMAT, "datefmt": "%m-%d %H:%M:%S"}},
        "handlers": {"file": {"class": "logging.FileHandler", "filename": os.path.abspath(path),
                              "formatter": "plain", "level": "INFO"}},
        "loggers": {"vllm": {"handlers": ["file"], "level": "INFO", "propagate": False}},
    }
    fd, name = tempfile.mkstemp(prefix="minipic-vllm-logging-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(config, f)
    # engine processes read it when they start; by this process's exit they are gone
    atexit.register(_remove, name)
    return name


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def quiet_engine_logs(verbose: bool = False, log_file: str | None = None) -> None:
    """Route vLLM's logs away from stdout (see the module docstring)."""
    if log_file:
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = _file_config(log_file)
    elif verbose:
        os.environ["VLLM_LOGGING_LEVEL"] = "INFO"
    else:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if "vllm" in sys.modules:  # too late for this process's handlers; its level still counts
        logging.getLogger("vllm").setLevel(logging.INFO if verbose or log_file
                                           else logging.WARNING)
