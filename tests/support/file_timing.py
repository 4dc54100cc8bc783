"""Time per test file at the end of a run (``make test``), slowest first.

``--durations`` names single phases; the suite's budget is spent per file (a module's engine
start lands in its first test's setup), and the CI limit is on the sum, so this prints both,
with how many times each shared resource was started. In a parallel run (``make test``: one
lane of modules per xdist worker, ``tests/support/lanes.py``) the workers' reports reach this
controller, and each worker sends its starts and its lane at its end.

``MINIPIC_FILE_TIMES=PATH`` also writes the seconds per file as JSON: the lanes' cost estimate
(``tests/file_times.json``) is refreshed that way.
"""

from __future__ import annotations

import collections
import json
import os

import pytest

from minipic.span_contract.env import FILE_TIMES_ENV

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
    for lane, info in sorted(_LANES.items()):
        tr.write_line(f"{lane}: {len(info['modules'])} files, estimated {info['estimated_s']} s, "
                      f"took {sum(_SECONDS[m] for m in info['modules']):.0f} s")
    if os.environ.get(TIMES_ENV):
        with open(os.environ[TIMES_ENV], "w") as f:
            json.dump({p: round(s, 1) for p, s in sorted(_SECONDS.items())}, f, indent=1)
    starts = config.stash.get(STARTS_KEY, None)
    if starts:
        tr.write_line("shared resources started: " + ", ".join(
            f"{name} x{count}" for name, count in sorted(starts.items())))


STARTS_KEY = pytest.StashKey[collections.Counter]()


TIMES_ENV = FILE_TIMES_ENV
LANES_OUTPUT = "minipic_lanes"
_STARTS_OUTPUT = "minipic_starts"
_LANES: dict[str, dict] = {}


def send_from_worker(config: pytest.Config) -> None:
    """On an xdist worker: hand the controller this worker's resource starts."""
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput[_STARTS_OUTPUT] = dict(config.stash.get(STARTS_KEY, {}))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """On the controller: add a finished worker's starts and its lane to the summary."""
    output = getattr(node, "workeroutput", {})
    starts = node.config.stash.setdefault(STARTS_KEY, collections.Counter())
    starts.update(output.get(_STARTS_OUTPUT, {}))
    for lane, info in output.get(LANES_OUTPUT, {}).items():
        if info["modules"] and lane not in _LANES:
            _LANES[lane] = info
