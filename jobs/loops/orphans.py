"""The orphans loop: no process of an ended job runs on any node.

- Processes on a node tagged with a job this controller knows has ended (a node cut off during the
  teardown, a teardown that could not confirm them gone): killed, and an event on the node says so.
- Processes tagged with an earlier attempt of a job (the tag is no longer the job's): killed likewise.

It asks every node that answers for its tagged processes, so it runs less often than the per-job loops:
beat queues it every ORPHAN_SCAN_EVERY_S (ugro_site/settings.py), and a pass over given jobs leaves it out.
Batch: the enabled nodes not DOWN, claimed together under locks.ORPHANS (keyed by the node) and asked at once.
"""

from __future__ import annotations

from django.db.models import F

from cluster.alerts import record_event
from cluster.fanout import node_request, on_each
from cluster.models import Alert, Node

from .. import locks
from ..models import Attempt, Job
from ..stop import stop_processes, stop_tagged
from . import Report, run_rule

TAGGED_TIMEOUT_S = 5.0


def run(job_ids: list[int] | None, report: Report, *, wait: bool) -> None:
    """One scan of every node; none in a pass over given jobs (the scan is of nodes, not of jobs)."""
    if job_ids is None:
        run_rule("orphans", lambda: report.orphans_killed.extend(kill_orphans(wait=wait)))


def kill_orphans(*, wait: bool = True) -> list[str]:
    """Kill processes tagged with a job that has ended (this controller's jobs only) and say so."""
    nodes = Node.objects.filter(enabled=True).exclude(status__in=Node.NOT_ANSWERING)
    with locks.held_each(locks.ORPHANS, nodes.values_list("pk", flat=True), wait=wait) as mine:
        return _kill_orphans(list(nodes.filter(pk__in=mine)))


def _kill_orphans(nodes: list[Node]) -> list[str]:
    answers = on_each(nodes, lambda n: node_request(n, "tagged", timeout=TAGGED_TIMEOUT_S, node=n.name))
    killed = []
    for node, result, err in answers:
        if err is not None or not result:
            continue
        tags = result.get("tags") or {}
        if not tags:
            continue
        ended = Job.objects.filter(current__tag__in=list(tags), state__in=Job.ENDED_STATES)
        for job in ended:
            rank = job.ranks.filter(node=node).select_related("node").first()
            if rank is None:
                continue
            unclean = stop_processes(job, [rank])
            pids = tags.get(job.tag) or []
            message = (
                f"{len(pids)} process(es) of ended job {job.name} ({job.state}) were still running on "
                f"{node.name}: {'killed' if not unclean else 'could not be confirmed killed'}"
            )
            record_event(node, f"orphans:{job.name}", message, job_name=job.name, severity=Alert.Severity.WARNING)
            killed.append(f"{node.name}:{job.name}")
        # an earlier attempt's processes (its tag is no longer the job's): e.g. on a node that was cut off
        earlier = Attempt.objects.filter(tag__in=list(tags)).exclude(job__current=F("pk")).select_related("job")
        for attempt in earlier:
            unclean = stop_tagged(attempt.tag, [node], grace=0, what=str(attempt))
            pids = tags.get(attempt.tag) or []
            message = (
                f"{len(pids)} process(es) of attempt {attempt.number} of job {attempt.job.name} were still running "
                f"on {node.name}: {'killed' if not unclean else 'could not be confirmed killed'}"
            )
            record_event(node, f"orphans:{attempt.job.name}", message, job_name=attempt.job.name,
                         severity=Alert.Severity.WARNING)  # fmt: skip
            killed.append(f"{node.name}:{attempt.job.name}#{attempt.number}")
    return killed
