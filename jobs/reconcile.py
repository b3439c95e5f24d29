"""The reconciler: make the database agree with what the nodes say, for every job, every few seconds.

The pattern of SkyPilot's job-status reconciler and dstack's background tasks, one per entity and state:
one loop per concern, each a module of jobs/loops/ that names its rules at its top and takes its batch job
by job under a lock of its own. Beat queues each loop as a task (jobs/tasks.py): TICK_LOOPS every few
seconds, side by side, and the orphan scan of every node less often.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from . import locks
from .loops import Report, ended, retries, running, starts, stopping
from .loops import orphans as orphan_scan  # `orphans` is reconcile()'s switch

log = logging.getLogger(__name__)

LOOPS = {
    "starts": starts,  # a launch past its window, time limits, the median stopping rule
    "running": running,  # ranks checked on their nodes, judged; hangs, stragglers
    "stopping": stopping,  # teardowns lost with their worker
    "ended": ended,  # nodes still held, lost output, rollup leftovers
    "retries": retries,  # the retry policy, jobs waiting for a node
    "orphans": orphan_scan,  # processes of ended jobs on any node (asks every node: less often)
}
TICK_LOOPS = ("starts", "running", "stopping", "ended", "retries")  # beat's every tick; "orphans" has its own
# Periodic passes of one loop running at once, across workers: a second goes around a job the first is stuck
# on, and no more pile up (each redoing the jobs the others are done with) when passes outlast the tick.
PASSES_AT_ONCE = 2


def reconcile(
    job_ids: list[int] | None = None, *, orphans: bool = True, loops=tuple(LOOPS), wait: bool = True
) -> Report:
    """One pass of each loop over every job (or the given ones); jobs/loops/ names the rules.

    Each loop takes its jobs one at a time under its own lock (jobs/loops/__init__.py each_claimed): a job
    another worker holds in that loop is waited for (wait=True: a direct call acts on every job) or skipped
    (wait=False: the periodic tasks; the next tick comes soon). A periodic pass also takes one of its loop's
    PASSES_AT_ONCE slots, and is skipped when none is free. orphans=False leaves out the scan of every node,
    as does a pass over given jobs."""
    report = Report()
    for loop in loops:
        if loop == "orphans" and not orphans:
            continue
        with _pass_slot(loop, wait) as mine:
            if mine:
                LOOPS[loop].run(job_ids, report, wait=wait)
    if report:
        log.warning("reconcile: %s", report)
    return report


@contextmanager
def _pass_slot(loop: str, wait: bool) -> Iterator[bool]:
    """Whether this pass of the loop may run: a direct one always; a periodic one while it holds a slot."""
    if wait:
        yield True
        return
    first = list(LOOPS).index(loop) * PASSES_AT_ONCE
    with locks.held_any(locks.PASS, range(first, first + PASSES_AT_ONCE)) as slot:
        yield slot is not None
