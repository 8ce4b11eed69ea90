"""The suite's `--dist loadgroup`, mended for a worker that dies (conftest.py installs it through
xdist's `pytest_xdist_make_scheduler` hook).

A test that ends its process (native code running an instruction the CPU lacks, an abort) kills
its xdist worker. xdist 3.8.0 reports that test as failed and starts a replacement worker, but
its `LoadScopeScheduling` (which `loadgroup` is) then hangs the run at its end, with every
worker idle (pytest-dev/pytest-xdist#1378, #1323, #1327):
- the dead worker's whole workload goes back on the queue, the groups it had finished too; each
  comes out as an empty unit, which uses up the turn of a worker that then waits for work;
- the test that killed the worker goes back with the rest and is run again by the replacement
  (#1371), which it kills too;
- a worker runs a test only once it knows the next one (or is told to stop), so a worker given
  a single test waits until another arrives, and none may;
- a second replacement, started before the first has collected, is handed work when the first
  has, before it has collected itself: the run stops with a KeyError (#1189).
Here only unfinished tests go back, the one that crashed marked done (xdist has reported it),
a worker gets work only once it has collected, is topped up to more than two tests while the
queue has any, and is told to stop as soon as the queue is empty. tests/test_crashes.py shows a crashing test failing by name and
the run ending.
"""
from __future__ import annotations

from xdist.scheduler import LoadGroupScheduling


class CrashSafeLoadGroupScheduling(LoadGroupScheduling):
    """`--dist loadgroup` whose run always ends after a worker dies."""

    def remove_node(self, node) -> str | None:
        """The test `node` died in (None at a clean shutdown); its other unfinished tests go
        back on the queue, each in its group's unit."""
        workload = self.assigned_work.pop(node)
        crashed = next((nodeid for unit in workload.values()
                        for nodeid, done in unit.items() if not done), None)
        if crashed is None:
            return None
        workload[self._split_scope(crashed)][crashed] = True
        for scope, unit in workload.items():
            if not all(unit.values()):
                self.workqueue[scope] = unit
        for other in self.assigned_work:
            self._reschedule(other)
        return crashed

    def _reschedule(self, node) -> None:
        """Give `node`, once it has collected, units until it holds more than two tests (or the
        queue is empty), and tell it to stop once the queue is empty."""
        if node.shutting_down or node not in self.registered_collections:
            return
        while self.workqueue and self._pending_of(self.assigned_work[node]) <= 2:
            self._assign_work_unit(node)
        if not self.workqueue:
            node.shutdown()
