"""The queue: QUEUED jobs start in priority order, first in first out, when their nodes are free."""

from __future__ import annotations

import logging

from django.db import transaction

from .models import Job

log = logging.getLogger(__name__)


def queued_jobs() -> list[Job]:
    return list(Job.objects.filter(state=Job.State.QUEUED).order_by("-priority", "created_at", "pk"))


def place_queued() -> list[Job]:
    """Claim nodes for queued jobs in order; stop at the first that must wait (no overtaking)."""
    from .launch import place

    placed = []
    for job in queued_jobs():
        if not place(job):
            break
        placed.append(job)
    return placed


def schedule() -> list[Job]:
    """Place and launch whatever can start now; returns the jobs launched here."""
    from .launch import launch

    launched = []
    for job in place_queued():
        try:
            launched.append(launch(job))
        except Exception as exc:  # a launch bug must not leave the job STARTING with its nodes held
            log.exception("launch of %s crashed", job.name)
            from .stop import fail_job, stop_processes

            stop_processes(job)
            fail_job(job, f"launch crashed: {type(exc).__name__}: {exc}")
    return launched


def request_schedule() -> None:
    """After this transaction commits, ask the worker to start what can start (if a broker answers).

    Without one, jobs wait QUEUED for beat's next tick or a waiting `launch` command, which
    schedules for itself; Celery's own publish would retry for seconds first.
    """

    def kick() -> None:
        from ugro_site.celery import broker_answers

        from .tasks import schedule_jobs

        if not broker_answers():
            return
        try:
            schedule_jobs.apply_async(retry=False)
        except Exception as exc:  # the broker went away in between: same as above
            log.debug("could not queue schedule_jobs: %s", exc)

    transaction.on_commit(kick)


def after_job_ended(job: Job) -> None:
    """Nodes were freed: let what waits start."""
    request_schedule()
