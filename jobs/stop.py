"""How a job ends: fail, finish or cancel it in the database first, then stop its processes on the nodes."""

from __future__ import annotations

import logging
import time
from datetime import timedelta

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


def cancel_job(job: Job, *, background: bool = False) -> tuple[Job, list[str]]:
    """Cancel a queued or live job; returns it and any node that could not be confirmed clean.

    The job is CANCELLED in the DB at once; its nodes stay held until its processes are gone.
    background=True hands the stopping to a live worker (a web request should not wait out the
    kill grace period); without one, or without background, it is done here.
    """
    was = job.state
    if job.is_ended:
        raise ValueError(f"job {job.name} already {job.state}")
    job = _end(job, Job.State.CANCELLED, "cancelled by user")
    if job.state != Job.State.CANCELLED:
        return job, []  # it ended on its own meanwhile; whoever ended it cleans up
    if was == Job.State.QUEUED:
        release_nodes(job)
        return job, []
    if background and _hand_to_worker(job):
        return job, []
    return job, finish_stopping(job)


def finish_stopping(job: Job) -> list[str]:
    """Stop an ended job's processes, take their last lines, then free its nodes."""
    from .follow import drain_job

    unclean = stop_processes(job)
    drain_job(job)
    release_nodes(job)
    return unclean


def _hand_to_worker(job: Job) -> bool:
    from ugro_site.celery import worker_alive

    from .tasks import stop_job

    if not worker_alive():
        return False
    try:
        stop_job.apply_async((job.pk,), retry=False)
    except Exception as exc:  # the broker went away in between: stop it here instead
        log.warning("could not hand stopping %s to the worker: %s", job.name, exc)
        return False
    return True


REAP_AFTER_S = 120.0


def reap_ended_jobs() -> list[str]:
    """Finish stopping jobs that ended but still hold nodes (a worker or command died mid-stop)."""
    cutoff = timezone.now() - timedelta(seconds=REAP_AFTER_S)
    stale = Job.objects.filter(state__in=Job.ENDED_STATES, finished_at__lt=cutoff, ranks__active=True).distinct()
    reaped = []
    for job in stale:
        log.warning("job %s ended %s but still held its nodes: stopping it now", job.name, job.finished_at)
        finish_stopping(job)
        reaped.append(job.name)
    return reaped
