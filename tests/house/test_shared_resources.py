"""The suite's own sharing of engines and servers (``tests/support/shared_resources.py``):
modules that share a resource run side by side, a resource is started once and stopped after
its last module, the cap holds, and an undeclared use fails loudly."""

from __future__ import annotations

import types

import pytest
from support import lanes
from support.shared_resources import MARK, SharedResources, order_modules

pytestmark = pytest.mark.fast


class FakeItem:
    """What the policy reads of a pytest item: its node id and its ``shares`` marks."""

    def __init__(self, nodeid: str, *names: str) -> None:
        self.nodeid = nodeid
        self.names = names

    def iter_markers(self, name: str):
        if name == MARK and self.names:
            yield types.SimpleNamespace(args=self.names)


def items(spec: dict[str, tuple[str, ...]], tests: int = 2) -> list[FakeItem]:
    return [FakeItem(f"{module}::t{i}", *names) for module, names in spec.items()
            for i in range(tests)]


def modules(ordered: list[FakeItem]) -> list[str]:
    seen: list[str] = []
    for item in ordered:
        module = item.nodeid.split("::")[0]
        if module not in seen:
            seen.append(module)
    return seen


def test_users_of_a_resource_run_side_by_side_and_tests_keep_their_order() -> None:
    spec = {"a.py": ("B",), "plain.py": (), "c.py": ("A",), "d.py": ("A", "B"), "e.py": ("B",),
            "plain2.py": ()}
    ordered = order_modules(items(spec), ["A", "B"])
    assert modules(ordered) == ["plain.py", "plain2.py", "c.py", "d.py", "a.py", "e.py"]
    assert [i.nodeid for i in ordered if i.nodeid.startswith("d.py")] == ["d.py::t0", "d.py::t1"]


class Ledger:
    def __init__(self) -> None:
        self.started: list[str] = []
        self.stopped: list[str] = []

    def get(self, pool: SharedResources, name: str, **kw):
        return pool.get(name, lambda: self.started.append(name) or name,
                        self.stopped.append, **kw)


def run(pool: SharedResources, ledger: Ledger, ordered: list[FakeItem],
        uses: dict[str, list[str]]) -> None:
    """Drive the pool as conftest's hooks do: enter each test, use, leave after a module."""
    pool.plan(ordered)
    for i, item in enumerate(ordered):
        pool.enter(item)
        for name in uses.get(item.nodeid, []):
            assert ledger.get(pool, name, refetched=True) == name
        module = item.nodeid.split("::")[0]
        if i + 1 == len(ordered) or not ordered[i + 1].nodeid.startswith(module + "::"):
            pool.leave_module(module)


def test_started_once_and_stopped_after_the_last_module_that_declares_it() -> None:
    ordered = order_modules(items({"x.py": ("A",), "y.py": ("A", "B"), "z.py": ("B",)}),
                            ["A", "B"])
    pool, ledger = SharedResources(cap=3), Ledger()
    run(pool, ledger, ordered, {"x.py::t0": ["A"], "y.py::t0": ["A", "B"], "y.py::t1": ["A"],
                                "z.py::t1": ["B"]})
    assert ledger.started == ["A", "B"]
    assert ledger.stopped == ["A", "B"]  # A after y.py (no later module declares it), B at the end


def test_the_cap_stops_another_modules_resource_first() -> None:
    ordered = items({"x.py": ("A", "B"), "y.py": ("A", "B", "C")}, tests=1)
    pool, ledger = SharedResources(cap=2), Ledger()
    pool.plan(ordered)
    pool.enter(ordered[0])
    ledger.get(pool, "A")
    ledger.get(pool, "B")
    pool.leave_module("x.py")
    assert ledger.stopped == []  # y.py declares both
    pool.enter(ordered[1])
    ledger.get(pool, "B", refetched=True)
    ledger.get(pool, "C")  # over the cap: A, declared here but refetched=False, is held: kept
    assert ledger.stopped == [] and len(ledger.started) == 3


def test_the_cap_stops_a_refetched_resource_of_the_running_module() -> None:
    ordered = items({"x.py": ("A", "B", "C")}, tests=1)
    pool, ledger = SharedResources(cap=2), Ledger()
    pool.plan(ordered)
    pool.enter(ordered[0])
    ledger.get(pool, "A", refetched=True)
    ledger.get(pool, "B", refetched=True)
    ledger.get(pool, "C", refetched=True)
    assert ledger.stopped == ["A"]  # least recently used
    ledger.get(pool, "A", refetched=True)  # asked again: started again
    assert ledger.started == ["A", "B", "C", "A"]


def test_an_undeclared_resource_fails_the_test() -> None:
    pool, ledger = SharedResources(cap=2), Ledger()
    pool.enter(FakeItem("x.py::t0", "A"))
    with pytest.raises(pytest.fail.Exception, match="without declaring it"):
        ledger.get(pool, "B")
    assert ledger.started == []


def test_each_lane_stops_a_resource_after_its_own_last_user() -> None:
    """Two lanes run in two processes: a resource both use is started in each and stopped after
    the lane's own last module, not kept for a module that runs in the other process."""
    ordered = order_modules(items({"x.py": ("A",), "y.py": ("A",), "z.py": ("A",)}), ["A"])
    lane_of = {"x.py": 0, "y.py": 1, "z.py": 1}
    pool, ledger = SharedResources(cap=3), Ledger()
    pool.plan(ordered, lane_of)
    lane0 = [i for i in ordered if lane_of[i.nodeid.split("::")[0]] == 0]
    pool.enter(lane0[0])
    ledger.get(pool, "A")
    pool.enter(lane0[-1])
    pool.leave_module("x.py")
    assert ledger.stopped == ["A"]  # y.py and z.py declare it, but run in the other lane
    pool.enter(ordered[2])  # y.py, in lane 1
    ledger.get(pool, "A")
    pool.leave_module("y.py")
    assert ledger.stopped == ["A"]  # z.py, later in lane 1, still declares it


def test_lanes_balance_the_estimated_seconds() -> None:
    times = {"big.py": 300.0, "mid.py": 200.0, "small.py": 90.0, "tiny.py": 10.0}
    lane_of = lanes.assign(times, lambda m: frozenset(), 2, times)
    assert lane_of["big.py"] != lane_of["mid.py"]
    seconds = lanes.estimated_seconds(lane_of, lambda m: frozenset(), 2, times)
    assert sorted(seconds) == [300.0, 300.0]
    assert lanes.assign(reversed(list(times)), lambda m: frozenset(), 2, times) == lane_of


def test_modules_sharing_a_resource_gather_unless_balance_pays_for_a_second_start() -> None:
    uses = {"a.py": frozenset({"R"}), "b.py": frozenset({"R"}), "c.py": frozenset(),
            "d.py": frozenset({"R"})}
    # c.py alone balances a.py + b.py: they share one start of R
    times = {"a.py": 100.0, "b.py": 100.0, "c.py": 250.0, "d.py": 10.0}
    lane_of = lanes.assign(times, uses.__getitem__, 2, times)
    assert lane_of["a.py"] == lane_of["b.py"] == lane_of["d.py"] != lane_of["c.py"]
    # two long users of R: a second start (START_SECONDS) is cheaper than running them in turn
    times = {"a.py": 400.0, "b.py": 400.0, "c.py": 10.0, "d.py": 10.0}
    lane_of = lanes.assign(times, uses.__getitem__, 2, times)
    assert lane_of["a.py"] != lane_of["b.py"]


def test_a_module_without_a_recorded_time_gets_the_default(tmp_path) -> None:
    path = tmp_path / "times.json"
    path.write_text('{"a.py": 12.5, "b.py": "not a number"}')
    assert lanes.load_times(path) == {"a.py": 12.5}
    path.write_text("{damaged")
    assert lanes.load_times(path) == {}
    assert lanes.estimated_seconds({"new.py": 0}, lambda m: frozenset(), 1, {}) == [
        lanes.DEFAULT_SECONDS]
