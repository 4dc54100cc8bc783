"""A subprocess started now and read when a test needs it.

A module whose tests each run an engine in a process of its own (a demo, an example, a
sabotaged worker) starts them together in one module fixture: an engine's start is mostly
vLLM's import, on one core, so two or three overlap on the machine instead of queueing. Output
goes to files, not pipes: an engine's log outgrows a pipe while another process is read.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path


class Background:
    def __init__(self, folder: Path, name: str, argv: Sequence[str], env: Mapping[str, str],
                 cwd: Path, timeout: float = 600) -> None:
        self.out, self.err, self.timeout = folder / f"{name}.out", folder / f"{name}.err", timeout
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(list(argv), cwd=cwd, env=dict(env), stdout=out,
                                         stderr=err)

    def result(self) -> subprocess.CompletedProcess[str]:
        """Wait for the process (killed after ``timeout`` s) and return what it printed."""
        try:
            self.proc.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode,
                                           self.out.read_text(errors="replace"),
                                           self.err.read_text(errors="replace"))
