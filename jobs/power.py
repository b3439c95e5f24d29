"""The scheduler's side of sleeping nodes: idle nodes are put to sleep, and the queue wakes the ones it wants.

cluster/power.py holds how a node sleeps and wakes (its `power:` block, the sleep command, the magic packet, the
watch that sees it wake); here is when. A node with a `power:` block that holds no job, service replica or
reservation (a waiting job's GPUs, or GPUs held for a job while its nodes wake) for its idle_after is put to sleep
(`sleep_idle`, a beat task every SLEEP_PASS_EVERY_S). A waiting job that fits only with an asleep node wakes it
(`wake_for_queue`, from each scheduling pass: jobs/placement.py decides, Decision.wake); the job waits with the
reason "waking gpu2 (40 s)" and starts on the first pass after the node answers.
"""

from __future__ import annotations

import logging
from datetime import datetime

from django.utils import timezone

from cluster import power
from cluster.models import Node

from .models import Allocation, Job
from .placement import Decision
from .snapshot import Snapshot

log = logging.getLogger(__name__)

SLEEP_PASS_EVERY_S = 15.0
SLEEPS = (Node.Status.HEALTHY, Node.Status.DEGRADED)  # a node answering its probes: put to sleep when idle


def wake_for_queue(snap: Snapshot, decisions: list[Decision]) -> list[str]:
    """Wake every asleep node a waiting job fits only with (a waking one is left to wake); a line per wake."""
    wanted: dict[int, int] = {}  # node -> the first job that wants it
    for d in decisions:
        for node_id in d.wake:
            wanted.setdefault(node_id, d.job)
    asleep = [snap.node_rows[i] for i in wanted if snap.node_rows[i].status == Node.Status.ASLEEP]
    if not asleep:
        return []
    names = dict(Job.objects.filter(pk__in=[wanted[n.pk] for n in asleep]).values_list("pk", "name"))
    lines = []
    for node in asleep:
        try:
            lines.append(f"{node.name}: {power.wake(node, f'for job {names.get(wanted[node.pk], "?")}')}")
        except power.PowerError as exc:  # DOWN with an alert: the next pass places the job elsewhere, or it waits
            lines.append(str(exc))
    for line in lines:
        log.info("%s", line)
    return lines


def _held(snap: Snapshot, decisions: list[Decision]) -> set[int]:
    """Nodes with a job's or a service's GPUs, or GPUs a waiting job is to start on, is reserved or waking for."""
    busy = {node_id for r in snap.running for node_id, _ in r.slots}
    return busy | {node_id for d in decisions for node_id, _ in d.placement}


def sleep_idle(now: datetime | None = None) -> list[str]:
    """One pass: a node with a `power:` block idle for its idle_after is put to sleep; its idle clock starts when
    it is first seen idle and stops when anything holds it. A line per node put to sleep (or that would not)."""
    now = now or timezone.now()
    snap = Snapshot(now)
    candidates = [n for n in snap.node_rows.values() if n.power and n.enabled]
    if not candidates:
        return []
    held = _held(snap, snap.plan(estimates=False))
    due = []
    for node in candidates:
        idle = node.status in SLEEPS and node.pk not in held
        if not idle:
            if node.idle_since is not None and node.status not in power.ASLEEP:
                Node.objects.filter(pk=node.pk).update(idle_since=None)
        elif node.idle_since is None:
            Node.objects.filter(pk=node.pk, idle_since__isnull=True).update(idle_since=now)
        elif (now - node.idle_since).total_seconds() >= node.power["idle_after_s"]:
            due.append(node)
    lines = []

    for node in due:  # one by one: few nodes, and a node that does not answer fails within the connect timeout
        try:
            lines.append(f"{node.name} {power.put_to_sleep(node, f'idle {_minutes(now, node)}', _holds_nothing)}")
        except power.PowerError as exc:
            lines.append(str(exc))
    for line in lines:
        log.info("%s", line)
    return lines


def _holds_nothing(node: Node) -> bool:
    """Asked once the node is marked asleep (no new claim lands on it then): nothing claimed it before that."""
    return not Allocation.objects.filter(node=node, active=True).exists()


def _minutes(now: datetime, node: Node) -> str:
    seconds = int((now - node.idle_since).total_seconds())
    return f"{seconds // 60} min" if seconds >= 120 else f"{seconds} s"


def by_hand(node: Node, verb: str, who: str) -> str:
    """`ugro node sleep NAME` / `ugro node wake NAME` (operators): a line saying what was done; PowerError in one
    line (a node that holds a job or a service is not put to sleep)."""
    if verb == "sleep":
        if not _holds_nothing(node):
            raise power.PowerError(f"{node.name} holds a job's or a service's GPUs: not put to sleep")
        return f"{node.name} {power.put_to_sleep(node, f'asked by {who}', _holds_nothing)}"
    if verb == "wake":
        timeout = (node.power or {}).get("wake_timeout_s", power.WAKE_TIMEOUT_S)
        return f"{node.name} {power.wake(node, f'asked by {who}')}: awake when it answers (wake_timeout {timeout} s)"
    raise ValueError(f"unknown power verb {verb!r}")
