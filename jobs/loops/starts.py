"""The starts loop: a job that started must get going, and stop when its time is up.

- STARTING past its window (lifecycle.launch_limit_s: the sync window + a grace): the launcher died or hung -> FAILING
  (TIMEOUT); the teardown stops whatever it started.
- A live job past its time limit (the job's own, else the cluster default): FAILING with kind TIMEOUT; the
  teardown sends SIGTERM, then SIGKILL after the kill grace (time for a last checkpoint).
- A trial of a sweep with --median-stop doing worse than the median of the others: cancelled
  (jobs/sweeps.py median_stop; in a pass over every job only).

Batch: STARTING jobs and live jobs, each claimed under locks.STARTS; the sweeps with a running trial, each
under locks.SWEEP.
"""

from __future__ import annotations

from django.utils import timezone

from cluster.models import ClusterSettings

from .. import lifecycle, locks
from ..failure import Failure, FailureKind
from ..models import Job
from ..report import human_duration
from ..snapshot import time_limit_s
from ..sweeps import median_stop, median_stopping
from . import Report, each_claimed, run_rule, scope


def run(job_ids: list[int] | None, report: Report, *, wait: bool) -> None:
    """One pass of the loop over every job (job_ids None) or the given ones."""
    run_rule("starting", lambda: report.timed_out.extend(fail_overdue_starts(job_ids, wait=wait)))
    run_rule("time-limits", lambda: report.timed_out.extend(stop_overdue(job_ids, wait=wait)))
    if job_ids is None:
        run_rule("median-stop", lambda: report.stopped_early.extend(stop_below_median(wait=wait)))


def fail_overdue_starts(job_ids: list[int] | None = None, *, wait: bool = True) -> list[str]:
    """STARTING past its window: the launcher died or hung. The jobs failed here."""
    now = timezone.now()

    def act(job: Job) -> str | None:
        since = job.state_changed_at or job.started_at or now
        limit = lifecycle.launch_limit_s(job)
        if (now - since).total_seconds() <= limit:
            return None
        line = f"the launch did not finish within {limit:g}s (launcher {job.launcher or 'unknown'} gone?)"
        failure = Failure(kind=FailureKind.TIMEOUT, rank=None, node=None, exit_code=None, signal=None, line=line)
        return job.name if lifecycle.fail(job, failure) else None

    return each_claimed(locks.STARTS, scope(job_ids).filter(state=Job.State.STARTING), act, wait=wait)


def stop_overdue(job_ids: list[int] | None = None, *, wait: bool = True) -> list[str]:
    """Stop live jobs past their time limit: FAILING with kind TIMEOUT; the teardown sends SIGTERM and,
    after the kill grace (time for a last checkpoint), SIGKILL. The jobs stopped here."""
    cs = ClusterSettings.load()
    now = timezone.now()

    def act(job: Job) -> str | None:
        limit = time_limit_s(job, cs)
        if (now - job.started_at).total_seconds() <= limit:
            return None
        line = f"past its time limit of {human_duration(limit)}: stopped (SIGTERM, then SIGKILL after the grace)"
        failure = Failure(kind=FailureKind.TIMEOUT, rank=None, node=None, exit_code=None, signal=None, line=line)
        return job.name if lifecycle.fail(job, failure) else None

    live = scope(job_ids).filter(state__in=Job.LIVE_STATES, current__started_at__isnull=False)
    return each_claimed(locks.STARTS, live, act, wait=wait)


def stop_below_median(*, wait: bool = True) -> list[str]:
    """The median stopping rule over each sweep that asked for it and has a running trial; the trials
    stopped."""
    stopped = each_claimed(locks.SWEEP, median_stopping(), lambda sweep: median_stop([sweep]), wait=wait)
    return [name for names in stopped for name in names]
