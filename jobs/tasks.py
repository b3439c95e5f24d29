"""Celery tasks: thin wrappers around the scheduler, the follower, the lifecycle and the reconciler.

All are safe to run twice (acks_late: a task lost with its worker is delivered again).
"""

from __future__ import annotations

import logging
import threading

from celery import shared_task
from celery.signals import worker_shutting_down

from ugro_site.celery import send_task

from . import cache, lifecycle, power
from .follow import follow
from .models import Job
from .reconcile import TICK_LOOPS, reconcile
from .scheduler import schedule

log = logging.getLogger(__name__)
# One follow task follows this long, then hands its jobs to a fresh one: each hand-over delays the lines of that
# moment by up to a second, so hand-overs are rare, and a task stays well under the broker's visibility timeout.
FOLLOW_SECONDS = 600.0
FOLLOW_JOBS_PER_TASK = 2  # more jobs, more follow tasks (worker threads): one slow node holds up at most one other job
_shutting_down = threading.Event()


@worker_shutting_down.connect
def _hand_back_on_shutdown(**_kwargs) -> None:
    """A warm shutdown (SIGTERM, Ctrl-C) waits for the tasks running: a follow task would go on for up
    to FOLLOW_SECONDS. Told here, follow tasks hand their jobs back within a pass and queue a successor
    for the next worker, so a worker stops in seconds and no job waits for a lease to lapse."""
    _shutting_down.set()


@shared_task(ignore_result=True, acks_late=True)
def schedule_jobs() -> None:
    if schedule():
        send_task("jobs.tasks.follow_jobs")  # their first lines are copied now, not at beat's next tick


@shared_task(ignore_result=True, expires=15)
def sleep_idle_nodes() -> None:
    """Beat's pass over the nodes with a power: block: the ones idle for their idle_after go to sleep."""
    power.sleep_idle()


@shared_task(ignore_result=True, acks_late=True)
def teardown_job(job_id: int) -> None:
    """Stop a cancelling or failing job's processes and make its end final."""
    job = Job.objects.filter(pk=job_id).first()
    if job is not None:
        lifecycle.teardown(job)


@shared_task(ignore_result=True, acks_late=True)
def reconcile_jobs() -> None:
    """Beat's tick of the reconciler: one task per loop, so that they run side by side on the worker's
    threads and a slow loop never holds up the others."""
    for loop in TICK_LOOPS:
        if not send_task("jobs.tasks.reconcile_loop", loop):
            reconcile(loops=[loop], wait=False)  # the broker away: this tick runs them here, one by one


@shared_task(ignore_result=True, acks_late=True)
def reconcile_loop(loop: str) -> None:
    reconcile(loops=[loop], wait=False)  # a job another worker holds in this loop is left to it this tick


@shared_task(ignore_result=True, acks_late=True)
def scan_orphans() -> None:
    """Beat's orphan scan (every ORPHAN_SCAN_EVERY_S): it asks every node, so it runs less often than the
    per-job loops."""
    reconcile(loops=["orphans"], wait=False)


@shared_task(ignore_result=True, expires=600)
def trim_caches() -> None:
    """Beat's pass over every store (every TRIM_CACHES_EVERY_S): each node's and the controller's under its limit,
    never what a job or a service needs."""
    cache.trim_all()


@shared_task(ignore_result=True, acks_late=True)
def follow_jobs() -> None:
    """Follow jobs for up to FOLLOW_SECONDS (10 minutes), then hand over to a fresh task. Bounded, so a task
    is never held for good, and under the broker's visibility timeout (an hour: acks_late); long, because
    each hand-over delays the lines of that moment (a fresh follower and its first pass)."""
    follow(
        FOLLOW_SECONDS, exit_when_idle=True, max_jobs=FOLLOW_JOBS_PER_TASK,
        more_wanted=lambda: send_task("jobs.tasks.follow_jobs"), stopping=_shutting_down.is_set,
    )  # fmt: skip
    if Job.objects.filter(lifecycle.followable(), current__follower="").exists():
        # handed back at shutdown (for the next worker), or Redis away: no successor was queued
        # then; beat queues a follow task every few seconds anyway.
        send_task("jobs.tasks.follow_jobs")
