"""What the scheduler reads: the cluster and the queue in a fixed number of queries, as planner input.

Shared by the scheduler (jobs/scheduler.py), the queue command and page, and the launch dry run.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Q, TextField
from django.db.models.functions import Cast
from django.utils import timezone

from cluster.models import GPU, ClusterSettings, Node

from .limits import typical_durations
from .models import Allocation, Attempt, Job, Sweep
from .placement import Decision, Demand, Limits, NodeView, Running, Slot, decayed_usage, plan

USAGE_HALF_LIVES = 6  # older use weighs under 2 %: not read at all
DEMAND_FIELDS = (
    "pk", "priority", "owner_id", "created_at", "time_limit_s", "gpus", "current__requested_count",
    "current__requested_nodes", "gpus_per_node", "min_vram_mb", "sweep_id", "after_id", "current__wait_nodes", "script",
)  # fmt: skip
AFTER = DEMAND_FIELDS.index("after_id")
JSON_LISTS = ("current__requested_nodes", "current__wait_nodes")  # read as text: the usual "[]" needs no decoding


def _json_list(value) -> list:
    if isinstance(value, str):
        return json.loads(value) if value != "[]" else []
    return value or []


def time_limit_s(job: Job, cs: ClusterSettings) -> int:
    return job.time_limit_s or cs.default_time_limit_s


@dataclass
class Entry:
    """One waiting job with the planner's word on it."""

    job: Job
    decision: Decision
    nodes: dict[int, Node]

    @property
    def est_start(self) -> datetime | None:
        t = self.decision.est_start
        return None if t is None else datetime.fromtimestamp(t, tz=timezone.get_current_timezone())

    def placement_text(self) -> str:
        parts = []
        for node_id, gpus in self.decision.placement:
            name = self.nodes[node_id].name
            parts.append(f"{name}:{','.join(map(str, gpus))}" if gpus else name)
        return " ".join(parts)


class Snapshot:
    """The cluster and the queue as the planner needs them, read in a fixed number of queries."""

    def __init__(self, now: datetime | None = None) -> None:
        self.now_dt = now or timezone.now()
        self.now = self.now_dt.timestamp()
        self.cs = ClusterSettings.load()
        self.node_rows = {n.pk: n for n in Node.objects.all()}
        gpus: dict[int, list[GPU]] = {}
        for g in GPU.objects.order_by("node_id", "index"):
            gpus.setdefault(g.node_id, []).append(g)
        self.nodes = []
        for n in sorted(self.node_rows.values(), key=Node.placement_key):
            rows = gpus.get(n.pk, [])
            asleep = n.status in (Node.Status.ASLEEP, Node.Status.WAKING)  # woken for a job that needs it
            slots = [Slot(n.pk, g.index, g.vram_mb, asleep=asleep) for g in rows] or [
                Slot(n.pk, Allocation.WHOLE_NODE, 0.0, asleep=asleep)
            ]
            why_not = "drained" if not n.enabled else "down" if n.status == Node.Status.DOWN else ""
            waking = n.status == Node.Status.WAKING and n.power_since is not None
            waking_s = max(0.0, self.now - n.power_since.timestamp()) if waking else None
            self.nodes.append(NodeView(n.pk, n.name, not why_not, slots, why_not, waking_s))

        held: dict[int, Running] = {}
        self.holders: dict[tuple[int, int], tuple[int, str]] = {}
        # job -> (its script, when it started; now while it waits): the estimates look up earlier runs by it
        self.scripts: dict[int, tuple[str, float]] = {}
        allocations = Allocation.objects.filter(active=True).values_list(
            "job_id", "job__name", "node_id", "gpu_index", "job__current__started_at", "job__time_limit_s",
            "job__owner_id", "job__sweep_id", "job__script", "holder",
        )  # fmt: skip
        services: dict[str, int] = {}
        for job_id, name, node_id, index, started, limit, owner, sweep, script, holder in allocations:
            if job_id is None:  # a service replica's hold (serving/): until the service stops, no end known
                job_id = services.setdefault(holder, -1 - len(services))
                name, started, limit, script = holder, None, None, ""
                if job_id not in held:
                    held[job_id] = Running(job_id, [], math.inf, limit_set=False)
                    self.scripts[job_id] = (script, self.now)
            r = held.get(job_id)
            if r is None:
                start = (started or self.now_dt).timestamp()
                r = held[job_id] = Running(job_id, [], start + (limit or self.cs.default_time_limit_s), owner, sweep,
                                           limit_set=limit is not None)  # fmt: skip
                self.scripts[job_id] = (script, start)
            r.slots.append((node_id, index))
            self.holders[(node_id, index)] = (job_id, name)
        self.running = list(held.values())

        self.by_name = {n.name: n.pk for n in self.node_rows.values()}
        # plain values, not model instances: a queue of thousands costs little; jobs() loads the few needed
        waiting = Job.objects.filter(state=Job.State.QUEUED).order_by("-priority", "created_at", "pk")
        # requested_nodes as text: almost always "[]", which needs no JSON decoding per row
        fields = [Cast(f, TextField()) if f in JSON_LISTS else f for f in DEMAND_FIELDS]
        rows = list(waiting.values_list(*fields))  # tuples in DEMAND_FIELDS order
        after = {r[AFTER] for r in rows if r[AFTER]}
        self.after = {pk: (name, state) for pk, name, state in
                      Job.objects.filter(pk__in=after).values_list("pk", "name", "state")} if after else {}  # fmt: skip
        self.demands = [self._demand(r) for r in rows]

        half_life = max(self.cs.fair_share_half_life_h, 0.01) * 3600
        since = self.now_dt - timedelta(seconds=half_life * USAGE_HALF_LIVES)
        # every attempt's use counts, a retried job's earlier ones too
        used = Attempt.objects.filter(Q(finished_at__isnull=True) | Q(finished_at__gt=since), started_at__isnull=False)
        self.usage = decayed_usage(
            (
                (owner, started.timestamp(), (finished or self.now_dt).timestamp(), held_gpus)
                for owner, started, finished, held_gpus in used.values_list(
                    "job__owner_id", "started_at", "finished_at", "held_gpus"
                )
            ),
            self.now,
            half_life,
        )
        sweeps = {d.group for d in self.demands if d.group is not None}
        self.limits = Limits(
            reservations=self.cs.reservations,
            quota_max_gpus=self.cs.quota_max_gpus,
            group_limits=dict(
                Sweep.objects.filter(pk__in=sweeps, max_concurrent__isnull=False).values_list("pk", "max_concurrent")
            )
            if sweeps
            else {},
        )

    def _demand(self, row: tuple) -> Demand:
        """The planner's view of a queued job: row holds its DEMAND_FIELDS, in that order (a plain tuple
        per job: the queue may hold thousands)."""
        pk, priority, owner, created, limit, gpus, count, requested, per_node, vram, sweep, after, wait, script = row
        requested = _json_list(requested)
        self.scripts[pk] = (script, self.now)
        return Demand(
            job=pk, priority=priority, owner=owner, submitted=created.timestamp(),
            time_limit=float(limit or self.cs.default_time_limit_s), gpus=gpus,
            nodes=None if requested else (count or 1), per_node=per_node,
            named=tuple(self.by_name.get(name, -1) for name in requested),
            min_vram_mb=float(vram) if vram else None, group=sweep, waits_for=self._waits_for(after) if after else "",
            waits_for_nodes=tuple(_json_list(wait)), limit_set=limit is not None,
        )  # fmt: skip

    def _waits_for(self, after_id: int | None) -> str:
        if not after_id:
            return ""
        name, state = self.after.get(after_id, ("?", ""))
        if state == Job.State.SUCCEEDED:
            return ""
        if state in (Job.State.FAILED, Job.State.CANCELLED):
            return f"job {name} {state}: this job will not start (cancel it, or relaunch {name})"
        return f"starts after job {name} succeeds (now {state or 'gone'})"

    def jobs(self, ids: list[int]) -> dict[int, Job]:
        """The queued jobs with these ids, as model instances (one query)."""
        return Job.objects.select_related("owner").in_bulk(ids)

    def plan(self, extra: list[Job] = (), estimates: bool = True) -> list[Decision]:
        """The planner's decisions; extra: unsaved jobs to consider too (a dry run); estimates=False:
        only what starts now (and the reservations) is decided, as a scheduling pass needs."""
        unsaved = [tuple(getattr(j, f.removeprefix("current__")) for f in DEMAND_FIELDS) for j in extra]
        demands = self.demands + [self._demand(row) for row in unsaved]
        if estimates:
            self._learn_durations(demands)
        return plan(self.now, self.nodes, self.running, demands, self.usage, self.limits, estimates)

    def _learn_durations(self, demands: list[Demand]) -> None:
        """Give each running or waiting job without a time limit of its own its script's median run (one
        query): the estimates use it; what starts never depends on it."""
        unlimited = [x for x in (*self.running, *demands) if not x.limit_set]
        typical = typical_durations(self.scripts[x.job][0] for x in unlimited)
        for x in unlimited:
            script, start = self.scripts[x.job]
            seconds = typical.get(script)
            if isinstance(x, Running):
                x.typical_end = None if seconds is None else start + seconds
            else:
                x.typical_s = seconds


def queue(snapshot: Snapshot | None = None) -> list[Entry]:
    """Every waiting job in order, with its position, reason and estimated start (nothing is claimed)."""
    snap = snapshot or Snapshot()
    decisions = snap.plan()
    jobs = snap.jobs([d.job for d in decisions])
    return [Entry(jobs[d.job], d, snap.node_rows) for d in decisions if d.job in jobs]


def holders_by_job(snap: Snapshot) -> dict[str, list[str]]:
    """Job name -> the GPUs it holds, as node:index (a GPU-less node by its name alone), in node order."""
    out: dict[str, list[str]] = {}
    for n in snap.nodes:
        for s in n.slots:
            holder = snap.holders.get((n.id, s.index))
            if holder:
                out.setdefault(holder[1], []).append(n.name if s.index < 0 else f"{n.name}:{s.index}")
    return out
