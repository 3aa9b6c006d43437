"""pytest-xdist's ``--dist loadgroup`` after a worker crash: the crashed test fails once, the
rest still runs.

A pytest plugin (``tests/conftest.py`` registers it; ``-p xdist_loadgroup`` loads it with
``tests/`` on the path) that gives pytest-xdist the scheduler below. pytest-timeout's thread
method ends a hung test by ending its process, and xdist replaces the worker. Under
``--dist loadgroup`` (``make test``, ``tests/gpu_suite.sh``) xdist 3.8's scheduler then:

1. puts the crashed test back in the queue, already reported failed: each replacement hangs
   on it again until ``--max-worker-restart`` is spent (8 x 300 s with two workers) and the
   run aborts with the rest unrun (pytest-dev/pytest-xdist#1371);
2. puts back the crashed worker's finished groups too, which reach a worker as empty
   commands that never complete (#1323, #1378);
3. gives a replacement worker one test, which the worker holds back until a second one or
   the end of the work arrives: never (#1327).

(2) and (3) hang the run for good. This scheduler reports the crashed test once, as
``--dist load`` does, and runs the rest (the fixes proposed upstream; xdist 3.8.0 is the
latest release). ``tests/test_xdist_grouping.py`` checks it.
"""

from __future__ import annotations

from typing import Any

import pytest


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class LoadGroupAfterCrashes(LoadGroupScheduling):
        def remove_node(self, node: Any) -> str | None:
            workload = self.assigned_work.pop(node)
            pending = [
                (unit, nodeid)
                for unit in workload.values()
                for nodeid, done in unit.items()
                if not done
            ]
            if not pending:
                return None
            crashed_unit, crashitem = pending[0]  # the one running: a worker keeps the order
            crashed_unit[crashitem] = True  # (1)
            self.workqueue.update(  # (2)
                (scope, unit) for scope, unit in workload.items() if not all(unit.values())
            )
            for other in self.assigned_work:
                self._reschedule(other)
            return crashitem

        def schedule(self) -> None:
            replacement = self.collection is not None
            super().schedule()  # a replacement gets one unit
            if replacement:
                for node in self.nodes:
                    self._reschedule(node)  # (3): a second one, or the end of the work

    return LoadGroupAfterCrashes(config, log)
