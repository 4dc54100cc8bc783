"""Time per test file at the end of a run (``make test``), slowest first.

``--durations`` names single phases; the suite's budget is spent per file (a module's engine
start lands in its first test's setup), and the CI limit is on the sum, so this prints both,
with how many times each shared resource was started.
"""

from __future__ import annotations

import collections

import pytest

_SECONDS: collections.Counter[str] = collections.Counter()
_TESTS: collections.Counter[str] = collections.Counter()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::", 1)[0]
    _SECONDS[path] += report.duration
    if report.when == "call":
        _TESTS[path] += 1


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if not _SECONDS:
        return
    tr = terminalreporter
    tr.section("time per file")
    for path, seconds in _SECONDS.most_common():
        tr.write_line(f"{seconds:8.1f} s  {_TESTS[path]:4d} tests  {path}")
    tr.write_line(f"{sum(_SECONDS.values()):8.1f} s  {sum(_TESTS.values()):4d} tests  in all")
    starts = config.stash.get(STARTS_KEY, None)
    if starts:
        tr.write_line("shared resources started: " + ", ".join(
            f"{name} x{count}" for name, count in sorted(starts.items())))


STARTS_KEY = pytest.StashKey[collections.Counter]()
