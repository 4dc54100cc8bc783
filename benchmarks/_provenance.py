"""Which code a benchmark measured, for its report: a helper the benchmark scripts share (not a
benchmark itself).

Run as ``python benchmarks/<name>.py``, a script has this folder first on ``sys.path``, so
``from _provenance import git_state`` needs nothing more.
"""

from __future__ import annotations

import subprocess


def git_state(*folders: str) -> tuple[str, bool] | None:
    """``(short commit of HEAD, whether any of folders has local changes)``, read with git in
    the current directory; None where that is no git checkout (or there is no git)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", *folders],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head, bool(dirty)
