"""The ended loop: an ended job leaves nothing behind in the database.

- An ended job that still holds nodes (a crash between its end and the release): released.
- A lost rank of a job ended within LOST_OUTPUT_DAYS whose node answers again: the rest of its output is
  fetched (jobs/follow.py recover_output); so is a lost rank's of an earlier attempt ended within it, while the job
  runs on in a later one (recover_earlier_output: into that attempt's archived log).
- A job ended within LEFTOVERS_S with points past its rollup's mark: folded (a follower killed before its
  last fold leaves them, and an ended job is not followed again).
- Checkpoints beyond the job's --keep that its last scans found, or that a node that did not answer still
  holds: deleted (jobs/retention.py, under locks.RETENTION).

Processes an ended job left on a node are orphans.py's concern. Batch: the ended jobs each rule applies to,
each claimed under locks.ENDED.
"""

from __future__ import annotations

from datetime import timedelta

from django.db.models import Exists, F, OuterRef, Q
from django.db.models.functions import Coalesce
from django.utils import timezone

from metrics import rollup
from metrics.models import MetricPoint

from .. import locks
from ..follow import follower_id, recover_earlier_output, recover_output
from ..models import Job, Rank
from . import Report, each_claimed, run_retention, run_rule, scope

LOST_OUTPUT_DAYS = 7
LEFTOVERS_S = 3600  # how long after its end a job's unfolded points are still looked for


def run(job_ids: list[int] | None, report: Report, *, wait: bool) -> None:
    """One pass of the loop over every job (job_ids None) or the given ones."""
    run_rule("release", lambda: report.released.extend(release_ended(job_ids, wait=wait)))
    run_rule("lost-output", lambda: report.recovered.extend(recover_lost_output(job_ids, wait=wait)))
    run_rule("rollup", lambda: report.folded.extend(fold_leftovers(job_ids, wait=wait)))
    ended = scope(job_ids).filter(state__in=Job.ENDED_STATES)
    run_rule("retention", lambda: report.freed.extend(run_retention(ended, wait=wait)))


def release_ended(job_ids: list[int] | None = None, *, wait: bool = True) -> list[str]:
    """An ended job that still holds nodes (a crash between its end and the release): released."""

    def act(job: Job) -> str:
        job.all_ranks.filter(active=True).update(active=False)
        job.allocations.filter(active=True).update(active=False)
        return job.name

    holding = Q(all_ranks__active=True) | Q(allocations__active=True)
    ended = scope(job_ids).filter(holding, state__in=Job.ENDED_STATES).distinct()
    return each_claimed(locks.ENDED, ended, act, wait=wait)


def recover_lost_output(job_ids: list[int] | None = None, *, wait: bool = True) -> list[str]:
    """A lost rank of a recently ended job, or of a job's recently ended earlier attempt (the job requeued and
    runs on, or ended since), whose node answers again: the rest of its output is fetched."""
    cutoff = timezone.now() - timedelta(days=LOST_OUTPUT_DAYS)
    lost_left = scope(job_ids).filter(state__in=Job.ENDED_STATES, current__finished_at__gt=cutoff)
    lost_left = lost_left.filter(current__ranks__state=Rank.State.LOST, current__ranks__drained=False).distinct()
    owner = follower_id() + ":reconcile"
    done = each_claimed(locks.ENDED, lost_left, lambda job: job.name if recover_output(job, owner) else None,
                        wait=wait)  # fmt: skip
    earlier = Rank.objects.filter(state=Rank.State.LOST, drained=False, attempt__finished_at__gt=cutoff)
    earlier = scope(job_ids).filter(pk__in=earlier.exclude(attempt_id=F("job__current_id")).values("job_id"))
    found = each_claimed(locks.ENDED, earlier, lambda job: job.name if recover_earlier_output(job) else None,
                         wait=wait)  # fmt: skip
    return done + [name for name in found if name not in done]


def fold_leftovers(job_ids: list[int] | None = None, *, wait: bool = True) -> list[str]:
    """Recently ended jobs with points past their rollup's mark, folded: a follower that was killed
    before its last fold leaves them, and an ended job is not followed again (the charts fold such
    points themselves meanwhile, at a cost on every read)."""
    now = timezone.now()
    recent = scope(job_ids).filter(
        state__in=Job.ENDED_STATES, current__finished_at__gt=now - timedelta(seconds=LEFTOVERS_S)
    )
    behind = recent.annotate(upto=Coalesce("rollup_mark__upto", 0)).filter(
        Exists(MetricPoint.objects.filter(job=OuterRef("pk"), id__gt=OuterRef("upto")))
    )
    return each_claimed(locks.ENDED, behind, lambda job: job.name if rollup.catch_up(job.pk) else None, wait=wait)
