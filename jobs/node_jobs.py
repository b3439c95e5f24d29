"""Which job each node runs, for cluster's health monitor (registered in jobs/apps.py): a busy node is polled
faster, and cluster knows nothing of jobs."""

from __future__ import annotations

from datetime import datetime

from django.db.models import Max

from cluster.models import Node

from .models import Job, Rank


def node_jobs(nodes: list[Node]) -> dict[int, tuple[str | None, datetime | None]]:
    """Per node id: the tag of the job running on it (or None) and when it last had a job."""
    ids = [n.pk for n in nodes]
    running = dict(
        Rank.objects.filter(node_id__in=ids, active=True, job__state__in=Job.LIVE_STATES).values_list(
            "node_id", "attempt__tag"
        )
    )
    last = dict(
        Rank.objects.filter(node_id__in=ids).values("node_id").annotate(t=Max("ended_at")).values_list("node_id", "t")
    )
    return {n.pk: (running.get(n.pk) or None, last.get(n.pk)) for n in nodes}
