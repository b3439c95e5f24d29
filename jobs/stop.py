"""Stopping a job's processes on its nodes: TERM, a grace period, then KILL, confirmed by looking.

This module only acts on the nodes; the job's state is jobs/lifecycle.py's to change.
"""

from __future__ import annotations

import logging
import time

from django.conf import settings

from cluster.fanout import node_request, on_each
from cluster.models import Node

from .models import Job, Rank

log = logging.getLogger(__name__)


def stop_processes(job: Job, ranks: list[Rank] | None = None, grace: float | None = None) -> list[str]:
    """stop_tagged() for the processes of the job's current attempt, on the nodes of these ranks (default: all
    of its ranks)."""
    ranks = ranks if ranks is not None else list(job.ranks.select_related("node"))
    return stop_tagged(job.tag, [r.node for r in ranks], grace, what=f"job {job.name}")


def stop_tagged(tag: str, nodes: list[Node], grace: float | None = None, what: str = "") -> list[str]:
    """TERM every process carrying this tag on each node, KILL what is left after the grace period.

    grace: seconds between TERM and KILL (default KILL_GRACE_S); 0 for leftovers of an attempt that was
    given up (cut off with its node: often stopped, and its next attempt must not wait for them).

    Processes are found by the UGRO_JOB tag in their environment (a job attempt's, a service replica's),
    which torchrun's workers inherit even though they run in their own sessions. Returns the nodes that
    could not be confirmed clean.
    """
    if not tag:
        return []
    grace = settings.UGRO["KILL_GRACE_S"] if grace is None else grace

    def stop_one(node: Node) -> int:
        if not node_request(node, "kill", timeout=10, tag=tag, node=node.name, signal=15)["pids"]:
            return 0  # nothing carried the tag: nothing to wait for
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if not node_request(node, "procs", timeout=10, tag=tag, node=node.name)["pids"]:
                return 0
            time.sleep(0.1)
        node_request(node, "kill", timeout=10, tag=tag, node=node.name, signal=9)
        for _ in range(25):
            left = node_request(node, "procs", timeout=10, tag=tag, node=node.name)["pids"]
            if not left:
                return 0
            time.sleep(0.2)
        return len(left)

    unclean = []
    for node, left, err in on_each(nodes, stop_one):
        if err or left:
            unclean.append(f"{node.name}: {err or f'{left} processes survived SIGKILL'}")
    if unclean:
        log.warning("%s: could not confirm all processes stopped: %s", what or tag, unclean)
    return unclean
