"""Real ``minipic serve`` processes for the tests, and the run's scratch folder they log into.

Why a support module and not ``conftest``: test modules import these names, and a module
imported as ``conftest`` by pytest and again by a test under another name would hold two
scratch folders and two classes.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRATCH: list[Path] = []  # this run's scratch folder (pytest_configure)


def scratch_path(name: str) -> str:
    """A path in this run's scratch folder (``/tmp`` outside a pytest run)."""
    return str((SCRATCH[0] / name) if SCRATCH else Path(tempfile.gettempdir()) / Path(name).name)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _PortTaken(Exception):
    """The drawn port was bound by another process before the server could bind it."""


class ServerProcess:
    """A real `minipic serve` subprocess on a free loopback port."""

    def __init__(self, *args: str, log_path: str | None = None, eager: bool = True):
        self.eager = eager  # tests run eager: compiled start-up costs ~40 s per server
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.args = args
        self.log_path = log_path or scratch_path(f"logs/minipic-serve-{self.port}.log")
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 300.0) -> ServerProcess:
        """Start the server and wait for ``/health``. The port was free when it was drawn, but
        another process (an engine's own rendezvous port, a parallel worker's server) may bind
        it first: such a start is retried once on a fresh port. Any other early exit raises
        with the log's tail, so that CI's output tells why."""
        for attempt in range(2):
            try:
                return self._start_once(timeout)
            except _PortTaken as taken:
                if attempt:
                    raise RuntimeError(f"minipic serve: port taken twice; see {self.log_path}"
                                       ) from taken
                self.port = free_port()
                self.base_url = f"http://127.0.0.1:{self.port}"
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float) -> ServerProcess:
        import httpx

        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "minipic.cli", "serve", "--port", str(self.port),
             *(["--eager"] if self.eager else []), *self.args],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                if "Address already in use" in tail:
                    raise _PortTaken(self.port)
                raise RuntimeError(f"minipic serve exited early (code {self.proc.returncode}); "
                                   f"see {self.log_path}; its last lines:\n{tail}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"minipic serve not healthy after {timeout}s; see {self.log_path}; "
                           f"its last lines:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(log unreadable: {exc})"

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
