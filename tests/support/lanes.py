"""Split a parallel run (``pytest -n N``) into one lane of whole modules per xdist worker.

The suite is CPU-bound on engine and server starts, most of which are vLLM's import on one
core, so two workers on two cores halve it only if each keeps its own shared engines
(``tests/support/shared_resources.py``) and the work is even. A lane is therefore a fixed set of
whole modules, in the run order ``order_modules`` gave, handed to one worker as one xdist group:

* modules are placed greedily, slowest first, on the lane that ends earliest once the module
  and the shared resources it would start there are counted;
* a module's cost is its time in an earlier run (``tests/file_times.json``, written by
  ``make test``'s time-per-file table with ``MINIPIC_FILE_TIMES``), ``DEFAULT_SECONDS`` for a
  new file; a resource's start costs ``START_SECONDS`` once per lane that uses it, so modules
  that share a resource gather on one lane unless the balance pays for a second start.

Every worker computes the same assignment from the same collection and writes it to
``MINIPIC_TEST_LANES_FILE`` (a file of the controller's scratch folder); the controller's
scheduler (``scheduler``) reads it and hands each lane to one worker whole, as xdist's
``loadscope`` does with a module. (xdist's own ``loadgroup`` cannot do it under pytest 9.2: it
renames items through ``item._nodeid``, which pytest no longer reads.)
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from minipic.span_contract.env import TEST_LANES_FILE_ENV

TIMES_FILE = Path(__file__).resolve().parents[1] / "file_times.json"
DEFAULT_SECONDS = 20.0  # a module not timed yet
START_SECONDS = 45.0  # one shared engine or server start (tests/support/shared_resources.py)
FILE_ENV = TEST_LANES_FILE_ENV


def load_times(path: Path = TIMES_FILE) -> dict[str, float]:
    """Seconds per test file from an earlier run; empty when the file is missing or damaged
    (the lanes are then balanced by module count alone, still correct, only less even)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in data.items() if isinstance(v, int | float)}


def assign(modules: Iterable[str], resources: Callable[[str], frozenset[str]], lanes: int,
           times: Mapping[str, float]) -> dict[str, int]:
    """Module -> lane index (0..lanes-1), balancing estimated seconds (module docstring)."""
    names = list(modules)
    load = [0.0] * lanes
    started: list[set[str]] = [set() for _ in range(lanes)]
    lane_of: dict[str, int] = {}
    cost = {m: times.get(m, DEFAULT_SECONDS) for m in names}
    for module in sorted(names, key=lambda m: (-cost[m], m)):
        needs = resources(module)
        finish = [load[lane] + cost[module] + START_SECONDS * len(needs - started[lane])
                  for lane in range(lanes)]
        best = min(range(lanes), key=lambda lane: (finish[lane], lane))
        load[best] = finish[best]
        started[best] |= needs
        lane_of[module] = best
    return lane_of


def estimated_seconds(lane_of: Mapping[str, int], resources: Callable[[str], frozenset[str]],
                      lanes: int, times: Mapping[str, float]) -> list[float]:
    """Each lane's estimated seconds under ``assign``'s cost model (for the run's report)."""
    load = [0.0] * lanes
    for lane in range(lanes):
        mine = [m for m, chosen in lane_of.items() if chosen == lane]
        starts = frozenset().union(*(resources(m) for m in mine)) if mine else frozenset()
        load[lane] = sum(times.get(m, DEFAULT_SECONDS) for m in mine) + START_SECONDS * len(starts)
    return load


def publish(lane_of: Mapping[str, int]) -> None:
    """On a worker: write the assignment for the controller's scheduler (atomically: both
    workers write the same content)."""
    path = Path(os.environ[FILE_ENV])
    tmp = path.with_name(f"{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(dict(lane_of)))
    os.replace(tmp, path)


def scheduler(config: Any, log: Any) -> Any:
    """xdist's ``loadscope`` with a lane as the scope: each worker runs one lane, its modules in
    the run order the workers collected."""
    from xdist.scheduler import LoadScopeScheduling

    class LaneScheduling(LoadScopeScheduling):
        lane_of: dict[str, int] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.lane_of is None:
                try:
                    self.lane_of = json.loads(Path(os.environ[FILE_ENV]).read_text())
                except (KeyError, OSError, ValueError):
                    self.lane_of = {}  # no worker collected (an error): one scope, reported
            return f"lane{self.lane_of.get(nodeid.split('::', 1)[0], 0)}"

    return LaneScheduling(config, log)
