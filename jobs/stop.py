"""How a job ends: fail, finish or cancel it in the database first, then stop its processes on the nodes."""

from __future__ import annotations

import logging
import time

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from .models import Job, Rank
from .nodes import node_request, on_each

log = logging.getLogger(__name__)


def _end(job: Job, state: str, reason: str = "") -> Job:
    """Move a job to an ended state (only from a live or queued one); True if this call did it."""
    with transaction.atomic():
        updated = (
            Job.objects.filter(pk=job.pk)
            .exclude(state__in=Job.ENDED_STATES)
            .update(state=state, failure_reason=reason[:4000], finished_at=timezone.now())
        )
    job.refresh_from_db()
    if updated:
        from cluster.alerts import job_finished_alert

        from .scheduler import after_job_ended

        job_finished_alert(job)
        after_job_ended(job)
    return job


def release_nodes(job: Job) -> None:
    """Free the job's nodes for the next job (only once its processes are gone)."""
    job.ranks.filter(active=True).update(active=False)


def fail_job(job: Job, reason: str) -> Job:
    """FAIL a job that has nothing running (or whose processes were already stopped)."""
    job = _end(job, Job.State.FAILED, reason)
    release_nodes(job)
    return job


def stop_processes(job: Job, ranks: list[Rank] | None = None) -> list[str]:
    """TERM every process of the job on every node, KILL what is left after the grace period.

    Processes are found by the UGRO_JOB tag in their environment, which torchrun's workers inherit
    even though they run in their own sessions. Returns the nodes that could not be confirmed clean.
    """
    if not job.tag:
        return []
    ranks = ranks if ranks is not None else list(job.ranks.select_related("node"))
    grace = settings.UGRO["KILL_GRACE_S"]

    def stop_one(rank: Rank) -> int:
        node = rank.node
        node_request(node, "kill", timeout=10, tag=job.tag, node=node.name, signal=15)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if not node_request(node, "procs", timeout=10, tag=job.tag, node=node.name)["pids"]:
                return 0
            time.sleep(0.2)
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


def cancel_job(job: Job) -> tuple[Job, list[str]]:
    """Cancel a queued or live job; returns it and any node that could not be confirmed clean."""
    from .follow import drain_job

    was = job.state
    if job.is_ended:
        raise ValueError(f"job {job.name} already {job.state}")
    job = _end(job, Job.State.CANCELLED, "cancelled by user")
    if job.state != Job.State.CANCELLED or was == Job.State.QUEUED:
        release_nodes(job)
        return job, []
    unclean = stop_processes(job)
    drain_job(job)
    release_nodes(job)
    return job, unclean
