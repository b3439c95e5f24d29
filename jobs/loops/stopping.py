"""The stopping loop: a stopping job's teardown lost with its worker is run again.

- CANCELLING or FAILING past the kill grace + STOPPING_RETRY_S: the teardown (queued when the job began to
  stop) was lost -> run it here (lifecycle.teardown: SIGTERM, SIGKILL after the grace, the end final).

Batch: the stopping jobs, each claimed under locks.STOPPING (the teardown itself holds locks.TEARDOWN, which
the teardown task takes too).
"""

from __future__ import annotations

from django.conf import settings
from django.utils import timezone

from .. import lifecycle, locks
from ..models import Job
from . import Report, each_claimed, run_rule, scope


def run(job_ids: list[int] | None, report: Report, *, wait: bool) -> None:
    """One pass of the loop over every job (job_ids None) or the given ones."""
    run_rule("teardowns", lambda: report.torn_down.extend(tear_down_lost(job_ids, wait=wait)))


def tear_down_lost(job_ids: list[int] | None = None, *, wait: bool = True) -> list[str]:
    """CANCELLING or FAILING past the kill grace and the retry time: the teardown was lost. The jobs torn
    down here."""
    now = timezone.now()
    retry_after = settings.UGRO["KILL_GRACE_S"] + lifecycle.STOPPING_RETRY_S

    def act(job: Job) -> str | None:
        since = job.state_changed_at or now
        return job.name if (now - since).total_seconds() > retry_after and lifecycle.teardown(job) else None

    return each_claimed(locks.STOPPING, scope(job_ids).filter(state__in=Job.STOPPING_STATES), act, wait=wait)
