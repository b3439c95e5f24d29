"""Celery tasks: thin wrappers that call the scheduler and the follower."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings

from .follow import follow
from .models import Job
from .scheduler import schedule
from .stop import finish_stopping, reap_ended_jobs


@shared_task(ignore_result=True)
def schedule_jobs() -> None:
    reap_ended_jobs()
    schedule()


@shared_task(ignore_result=True)
def stop_job(job_id: int) -> None:
    """Stop a cancelled job's processes on its nodes (the web request only marked it)."""
    job = Job.objects.filter(pk=job_id).first()
    if job is not None:
        finish_stopping(job)


@shared_task(ignore_result=True)
def follow_jobs() -> None:
    """Follow running jobs for up to a minute, then hand over to a fresh task (never a long-held one)."""
    follow(settings.UGRO["FOLLOW_SECONDS"], exit_when_idle=True)
    if Job.objects.filter(state=Job.State.RUNNING, follower="").exists():
        follow_jobs.apply_async(retry=False)
