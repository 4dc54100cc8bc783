"""An EngineCore that minipic started stops once the process that started it is gone.

Why: vLLM's EngineCore is not a daemon process, and nothing in it watches its parent. Its parent
shuts it down from a finalizer, which a process killed by SIGTERM's or SIGKILL's default action
never runs: ``minipic eval``, a script holding ``Orchestrator.embedded`` or a test runner killed
mid-run left ``VLLM::EngineCore`` behind, holding the KV cache (GiBs) and a core, until someone
found it. (``minipic serve`` has its own guard for its process group, ``serving/supervise.py``;
this covers every engine minipic starts, in any parent.)

How: a daemon thread of the EngineCore waits on its parent's multiprocessing sentinel (a pipe the
kernel closes when the parent exits, however it exits; readable at once if it already has). Then
it gives the engine ``EXIT_GRACE_S`` to stop by itself (a parent that exits normally has just
told it to), sends it SIGTERM, which vLLM's EngineCore turns into its own orderly shutdown
(its workers watch it in turn), and SIGKILL if that has not ended it ``KILL_AFTER_S`` later.

Not ``PR_SET_PDEATHSIG``: that fires when the parent *thread* that started the engine ends, and an
engine may be built by a thread that ends long before the engine should.

Only EngineCores started by minipic's launchers are watched (their environment carries
``MINIPIC_ENABLE``, on or off): installing minipic leaves a plain ``vllm serve`` as it is.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time

from minipic.span_contract.env import ENABLE_ENV

logger = logging.getLogger("minipic.parent_watch")

EXIT_GRACE_S = 5.0  # the parent gone: time for the engine's own shutdown before SIGTERM
KILL_AFTER_S = 30.0  # SIGTERM sent: time for vLLM's orderly shutdown before SIGKILL

_started: list[threading.Thread] = []


def is_engine_core(name: str) -> bool:
    """vLLM names its EngineCore processes ``EngineCore`` or ``EngineCore_DP<rank>``."""
    return name == "EngineCore" or name.startswith("EngineCore_DP")


def install() -> bool:
    """Start the watch in this process if it is an EngineCore minipic started (once per
    process). Returns whether a watch runs."""
    if _started:
        return True
    if ENABLE_ENV not in os.environ or not is_engine_core(multiprocessing.current_process().name):
        return False
    parent = multiprocessing.parent_process()
    if parent is None:  # not started by multiprocessing: whoever started it owns its end
        return False
    thread = threading.Thread(target=_stop_after, args=(parent,), daemon=True,
                              name="minipic-parent-watch")
    thread.start()
    _started.append(thread)
    return True


def _stop_after(parent: multiprocessing.process.BaseProcess) -> None:
    parent.join()  # returns once the parent's sentinel closes: the parent has exited
    time.sleep(EXIT_GRACE_S)  # a daemon thread: if the engine exits meanwhile, nothing follows
    logger.warning("minipic: the process that started this EngineCore (pid %s) is gone; "
                   "shutting the engine down", parent.pid)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(KILL_AFTER_S)
    logger.warning("minipic: the orphaned EngineCore did not stop within %.0f s; killing it",
                   KILL_AFTER_S)
    os.kill(os.getpid(), signal.SIGKILL)
