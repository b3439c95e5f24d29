"""Stopping a job's processes on its nodes: TERM, a grace period, then KILL, confirmed by looking.

This module only acts on the nodes; the job's state is jobs/lifecycle.py's to change.
"""

from __future__ import annotations

import logging
import time

from django.conf import settings

from cluster.fanout import node_request, on_each

from .models import Job, Rank

log = logging.getLogger(__name__)


def stop_processes(job: Job, ranks: list[Rank] | None = None, grace: float | None = None) -> list[str]:
    """TERM every process of the job on every node, KILL what is left after the grace period.

    grace: seconds between TERM and KILL (default KILL_GRACE_S); 0 for leftovers of an attempt that was
    given up (cut off with its node: often stopped, and its next attempt must not wait for them).

    Processes are found by the UGRO_JOB tag in their environment, which torchrun's workers inherit
    even though they run in their own sessions. Returns the nodes that could not be confirmed clean.
    """
    if not job.tag:
        return []
    ranks = ranks if ranks is not None else list(job.ranks.select_related("node"))
    grace = settings.UGRO["KILL_GRACE_S"] if grace is None else grace

    def stop_one(rank: Rank) -> int:
        node = rank.node
        if not node_request(node, "kill", timeout=10, tag=job.tag, node=node.name, signal=15)["pids"]:
            return 0  # nothing carried the tag: nothing to wait for
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if not node_request(node, "procs", timeout=10, tag=job.tag, node=node.name)["pids"]:
                return 0
            time.sleep(0.1)
        node_request(node, "kill", timeout=10, tag=job.tag, node=node.name, signal=9)
        for _ in range(25):
            left = node_request(node, "procs", timeout=10, tag=job.tag, node=node.name)["pids"]
            if not left:
                return 0
            time.sleep(0.2)
        return len(left)

    unclean = []
    for rank, left, err in on_each(ranks, stop_one):
        if err or left:
            unclean.append(f"{rank.node.name}: {err or f'{left} processes survived SIGKILL'}")
    if unclean:
        log.warning("job %s: could not confirm all processes stopped: %s", job.name, unclean)
    return unclean
