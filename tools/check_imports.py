"""Every import of the repository resolves from a plain checkout: mypy's import resolution over
the package, tests, benchmarks, examples and tools, reporting only what it cannot find.

    .venv/bin/python tools/check_imports.py        # exit 0: none unresolved (make lint runs it)

Why mypy and not the editable install: setuptools' editable installs work through an import
hook that type checkers and editors do not follow, so a name that resolves only through it
resolves for Python and for nobody else. mypy searches the checkout itself (``minipic/`` and its
links to the layer folders) and the installed third-party packages. Type errors are not this
check's business (``--follow-imports=skip`` keeps it to seconds); untyped third-party packages
are not unresolved ones.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ("minipic", "tests", "benchmarks", "examples", "tools")


def unresolved(extra: tuple[Path, ...] = ()) -> list[str]:
    """mypy's ``import-not-found`` lines (empty: every import resolves); ``extra``: files outside
    the checkout to check with it (a test's probe, which must not land where other tests read
    the checkout's files)."""
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--follow-imports=skip", "--no-incremental",
         "--disable-error-code=import-untyped", "--python-executable", sys.executable,
         "--exclude", r"(^|/)\.venv/", *TARGETS, *map(str, extra)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    if "error:" not in done.stdout and "Success" not in done.stdout:
        raise RuntimeError(f"mypy did not run: {done.stdout[-1000:]}{done.stderr[-1000:]}")
    return [line for line in done.stdout.splitlines() if "[import-not-found]" in line]


def main() -> int:
    missing = unresolved()
    for line in missing:
        print(line)
    print(f"{len(missing)} unresolved import(s)")
    return 1 if missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
