"""Heavy test resources started once per run and shared across modules.

An eager engine or a ``minipic serve`` process costs 40-60 s to start on 2 cores (most of it
vLLM's import, paid again in the EngineCore and the worker processes), and about 3 GiB to keep.
Started per module, they were most of the suite's time. So:

* a module names what it shares: ``pytestmark = pytest.mark.shares("tiny_pic", "smol_server")``;
  asking for an undeclared resource fails the test (an undeclared one would still work, but
  the ordering below could no longer keep its users together);
* ``order_modules`` runs the modules that share a resource one after another, keeping each
  module's own test order;
* a resource stays up while a later module still declares it, and is stopped after the last
  module that does; at most ``cap`` stay up at once (memory): the least recently used of
  another module's goes first, then one of this module's that its tests fetch anew each time
  (``refetched``: an in-process engine); a handle a module fixture holds (a server) is never
  stopped under it, so such a module may exceed the cap.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Any

import pytest

MARK = "shares"


def declared(item: pytest.Item) -> frozenset[str]:
    """The shared resources a test (its module's ``pytestmark`` included) declares."""
    return frozenset(name for mark in item.iter_markers(MARK) for name in mark.args)


def order_modules(items: list[pytest.Item], resource_order: list[str]) -> list[pytest.Item]:
    """``items`` with modules reordered so that modules sharing resources run side by side.

    Modules without shared resources come first, in their collected order; the others sort by
    the positions of their resources in ``resource_order`` (unknown names last), so the users
    of each resource form one run.
    """
    modules: dict[str, list[pytest.Item]] = collections.OrderedDict()
    for item in items:
        modules.setdefault(module_id(item), []).append(item)
    rank = {name: i for i, name in enumerate(resource_order)}

    def key(entry: tuple[int, tuple[str, list[pytest.Item]]]) -> tuple:
        position, (_, module_items) = entry
        names = frozenset().union(*(declared(i) for i in module_items))
        return (bool(names), tuple(sorted(rank.get(n, len(rank)) for n in names)), position)

    ordered = sorted(enumerate(modules.items()), key=key)
    return [item for _, (_, module_items) in ordered for item in module_items]


def module_id(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


class SharedResources:
    """Live shared resources by name; see the module docstring for the policy."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.starts: collections.Counter[str] = collections.Counter()
        self._alive: collections.OrderedDict[str, tuple[Any, Callable[[Any], None], bool]] = (
            collections.OrderedDict())
        self._module = ""
        self._declared: frozenset[str] = frozenset()
        self._needed_after: dict[str, frozenset[str]] = {}

    def plan(self, items: Iterable[pytest.Item], lane_of: dict[str, int] | None = None) -> None:
        """Record, for each module in run order, what the modules after it in its lane still
        declare (``tests/support/lanes.py``: each lane runs in a process of its own)."""
        per_module: dict[str, set[str]] = collections.OrderedDict()
        for item in items:
            per_module.setdefault(module_id(item), set()).update(declared(item))
        later: collections.defaultdict[int, set[str]] = collections.defaultdict(set)
        for module in reversed(per_module):
            lane = (lane_of or {}).get(module, 0)
            self._needed_after[module] = frozenset(later[lane])
            later[lane] |= per_module[module]

    def enter(self, item: pytest.Item) -> None:
        self._module, self._declared = module_id(item), declared(item)

    def leave_module(self, module: str) -> None:
        """Stop what no later module declares (all of it when the run was not planned)."""
        keep = self._needed_after.get(module, frozenset())
        for name in [n for n in self._alive if n not in keep]:
            self._stop(name)

    def get(self, name: str, start: Callable[[], Any], stop: Callable[[Any], None],
            refetched: bool = False) -> Any:
        if name not in self._declared:
            pytest.fail(f"{self._module} uses the shared resource {name!r} without declaring it: "
                        f"add pytest.mark.{MARK}({name!r}) to the module's pytestmark",
                        pytrace=False)
        if name in self._alive:
            self._alive.move_to_end(name)
            return self._alive[name][0]
        while len(self._alive) >= self.cap:
            others = [n for n in self._alive if n not in self._declared]
            others += [n for n, (_, _, again) in self._alive.items() if again and n not in others]
            if not others:
                break  # this module holds every handle that is up: over the cap until it ends
            self._stop(others[0])
        resource = start()
        self.starts[name] += 1
        self._alive[name] = (resource, stop, refetched)
        return resource

    def close(self) -> None:
        for name in list(self._alive):
            self._stop(name)

    def _stop(self, name: str) -> None:
        resource, stop, _ = self._alive.pop(name)
        stop(resource)
