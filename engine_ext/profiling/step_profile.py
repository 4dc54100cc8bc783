"""Wall-clock profile of engine steps across vLLM's processes, behind ``MINIPIC_PROFILE_DIR``.

Why this exists: a cached final prompt's TTFT is one engine step spread over three processes
(the front-end that sends the request, the EngineCore that schedules it, the worker that runs
the model), so no single-process profiler shows where its milliseconds go. This module wraps a
fixed list of functions (:data:`TARGETS`: scheduling and the hole lookup in the EngineCore;
input preparation, step planning, attention, rotation into the key shadow and sampling in the
worker; input/output processing in the front-end) with ``time.perf_counter`` timers and appends
each call, with the names of the timed calls enclosing it, to ``<dir>/prof-<pid>.jsonl``
(buffered; a background thread writes it out every ``FLUSH_INTERVAL_S``).
``perf_counter`` is ``CLOCK_MONOTONIC`` on Linux, one clock for every process of the machine,
so events of different processes can be laid on one timeline
(``minipic/bench/ttft_bound.py`` does that per request).

Off unless ``MINIPIC_PROFILE_DIR`` is set (``engine_ext.plugin.register`` calls
:func:`install_from_env` in every vLLM process, stock engines included, so a stock engine can
be profiled the same way): with the variable unset nothing is wrapped and vLLM is unchanged.
Only for measurements: the timers cost a few us per call (a few hundred calls per step), and
wrapping the model's attention layers is only meaningful in eager mode (``enforce_eager``).

Targets that do not exist in this build (a renamed method, a module of a feature that is off)
are skipped and named in the file's header line; the profile never stops an engine.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minipic.engine_ext.vllm_surface.added_names import PROFILE_MARK_ATTR
from minipic.span_contract.env import PROFILE_DIR_ENV

PROFILE_ENV = PROFILE_DIR_ENV

_GW = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
_RB = "minipic.engine_ext.attention.cpu_backend"

# (label, "module:attribute" or "module:Class.method"). Labels name what the time is spent on;
# the same label may time two targets that never run in one engine (stock vs minipic forward).
TARGETS: tuple[tuple[str, str], ...] = (
    # front-end (AsyncLLM, the caller's process)
    ("frontend.process_inputs", "vllm.v1.engine.input_processor:InputProcessor.process_inputs"),
    ("frontend.send", "vllm.v1.engine.core_client:AsyncMPClient._send_input_message"),
    ("frontend.process_outputs",
     "vllm.v1.engine.output_processor:OutputProcessor.process_outputs"),
    # EngineCore: input thread, main loop, output thread
    ("core.preprocess_add_request", "vllm.v1.engine.core:EngineCore.preprocess_add_request"),
    ("core.add_request", "vllm.v1.engine.core:EngineCore.add_request"),
    ("core.step", "vllm.v1.engine.core:EngineCore.step"),
    ("sched.schedule", "vllm.v1.core.sched.scheduler:Scheduler.schedule"),
    ("sched.lookup", "vllm.v1.core.kv_cache_manager:KVCacheManager.get_computed_blocks"),
    ("sched.allocate", "vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots"),
    ("holes.find_cached_runs", "minipic.engine_ext.holes.scheduler_lookup:find_cached_runs"),
    ("holes.attach_reached_runs", "minipic.engine_ext.holes.scheduler_lookup:attach_reached_runs"),
    ("core.execute_model", "vllm.v1.executor.multiproc_executor:MultiprocExecutor.execute_model"),
    ("core.sample_tokens", "vllm.v1.executor.multiproc_executor:MultiprocExecutor.sample_tokens"),
    ("sched.update_from_output", "vllm.v1.core.sched.scheduler:Scheduler.update_from_output"),
    ("core.send_output", "vllm.v1.engine.core:EngineCoreProc._send_msg_tracking_payload"),
    # worker
    ("worker.execute_model", "vllm.v1.worker.gpu_worker:Worker.execute_model"),
    ("worker.sample_tokens", "vllm.v1.worker.gpu_worker:Worker.sample_tokens"),
    ("runner.prepare_inputs", f"{_GW}._prepare_inputs"),
    ("runner.attn_metadata", f"{_GW}._build_attention_metadata"),
    ("plan.step_plan", f"{_RB}:plan_step"),
    ("plan.span_view", f"{_RB}:step_span_view"),
    ("runner.model_forward", f"{_GW}._model_forward"),
    ("runner.sample", f"{_GW}._sample"),
    ("attn.layer", f"{_RB}:MinipicCPUAttentionImpl.forward"),
    ("attn.layer", "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.forward"),
    ("attn.write", f"{_RB}:MinipicCPUAttentionImpl._write"),
    ("attn.off_home", f"{_RB}:MinipicCPUAttentionImpl._attend_off_home"),
    ("attn.masked", f"{_RB}:MinipicCPUAttentionImpl._attend_masked"),
    ("attn.shadow_pages", f"{_RB}:MinipicCPUAttentionImpl._key_shadow"),
    ("attn.shadow_pages", "minipic.engine_ext.attention.key_shadow.pages:KeyShadow.release"),
    ("attn.rotate", f"{_RB}:_rotate"),
    ("attn.rotate", f"{_RB}:rotate_by_offset"),  # a layout that moves home keys by an offset
    ("attn.move_keys", f"{_RB}:move_keys"),
    ("attn.gather_keys", "minipic.engine_ext.attention.cpu_kv_layout:PageLayout.token_keys"),
    ("attn.rotate", "vllm._custom_ops:rotary_embedding"),  # queries too (model forward)
    ("attn.kernel", "vllm._custom_ops:cpu_attention_with_kv_cache"),
    ("attn.reshape_and_cache", "vllm._custom_ops:cpu_attn_reshape_and_cache"),
)

# modules that exist only with the plugin on; importing them in a stock engine would be harmless
# but is not needed, so their targets are skipped there
_PLUGIN_MODULES = ("engine_ext.",)

_STATE: dict[str, Any] = {"installed": False, "writer": None}


FLUSH_INTERVAL_S = 0.5  # how often a background thread writes the buffered events out


class _Writer:
    """This process's event buffer and file (opened at the first event).

    Events are written by a daemon thread every ``FLUSH_INTERVAL_S``, not when a timed call
    returns: a flush at the end of a step would sit on the request's critical path (the
    worker's reply waits for it) and inflate the very TTFT being measured.
    """

    def __init__(self, folder: Path, header: dict[str, Any]) -> None:
        self.folder = folder
        self.header = header
        self.pid = os.getpid()
        self.events: list[tuple[str, float, float, int]] = []
        self.lock = threading.Lock()
        self.local = threading.local()
        self.file: Any = None
        self.thread: threading.Thread | None = None

    def for_this_process(self) -> _Writer:
        """A fresh writer after a fork (the parent's buffer, file and thread are not ours)."""
        if self.pid == os.getpid():
            return self
        header = {**self.header, "pid": os.getpid(), "ppid": os.getppid(),
                  "process": multiprocessing.current_process().name}
        return _Writer(self.folder, header)

    def stack(self) -> list[str]:
        stack = getattr(self.local, "stack", None)
        if stack is None:
            stack = self.local.stack = []
        return stack

    def record(self, path: str, t0: float, t1: float) -> None:
        # serialised by the flusher: a timer costs two clock reads and this append
        self.events.append((path, t0, t1, threading.get_ident()))
        if self.thread is None:
            self.thread = threading.Thread(target=self._flush_forever, daemon=True,
                                           name="minipic-step-profile")
            self.thread.start()

    def _flush_forever(self) -> None:
        while True:
            time.sleep(FLUSH_INTERVAL_S)
            self.flush()

    def flush(self) -> None:
        with self.lock:
            if not self.events:
                return
            lines, self.events = self.events, []
            if self.file is None:
                self.folder.mkdir(parents=True, exist_ok=True)
                self.file = open(self.folder / f"prof-{self.pid}.jsonl", "a",  # noqa: SIM115
                                 encoding="utf-8")
                self.file.write(json.dumps({"header": self.header}) + "\n")
            self.file.write("".join(json.dumps(row) + "\n" for row in lines))
            self.file.flush()


def _writer() -> _Writer:
    writer: _Writer = _STATE["writer"]
    if writer.pid != os.getpid():  # forked after install: start this process's own
        writer = _STATE["writer"] = writer.for_this_process()
    return writer


def _resolve(target: str) -> tuple[Any, str]:
    module_name, _, path = target.partition(":")
    owner: Any = importlib.import_module(module_name)
    *parents, attr = path.split(".")
    for name in parents:
        owner = getattr(owner, name)
    if attr not in vars(owner) and not hasattr(owner, attr):
        raise AttributeError(f"{path} does not exist")
    return owner, attr


def _timed(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        writer = _writer()
        stack = writer.stack()
        stack.append(label)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            t1 = time.perf_counter()
            writer.record("/".join(stack), t0, t1)
            stack.pop()

    setattr(timed, PROFILE_MARK_ATTR, True)
    return timed


def install(folder: Path, targets: Iterable[tuple[str, str]] = TARGETS,
            plugin_on: bool = False) -> list[str]:
    """Wrap ``targets`` in this process; returns the targets that were skipped.

    Idempotent (vLLM may load the plugin more than once per process). Wraps whatever is there
    now, so the plugin's own wrappers (hole lookup, span isolation) are timed with the stock
    code they wrap; ``functools.wraps`` keeps their patch marks
    (``engine_ext/vllm_surface/patches.py``).
    """
    if _STATE["installed"]:
        return []
    header = {"pid": os.getpid(), "ppid": os.getppid(),
              "process": multiprocessing.current_process().name,
              "argv0": os.path.basename(sys.argv[0]) if sys.argv else "",
              "plugin": plugin_on, "skipped": []}
    _STATE["writer"] = _Writer(folder, header)
    skipped: list[str] = []
    for label, target in targets:
        if not plugin_on and target.startswith(_PLUGIN_MODULES):
            continue
        try:
            owner, attr = _resolve(target)
        except Exception:  # noqa: BLE001  (a renamed method must not stop the engine)
            skipped.append(target)
            continue
        raw = inspect.getattr_static(owner, attr)
        # a static/class method keeps its kind (wrapping the bare function would bind self)
        kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
        current = raw.__func__ if kind is not None else getattr(owner, attr)
        if getattr(current, PROFILE_MARK_ATTR, False):
            continue
        timed = _timed(label, current)
        setattr(owner, attr, kind(timed) if kind is not None else timed)
    header["skipped"] = skipped
    _STATE["installed"] = True
    return skipped


def install_from_env(plugin_on: bool) -> bool:
    """Install when ``MINIPIC_PROFILE_DIR`` is set (called by the plugin in every process)."""
    folder = os.environ.get(PROFILE_ENV, "").strip()
    if not folder:
        return False
    install(Path(folder), plugin_on=plugin_on)
    return True


def flush() -> None:
    """Write out this process's pending events now (other processes write theirs within
    ``FLUSH_INTERVAL_S``: wait that long after the last request before reading their files)."""
    if _STATE["writer"] is not None:
        _writer().flush()


# -- reading -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    """One timed call: ``path`` is its label under the labels of the timed calls enclosing it
    (``"core.step/sched.schedule"``), in one thread of process ``pid``."""

    pid: int
    path: str
    t0: float
    t1: float
    tid: int = 0

    @property
    def label(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def seconds(self) -> float:
        return self.t1 - self.t0


def read_events(folder: Path) -> tuple[dict[int, dict[str, Any]], list[Event]]:
    """Every process's header and events under ``folder`` (events sorted by start)."""
    headers: dict[int, dict[str, Any]] = {}
    events: list[Event] = []
    for path in sorted(Path(folder).glob("prof-*.jsonl")):
        pid = int(path.stem.split("-", 1)[1])
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            if isinstance(row, dict):
                headers[pid] = row["header"]
            else:
                label, t0, t1, tid = row
                events.append(Event(pid, label, t0, t1, tid))
    events.sort(key=lambda e: e.t0)
    return headers, events


def in_window(events: Iterable[Event], t0: float, t1: float,
              pids: set[int] | None = None) -> list[Event]:
    """Events that ran (at least partly) inside ``[t0, t1]``, clipped to it."""
    out = []
    for e in events:
        if (pids is not None and e.pid not in pids) or e.t1 <= t0 or e.t0 >= t1:
            continue
        out.append(Event(e.pid, e.path, max(e.t0, t0), min(e.t1, t1), e.tid))
    return out


def inclusive_by_path(events: Iterable[Event]) -> dict[str, float]:
    """Seconds per call path, children included (a path's calls summed)."""
    out: dict[str, float] = {}
    for e in events:
        out[e.path] = out.get(e.path, 0.0) + e.seconds
    return out


def exclusive_by_path(events: Iterable[Event]) -> dict[str, float]:
    """Seconds per call path spent in the call itself, outside any timed call inside it.

    A path's exclusive time is its inclusive time minus that of its direct children (paths one
    label longer); the sum over all paths under a root equals the root's inclusive time.
    """
    inclusive = inclusive_by_path(events)
    out = dict(inclusive)
    for path, seconds in inclusive.items():
        parent, sep, _ = path.rpartition("/")
        if sep and parent in out:
            out[parent] -= seconds
    return out


def by_label(paths: dict[str, float], label: str) -> float:
    """Seconds of every path ending in ``label`` (exclusive or inclusive, as given)."""
    return sum(s for p, s in paths.items() if p.rsplit("/", 1)[-1] == label)
