"""The retries loop: a failed job is retried by its policy, and a retry waiting for a node starts once the
node is back.

- FAILED (within a day) with a retry policy: the policy decides once (jobs/recovery.py decide: the
  failure kind, the attempts left, a crash loop, an OOM's batch template), the decision is recorded as the
  job's recovery note and an alert; a retry whose backoff is over is requeued as the next attempt. One after
  a lost node (without --min-nodes) waits QUEUED for that node.
- QUEUED waiting for a lost node that answers again: what is left of the job's earlier attempts there is
  stopped, a DOWN node is probed at once, then the job stops waiting for it and may start.

Batch: the failed jobs with a decision to make or a retry due, each claimed under locks.RETRIES; the queued
jobs waiting for nodes, claimed together (their nodes are asked at once) under the same lock.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from cluster.alerts import open_alert
from cluster.fanout import node_request, on_each
from cluster.models import Alert, Node
from cluster.monitor import poll_once

from .. import lifecycle, locks, recovery
from ..models import Attempt, Job
from ..stop import stop_tagged
from . import Report, each_claimed, run_rule, scope

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 3.0  # asking a lost node whether it is back


def run(job_ids: list[int] | None, report: Report, *, wait: bool) -> None:
    """One pass of the loop over every job (job_ids None) or the given ones."""
    run_rule("retries", lambda: report.retried.extend(retry_pass(job_ids, wait=wait)))
    run_rule("node-back", lambda: report.node_back.extend(release_waits(job_ids, wait=wait)))


def retry_pass(job_ids: list[int] | None = None, *, wait: bool = True) -> list[str]:
    """Decide about newly FAILED jobs, and start the retries whose backoff is over; the names requeued."""
    now = timezone.now()
    # jobs with a policy that failed lately (turning a cluster default on does not wake old failures)
    jobs = scope(job_ids).filter(state=Job.State.FAILED, current__finished_at__gte=now - timedelta(days=1))
    if not recovery.RETRY_ON:
        jobs = jobs.exclude(retry_on=[])

    def act(job: Job) -> str | None:
        if not job.recovery_note:
            _decide(job)
            job.refresh_from_db()
        if not job.recovery_note or job.retry_at is None or job.retry_at > now:
            return None
        nxt, _ = recovery.decide(job)
        if nxt is None:
            return None
        nxt.retry_at = None
        # one waiting for a lost node stays QUEUED until it answers
        return job.name if lifecycle.requeue(job, nxt) else None

    due = jobs.filter(Q(current__recovery_note="") | Q(current__retry_at__lte=now))
    return each_claimed(locks.RETRIES, due, act, wait=wait)


def _decide(job: Job) -> None:
    """The policy's decision about a newly failed job, recorded once (note, retry time) and told in an alert."""
    nxt, note = recovery.decide(job)
    severity = Alert.Severity.WARNING if nxt else Alert.Severity.CRITICAL
    node = Node.objects.filter(name=job.failure_node).first() if job.failure_node else None
    # the note and its alert commit together: once the note is set the decision is never made again, so a
    # worker that died between the two would leave it untold, and a reader would see the note before the alert
    with transaction.atomic():
        if not Attempt.objects.filter(pk=job.current_id, job__state=Job.State.FAILED, recovery_note="").update(
            recovery_note=note[:2000], retry_at=nxt.retry_at if nxt else None
        ):
            return  # it moved on meanwhile (a resume by hand)
        open_alert(node, f"recovery:{job.name}", severity, f"job {job.name}: {note}", job_name=job.name)


def release_waits(job_ids: list[int] | None = None, *, wait: bool = True) -> list[str]:
    """Queued attempts waiting for lost nodes: each such node that answers again first has what is left of
    the job's earlier attempts on it stopped (it may have trained on, cut off), is probed by the health
    monitor at once if it is DOWN (so the scheduler may use it now, not after the monitor's backoff), and
    the attempt stops waiting for it. Returns "job:node" for each node released."""
    waiting = scope(job_ids).filter(state=Job.State.QUEUED).exclude(current__wait_nodes=[])
    with locks.held_each(locks.RETRIES, waiting.values_list("pk", flat=True), wait=wait) as mine:
        return _release_waits({job: list(job.wait_nodes) for job in waiting.filter(pk__in=mine)})


def _release_waits(waiting: dict[Job, list[str]]) -> list[str]:
    if not waiting:
        return []
    names = sorted({n for names in waiting.values() for n in names})
    nodes = list(Node.objects.filter(name__in=names, enabled=True))
    answers = on_each(nodes, lambda n: node_request(n, "hello", timeout=HELLO_TIMEOUT_S))
    back = [node for node, _, err in answers if err is None]
    down = [n for n in back if n.status == Node.Status.DOWN]
    if down:
        poll_once(down, force=True)
    released = []
    for job, names in waiting.items():
        for node in back:
            if node.name not in names:
                continue
            unclean = _stop_earlier_attempts(job, node)
            if unclean:
                log.warning("job %s still waits for %s: %s", job.name, node.name, "; ".join(unclean))
                continue
            if lifecycle.node_back(job, node.name):
                released.append(f"{job.name}:{node.name}")
    return released


def _stop_earlier_attempts(job: Job, node: Node) -> list[str]:
    """Stop every process of the job's earlier attempts on a node that was cut off (they carry their
    attempt's tag); what could not be confirmed stopped."""
    unclean = []
    for attempt in job.earlier_attempts.exclude(tag="").filter(ranks__node=node):
        unclean += stop_tagged(attempt.tag, [node], grace=0, what=str(attempt))
    return unclean
