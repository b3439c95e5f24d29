"""The queue: QUEUED jobs start in priority order, first in first out, when their nodes are free."""

from __future__ import annotations

import logging

from django.db import transaction

from ugro_site.celery import send_task

from . import lifecycle
from .failure import Failure, FailureKind
from .launch import launch, place
from .models import Job
from .stop import stop_processes

log = logging.getLogger(__name__)


def queued_jobs() -> list[Job]:
    return list(Job.objects.filter(state=Job.State.QUEUED).order_by("-priority", "created_at", "pk"))


def place_queued(only: list[int] | None = None) -> list[Job]:
    """Claim nodes for queued jobs in order; stop at the first that must wait (no overtaking).

    only: place just these jobs (a command starting its own job), still in queue order.
    """
    placed = []
    for job in queued_jobs():
        if only is not None and job.pk not in only:
            continue
        if not place(job):
            break
        placed.append(job)
    return placed


def schedule(only: list[int] | None = None) -> list[Job]:
    """Place and launch whatever can start now; returns the jobs launched here."""
    launched = []
    for job in place_queued(only):
        try:
            launched.append(launch(job))
        except Exception as exc:  # a launch bug must not leave the job STARTING with its nodes held
            log.exception("launch of %s crashed", job.name)
            stop_processes(job)
            lifecycle.fail(job, Failure(kind=FailureKind.UNKNOWN, rank=None, node=None, exit_code=None,
                                        signal=None, line=f"launch crashed: {type(exc).__name__}: {exc}"))  # fmt: skip
    return launched


def request_schedule() -> None:
    """After this transaction commits, ask the worker to start what can start (if a broker answers).

    Without one, jobs wait QUEUED for beat's next tick or a waiting `launch` command, which
    schedules for itself.
    """
    transaction.on_commit(lambda: send_task("jobs.tasks.schedule_jobs"))
