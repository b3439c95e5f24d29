"""Setting a job's rows directly, as tests do to stage a situation: the job's own fields on its row, those of
its current attempt (times, failure, lease...) on the attempt's row, as jobs/lifecycle.py writes them."""

from __future__ import annotations

from jobs.models import ATTEMPT_FIELDS, Attempt, Job

_ATTEMPT = ATTEMPT_FIELDS | {"number"}
_RENAMED = {"resume_step": "from_step", "attempt": "number"}


def update_jobs(jobs, **fields) -> int:
    """jobs.update(**fields) where some fields are the current attempt's (Job.tag is Job.current.tag)."""
    fields = {_RENAMED.get(k, k): v for k, v in fields.items()}
    of_attempt = {k: v for k, v in fields.items() if k in _ATTEMPT}
    of_job = {k: v for k, v in fields.items() if k not in _ATTEMPT}
    ids = list(jobs.values_list("pk", flat=True))
    if of_attempt:
        Attempt.objects.filter(pk__in=Job.objects.filter(pk__in=ids).values("current")).update(**of_attempt)
    if of_job:
        Job.objects.filter(pk__in=ids).update(**of_job)
    return len(ids)
