"""Run the server so that it, and every process it starts, dies with ``minipic serve``.

Why: vLLM's API server starts ``EngineCore`` and EngineCore starts its workers. vLLM stops the
workers when EngineCore dies, but nothing stops EngineCore when the API server is killed
(SIGKILL, OOM killer): the engine kept running, holding its memory and the next start's port.
Those processes are vLLM's to spawn, so minipic cannot give them a parent-death signal; they do
stay in their parent's process group, though. So:

* the server runs in a process group (session) of its own;
* a small guard process, in a session of its own too, blocks on a pipe whose only write end
  belongs to ``minipic serve``. The kernel closes that end when ``minipic serve`` exits for any
  reason, SIGKILL included; the guard then stops the server's group (SIGTERM, then SIGKILL after
  a grace period) and exits;
* SIGTERM, SIGINT and SIGHUP to ``minipic serve`` are passed to the server's whole group, as a
  terminal passes Ctrl-C to every process of a plain ``vllm serve``: each vLLM process runs its
  own shutdown (the API server alone ignores SIGTERM until its engine has started, which can take
  minutes). A server still up halfway through ``SHUTDOWN_GRACE_S`` gets the signal once more, its
  leader alone, as an operator presses Ctrl-C twice: a vLLM API server whose engine died under it
  during start-up can sit on the first one, and the second makes Python and uvicorn stop waiting
  (an orderly exit, so the engine is still shut down by its own hand). A second signal to
  ``minipic serve``, or a shutdown slower than ``SHUTDOWN_GRACE_S``, kills the group.
  Whatever is left of the group after the server exits is stopped too.

The guard is this module run as ``python -m minipic.serving.supervise FD``; it imports nothing
heavy.
``GuardedProcess`` gives a Ray Serve replica the same guarantee for its server.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import Any

SHUTDOWN_GRACE_S = 30.0  # SIGTERM -> SIGKILL for an orderly stop of the server
GUARD_GRACE_S = 5.0  # the same once `minipic serve` itself is gone: be quick
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group; [] when none is left."""
    if not os.path.isdir("/proc"):  # no procfs: a zombie counts as alive, the grace bounds it
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
            members.append(int(entry))
    return members


def stop_group(pgid: int, grace_s: float) -> bool:
    """SIGTERM a process group, SIGKILL what is left after ``grace_s``. Returns whether it had
    to kill."""
    if not _group_members(pgid):
        return False
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not _group_members(pgid):
            return False
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def _say(message: str) -> None:
    try:
        print(f"minipic serve: {message}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass  # whoever read our stderr may be gone too


def guard(fd: int, grace_s: float = GUARD_GRACE_S) -> int:
    """Wait for EOF on ``fd`` (``minipic serve`` exited), then stop the process groups whose
    ids were written to it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the supervisor to handle
    data = b""
    with os.fdopen(fd, "rb", buffering=0) as pipe:
        while chunk := pipe.read(4096):
            data += chunk
    for pgid in {int(token) for token in data.split() if token.isdigit()}:
        if _group_members(pgid):
            _say(f"the supervisor is gone; stopping server process group {pgid}")
            stop_group(pgid, grace_s)
    return 0


def start_guard(detach: bool = False) -> tuple[subprocess.Popen[bytes], int]:
    """Start the guard process; returns it and the write end of its pipe (write a process
    group id there to have the guard stop that group once this process is gone).

    ``detach``: the guard forks away from its parent (the returned process is the short-lived
    intermediate). Ray kills a dead worker's child processes, the guard included, but not their
    children, so a guard left as a child of a Ray replica would die before doing its job."""
    read_fd, write_fd = os.pipe()  # both ends non-inheritable (PEP 446)
    argv = [sys.executable, "-m", "minipic.serving.supervise", str(read_fd)]
    guard_proc = subprocess.Popen(argv + (["--detach"] if detach else []),
                                  pass_fds=(read_fd,), stdin=subprocess.DEVNULL,
                                  start_new_session=True)
    os.close(read_fd)
    if detach:
        guard_proc.wait()
    return guard_proc, write_fd


class GuardedProcess:
    """A server started in a process group of its own that dies with the process that started
    it, however that one ends (a Ray replica actor killed with SIGKILL included); for callers
    that cannot block in ``Supervisor.run``."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], **popen: Any) -> None:
        self._guard, self._write_fd = start_guard(detach=True)
        self.process = subprocess.Popen(list(argv), env=dict(env), start_new_session=True,
                                        **popen)
        os.write(self._write_fd, f"{self.process.pid}\n".encode())

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        """SIGTERM the group, SIGKILL it after ``grace_s``; release the guard."""
        if self._write_fd < 0:
            return
        stop_group(self.process.pid, grace_s)
        self.process.poll()
        os.close(self._write_fd)
        self._write_fd = -1
        try:
            self._guard.wait(timeout=GUARD_GRACE_S + 5)
        except subprocess.TimeoutExpired:
            self._guard.kill()


class Supervisor:
    """``minipic serve``'s own process: starts the guard and the server, forwards stop
    signals, and returns the server's exit status (0 after a requested stop)."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str],
                 grace_s: float = SHUTDOWN_GRACE_S, signal_group: bool = True) -> None:
        self.argv = list(argv)
        # False: a stop signal goes to the leader only, which stops its own children in order
        # (a Ray driver); whatever is left of the group afterwards is still stopped
        self.signal_group = signal_group
        self.env = dict(env)
        self.grace_s = grace_s
        self.server: subprocess.Popen[bytes] | None = None
        self.stop_requested_at: float | None = None
        self.forwarded: signal.Signals | None = None  # the stop signal the server was sent
        self.repeated = False  # ... and sent again, halfway through the grace
        self.killed = False  # the group had to be SIGKILLed

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        server = self.server
        if server is None or server.poll() is not None:
            return
        if self.stop_requested_at is None:
            self.stop_requested_at = time.monotonic()
            _say(f"{signal.Signals(signum).name}: shutting the server down")
            forward = signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM
            self.forwarded = forward
            try:
                if self.signal_group:
                    os.killpg(server.pid, forward)
                else:
                    server.send_signal(forward)
            except ProcessLookupError:
                pass
        else:
            _say(f"{signal.Signals(signum).name} again: killing the server")
            self.killed = True
            _kill_group(server.pid)

    def run(self) -> int:
        guard_proc, write_fd = start_guard()
        previous: dict[int, Any] = {}
        try:
            self.server = subprocess.Popen(self.argv, env=self.env, start_new_session=True)
            os.write(write_fd, f"{self.server.pid}\n".encode())
            # from here on a stop signal is forwarded; before, its default action ends this
            # process and the guard stops the group
            previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
            status = self._wait(self.server)
            # an engine its server left behind
            self.killed |= stop_group(self.server.pid, GUARD_GRACE_S)
        finally:
            os.close(write_fd)  # releases the guard (it sweeps the group once more)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        try:
            guard_proc.wait(timeout=GUARD_GRACE_S + 5)
        except subprocess.TimeoutExpired:
            guard_proc.kill()
        if self.stop_requested_at is not None and not self.killed:
            return 0  # a requested stop that every process carried out itself
        return status if status >= 0 else 128 - status

    def _wait(self, server: subprocess.Popen[bytes]) -> int:
        while True:
            try:
                return server.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
            since = self.stop_requested_at
            if since is None:
                continue
            waited = time.monotonic() - since
            if not self.repeated and self.forwarded is not None and waited > self.grace_s / 2:
                self.repeated = True
                _say(f"the server is still up {waited:.0f} s after {self.forwarded.name}; "
                     "sending it once more")
                try:
                    server.send_signal(self.forwarded)
                except ProcessLookupError:
                    pass
            if waited > self.grace_s:
                _say(f"the server did not stop within {self.grace_s:.0f} s; killing it")
                self.killed = True
                _kill_group(server.pid)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def supervise(argv: Sequence[str], env: Mapping[str, str], signal_group: bool = True) -> int:
    """Run ``argv`` as a supervised server (see the module docstring); its exit status."""
    return Supervisor(argv, env, signal_group=signal_group).run()


if __name__ == "__main__":
    if "--detach" in sys.argv[2:] and os.fork() > 0:
        os._exit(0)  # the intermediate: the guard goes on as an orphan, outside Ray's reach
    sys.exit(guard(int(sys.argv[1])))
