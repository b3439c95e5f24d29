"""Celery tasks: thin wrappers that call the scheduler and the follower."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings

from .follow import follow
from .models import Job
from .scheduler import schedule


@shared_task(ignore_result=True)
def schedule_jobs() -> None:
    schedule()


@shared_task(ignore_result=True)
def follow_jobs() -> None:
    """Follow running jobs for up to a minute, then hand over to a fresh task (never a long-held one)."""
    follow(settings.UGRO["FOLLOW_SECONDS"], exit_when_idle=True)
    if Job.objects.filter(state=Job.State.RUNNING, follower="").exists():
        follow_jobs.apply_async(retry=False)
