"""Where and when queued jobs start: priority order with backfill, VRAM fit, fair share and quotas.

Pure functions over plain values (no database, no clock of their own): jobs/scheduler.py builds
the inputs from the database and applies the starts; bench/scheduler_sim.py drives the very same
`plan` with a simulated clock.

The rules, in the manner of Slurm's backfill scheduler:
- Waiting jobs are taken in order: priority (high first), then their owner's fair-share usage (GPU
  seconds, decayed with a half-life: light users first), then submission time.
- A job starts now when the GPUs it asks for (each with at least its min VRAM) are free and taking
  them delays no reservation.
- The first `reservations` jobs that cannot start hold a reservation: the earliest time enough GPUs
  free up, from running jobs' time limits, on GPUs chosen then. A later job may use a reserved GPU
  only if its own time limit ends before the reservation starts (backfill); it may always use GPUs
  no reservation needs.
- Jobs further down are placed on the same timeline (not binding). Their estimated start, and the
  reserved job's, come from what is known of each holder's end: its user's time limit, else the
  median run of its script (Running.typical_end, Demand.typical_s), else none: the estimate is then
  unknown. A cluster default limit bounds reservations and backfill but is never shown as an estimate.
- A job whose owner would exceed the GPU quota, or whose sweep already runs its maximum of trials,
  waits with reason "quota".
- A retry after a lost node (without --min-nodes, or too few nodes left) waits with reason "node" until
  that node answers again: it takes no GPUs and holds no reservation meanwhile.
- An asleep node (cluster/power.py) counts as free, but only for a job that fits with it and not without it:
  that job does not start but waits with reason "waking" ("waking gpu2 (40 s)"), its GPUs held for it in the
  pass, and the scheduler wakes the node (Decision.wake); it starts once the node answers.
- With preemption on (Limits.preempt, off by default; Slurm's PreemptMode=REQUEUE): a job behind a
  reservation may also start on reserved GPUs past the reservation's start, "on loan"; when the
  reserved job could start if the loans were gone, the decision names the loans to requeue
  (Decision.preempt). Only jobs started on loan are ever preempted, and only for a job ahead of them
  in the queue's order (so a requeued job never starts again ahead of the job it made room for).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial

INF = math.inf
WHOLE_NODE = -1


class Reason:
    """Why a job waits (what `queue` shows), in Slurm's words where it has one."""

    PRIORITY = "priority"  # jobs ahead of it come first and it does not fit beside them
    RESOURCES = "resources"  # it is next: waiting for GPUs to free up (holds a reservation)
    RESERVATION = "reservation"  # it would fit now but would delay a reserved job
    PREEMPTING = "preempting"  # it is next and starts once the jobs on loan on its GPUs are requeued
    QUOTA = "quota"  # its owner's GPU quota, or its sweep's max concurrent trials
    DEPENDENCY = "dependency"  # it starts after another job succeeded (--after)
    NODE = "node"  # a retry after a lost node: it waits for that node to answer again
    WAKING = "waking"  # it fits only with an asleep node: that node is woken, and the job starts when it answers
    NO_FIT = "resources"  # not enough eligible GPUs are up at all (nodes down or disabled)


@dataclass
class Slot:
    """One GPU, or the whole of a node without GPUs (index -1)."""

    node: int
    index: int
    vram_mb: float = 0.0
    free_at: float = 0.0  # when it is (or will be) free; the timeline estimates move it on
    expect_at: float | None = 0.0  # when it is expected to be free by what is known; None: unknown
    busy: bool = False  # held right now
    reserved_from: float = INF  # the earliest binding reservation on it
    loan: tuple[int, tuple] | None = None  # (job, its queue order key) of a job on loan here: preemptible
    asleep: bool = False  # its node sleeps (or is waking): taken only by a job that fits with it alone


@dataclass
class NodeView:
    """A node as the planner sees it: its slots in device order, and whether it takes jobs now."""

    id: int
    name: str
    usable: bool = True
    slots: list[Slot] = field(default_factory=list)
    why_not: str = ""  # what keeps it from taking jobs ("down", "drained"), named in a waiting job's detail
    waking_s: float | None = None  # asleep: None; waking: seconds since the wake was sent (its slots are asleep)


@dataclass
class Demand:
    """A waiting job's request.

    gpus: that many GPUs on any nodes. Else nodes (or named) with per_node GPUs each, or, with
    per_node None, whole nodes (every GPU of a GPU node; a GPU-less node as a whole).
    """

    job: int
    priority: int = 0
    owner: int | None = None
    submitted: float = 0.0
    time_limit: float = 3600.0
    gpus: int | None = None
    nodes: int | None = None
    per_node: int | None = None
    named: tuple[int, ...] = ()
    min_vram_mb: float | None = None
    group: int | None = None  # its sweep
    waits_for: str = ""  # why a job it depends on keeps it waiting ("" when none does)
    waits_for_nodes: tuple[str, ...] = ()  # lost nodes it waits for before it may start anywhere
    limit_set: bool = True  # time_limit is its user's own (False: the cluster default)
    typical_s: float | None = None  # median run of its script's earlier runs, when known

    @property
    def expected_s(self) -> float | None:
        """How long it is expected to run: its user's limit, else its script's median run, else unknown."""
        if self.limit_set:
            return self.time_limit
        return None if self.typical_s is None else min(self.typical_s, self.time_limit)


@dataclass
class Running:
    """A job that holds slots now, until ends_at (its start + time limit) at the latest."""

    job: int
    slots: list[tuple[int, int]]
    ends_at: float
    owner: int | None = None
    group: int | None = None
    priority: int = 0
    submitted: float = 0.0
    loan: bool = False  # started on reserved GPUs past the reservation: may be preempted (requeued)
    limit_set: bool = True  # ends_at comes from its user's own time limit (False: the cluster default)
    typical_end: float | None = None  # its start plus its script's median run, when known

    def expected_end(self, now: float) -> float | None:
        """When it is expected to end: at its user's limit, else after its script's median run; None when
        unknown, or when it has already outlived that median."""
        if self.limit_set:
            return self.ends_at
        if self.typical_end is None or self.typical_end < now:
            return None
        return min(self.typical_end, self.ends_at)


@dataclass
class Decision:
    """What the planner says of one waiting job."""

    job: int
    position: int
    start: bool = False
    placement: list[tuple[int, list[int]]] = field(default_factory=list)  # (node, GPU indices; [] whole)
    reason: str = ""
    detail: str = ""
    est_start: float | None = None
    reserved: bool = False
    loan: bool = False  # starts on loan: preempted when the reservation it overlaps can start
    preempt: list[int] = field(default_factory=list)  # running jobs on loan to requeue so that this one starts
    wake: list[int] = field(default_factory=list)  # asleep nodes to wake so that this one starts (Reason.WAKING)


@dataclass
class Limits:
    """Cluster-wide scheduling settings."""

    reservations: int = 1
    preempt: bool = False  # lend reserved GPUs to later jobs, and requeue them when the reservation can start
    min_loan_s: float = 600.0  # lend only GPUs whose reservation starts at least this late (a loan must pay)
    quota_max_gpus: int = 0  # per owner at once; 0: none
    group_limits: dict[int, int] = field(default_factory=dict)  # sweep -> max concurrent trials


def decayed_usage(intervals: Iterable[tuple[int | None, float, float, float]], now: float, half_life: float) -> dict:
    """Fair-share usage per owner: sum of GPUs x seconds, each second weighted 0.5 ** (age / half_life).

    intervals: (owner, start, end, gpus). The integral of the decay over [start, end] is closed-form.
    """
    k = math.log(2) / half_life
    usage: dict[int | None, float] = {}
    for owner, start, end, gpus in intervals:
        end = min(end, now)
        if end <= start or gpus <= 0:
            continue
        weight = (math.exp(-k * (now - end)) - math.exp(-k * (now - start))) / k
        usage[owner] = usage.get(owner, 0.0) + gpus * weight
    return usage


def order(queued: Sequence[Demand], usage: dict) -> list[Demand]:
    """The order in which waiting jobs are considered."""
    return sorted(queued, key=lambda d: (-d.priority, usage.get(d.owner, 0.0), d.submitted, d.job))


def _order_key(d: Demand | Running, usage: dict) -> tuple:  # as order() sorts
    return (-d.priority, usage.get(d.owner, 0.0), d.submitted, d.job)


def _eligible(d: Demand, s: Slot) -> bool:
    if s.index == WHOLE_NODE:
        return d.gpus is None and d.per_node is None and d.min_vram_mb is None
    return d.min_vram_mb is None or s.vram_mb >= d.min_vram_mb


def _now_order(s: Slot) -> tuple:
    # GPUs no reservation needs first (then the latest reserved), then the smallest card that fits
    # (big cards stay for big models)
    return (-s.reserved_from, s.vram_mb, s.index)


def _reserve_order(s: Slot) -> tuple:
    # a reservation takes the GPUs that free up last (by its start): the ones free sooner stay open
    # to backfill; then the smallest card that fits
    return (-s.free_at, s.vram_mb, s.index)


def choose(d: Demand, nodes: Sequence[NodeView], ok, prefer=_now_order) -> list[tuple[NodeView, list[Slot]]] | None:
    """Slots for the demand among those ok(slot) says are usable, or None if it does not fit.

    --gpus N: one node if one has room (the fullest that does), else the nodes with most room.
    Nodes x per_node: the nodes with least room to spare. Whole nodes: in the cluster's node order.
    """
    if d.named:
        by_id = {n.id: n for n in nodes}
        pool = [by_id[i] for i in d.named if i in by_id]
        if len(pool) != len(d.named):
            return None
    else:
        pool = list(nodes)
    room: list[tuple[NodeView, list[Slot]]] = []
    for n in pool:
        if not n.usable:
            if d.named:
                return None
            continue
        free = [s for s in n.slots if _eligible(d, s) and ok(s)]
        if d.gpus is None and d.per_node is None:  # whole node: every slot of it
            if len(free) != len(n.slots) or not n.slots:
                if d.named:
                    return None
                continue
            room.append((n, list(n.slots)))
        elif d.gpus is None:
            if len(free) < (d.per_node or 0):
                if d.named:
                    return None
                continue
            room.append((n, sorted(free, key=prefer)[: d.per_node]))
        elif free:
            room.append((n, sorted(free, key=prefer)))
    if d.gpus is not None:
        need = d.gpus
        if sum(len(f) for _, f in room) < need:
            return None
        single = [(n, f) for n, f in room if len(f) >= need]
        if single:
            # the fullest node that has room; among equals the one with the smallest cards
            n, f = min(single, key=lambda nf: (len(nf[1]), [prefer(s) for s in nf[1][:need]]))
            return [(n, f[:need])]
        out = []
        for n, f in sorted(room, key=lambda nf: (-len(nf[1]), [prefer(s) for s in nf[1]])):
            take = f[:need]
            out.append((n, take))
            need -= len(take)
            if need == 0:
                return out
        return None
    if d.named:
        return room
    want = d.nodes or 1
    if len(room) < want:
        return None
    if d.per_node is not None:
        spare = {n.id: sum(1 for s in n.slots if ok(s) and _eligible(d, s)) for n, _ in room}
        room = sorted(room, key=lambda nf: (spare[nf[0].id], [prefer(s) for s in nf[1]]))
    return room[:want]


def _free_at(s: Slot) -> float:
    return s.free_at


def earliest(d: Demand, nodes: Sequence[NodeView], now: float, free_at=_free_at) -> float:
    """The earliest time the demand fits on the timeline (free_at(slot)), INF if it never does."""
    plain = free_at is _free_at  # the common case reads the attribute: no call per slot

    def when(n: NodeView, count: int | None) -> float:
        if not n.usable:
            return INF
        fits = [s for s in n.slots if _eligible(d, s)]
        times = sorted([s.free_at for s in fits] if plain else map(free_at, fits))
        if count is None:  # whole node
            return max(times) if times and len(times) == len(n.slots) else INF
        return times[count - 1] if len(times) >= count else INF

    if d.gpus is not None:
        fits = [s for n in nodes if n.usable for s in n.slots if _eligible(d, s)]
        times = sorted([s.free_at for s in fits] if plain else map(free_at, fits))
        t = times[d.gpus - 1] if len(times) >= d.gpus else INF
    elif d.named:
        by_id = {n.id: n for n in nodes}
        t = max((when(by_id[i], d.per_node) if i in by_id else INF) for i in d.named)
    else:
        per = sorted(when(n, d.per_node) for n in nodes)
        want = d.nodes or 1
        t = per[want - 1] if len(per) >= want else INF
    return max(t, now)


def plan(
    now: float,
    nodes: Sequence[NodeView],
    running: Sequence[Running],
    queued: Sequence[Demand],
    usage: dict | None = None,
    limits: Limits | None = None,
    estimates: bool = True,
) -> list[Decision]:
    """Decide, for every waiting job in order, whether it starts now (and where) or why it waits.

    estimates=False (a pass that only starts jobs): past the binding reservations, a job that cannot
    start now gets no estimated start and no reason; what starts is the same either way.
    """
    limits = limits or Limits()
    usage = usage or {}
    slots = {(s.node, s.index): s for n in nodes for s in n.slots}
    for s in slots.values():
        s.free_at, s.expect_at, s.busy, s.reserved_from, s.loan = now, now, False, INF, None
    held: dict[int | None, int] = {}
    group_running: dict[int, int] = {}
    for r in running:
        for key in r.slots:
            s = slots.get(key)
            if s is not None:
                s.busy, s.free_at = True, max(s.free_at, r.ends_at, now)
                s.expect_at = _later(s.expect_at, r.expected_end(now))
                if limits.preempt and r.loan:
                    s.loan = (r.job, _order_key(r, usage))
        held[r.owner] = held.get(r.owner, 0) + len(r.slots)
        if r.group is not None:
            group_running[r.group] = group_running.get(r.group, 0) + 1

    decisions: list[Decision] = []
    reserved = 0
    first_waiting: Decision | None = None
    # Within a pass GPUs only get busier and reservations only earlier, so what did not fit stays so:
    # a request of the same shape is not tried again (many queued jobs look alike).
    free_now = sum(1 for n in nodes if n.usable for s in n.slots if not s.busy)
    no_fit_now: dict[tuple, float] = {}  # shape -> the shortest time limit that did not fit now
    not_free: set[tuple] = set()  # shapes that do not fit the free GPUs even ignoring reservations
    no_loan: dict[tuple, float] = {}  # shape -> the shortest time limit that found no loan
    lend_from = now + limits.min_loan_s  # GPUs reserved from this time on may be lent
    any_asleep = any(s.asleep for s in slots.values())
    for position, d in enumerate(order(queued, usage), start=1):
        dec = Decision(job=d.job, position=position)
        decisions.append(dec)
        if d.waits_for:
            dec.reason, dec.detail = Reason.DEPENDENCY, d.waits_for
            continue
        if d.waits_for_nodes:
            names = ", ".join(d.waits_for_nodes)
            dec.reason = Reason.NODE
            dec.detail = f"waiting for node{'s' if len(d.waits_for_nodes) > 1 else ''} {names} to come back"
            continue
        limit = limits.group_limits.get(d.group) if d.group is not None else None
        if limit is not None and group_running.get(d.group, 0) >= limit:
            dec.reason, dec.detail = Reason.QUOTA, f"its sweep runs at most {limit} trials at once"
            continue
        end = now + d.time_limit
        shape = (d.gpus, d.nodes, d.per_node, d.named, d.min_vram_mb)
        fit = None
        on_loan = False
        if free_now >= _count(d, nodes) and no_fit_now.get(shape, INF) > d.time_limit:
            fit = choose(d, nodes, lambda s, end=end: not s.busy and end <= s.reserved_from and not s.asleep)
            if fit is None and any_asleep:  # only with an asleep node: it is woken for this job
                fit = choose(d, nodes, lambda s, end=end: not s.busy and end <= s.reserved_from)
            if fit is None:
                no_fit_now[shape] = d.time_limit
        if (
            fit is None
            and limits.preempt
            and reserved
            and free_now >= _count(d, nodes)
            and no_loan.get(shape, INF) > d.time_limit
        ):
            # behind a reservation: the reserved GPUs are lent until the reserved job can start
            fit = choose(
                d,
                nodes,
                lambda s, end=end, lend_from=lend_from: (
                    not s.busy and (end <= s.reserved_from or lend_from <= s.reserved_from)
                ),
            )
            on_loan = fit is not None and any(end > s.reserved_from for _, f in fit for s in f)
            if fit is None:
                no_loan[shape] = d.time_limit
        count = sum(len(f) for _, f in fit) if fit else _count(d, nodes)
        if limits.quota_max_gpus and held.get(d.owner, 0) + count > limits.quota_max_gpus:
            dec.reason = Reason.QUOTA
            dec.detail = (
                f"its owner holds {held.get(d.owner, 0)} of at most {limits.quota_max_gpus} GPUs at once "
                f"and it needs {count}"
            )
            continue
        if fit and any(s.asleep for _, f in fit for s in f):
            _waking(dec, fit, end)
            free_now -= count
            held[d.owner] = held.get(d.owner, 0) + count
            if d.group is not None:
                group_running[d.group] = group_running.get(d.group, 0) + 1
            continue
        if fit:
            dec.start, dec.est_start, dec.loan = True, now, on_loan
            dec.placement = [(n.id, [s.index for s in f if s.index != WHOLE_NODE]) for n, f in fit]
            if on_loan:
                dec.detail = (
                    "on loan: GPUs reserved for "
                    + (f"job {first_waiting.job}" if first_waiting else "a job ahead")
                    + "; requeued from its last checkpoint when that job can start"
                )
            expected = d.expected_s
            for _, f in fit:
                for s in f:
                    s.busy, s.free_at = True, end
                    s.expect_at = None if expected is None else now + expected
            free_now -= count
            held[d.owner] = held.get(d.owner, 0) + count
            if d.group is not None:
                group_running[d.group] = group_running.get(d.group, 0) + 1
            continue
        binding = reserved < limits.reservations
        if not binding and not estimates:
            continue  # starts depend only on what is busy and on the binding reservations
        # a binding reservation counts GPUs on loan to jobs behind it in the queue as free now
        free_at = _free_at
        if binding and limits.preempt:
            free_at = partial(_free_at_preempting, now=now, key=_order_key(d, usage))
        t = earliest(d, nodes, now, free_at)
        if t == INF:
            dec.reason, dec.detail = Reason.NO_FIT, _no_fit_detail(d, nodes)
            continue
        if free_at is _free_at:
            at = choose(d, nodes, lambda s, t=t: s.free_at <= t, _reserve_order)
        else:
            at = choose(d, nodes, lambda s, t=t, f=free_at: f(s) <= t, partial(_preempt_order, free_at=free_at))
        if at is None:  # cannot happen: earliest() found the time from these slots
            dec.reason, dec.detail = Reason.NO_FIT, _no_fit_detail(d, nodes)
            continue
        dec.est_start = est = _expected_start(at, now, free_at)
        dec.placement = [(n.id, [s.index for s in f if s.index != WHOLE_NODE]) for n, f in at]
        if free_at is not _free_at and t <= now:
            dec.preempt = sorted({s.loan[0] for _, f in at for s in f if s.busy and s.loan})
            for s in slots.values():  # requeued once: no other job of this pass counts on them
                if s.loan and s.loan[0] in dec.preempt:
                    s.loan = None
        expected = d.expected_s
        for _, f in at:
            for s in f:
                s.free_at = max(s.free_at, t + d.time_limit)
                s.expect_at = None if est is None or expected is None else est + expected
                if binding:
                    s.reserved_from = min(s.reserved_from, t)
        if binding:
            reserved += 1
            dec.reserved = True
            when = _fmt_in(est - now) if est is not None else "(when they free up: unknown)"
            dec.reason, dec.detail = Reason.RESOURCES, f"next to start: GPUs reserved for it {when}"
            if dec.preempt:
                dec.reason = Reason.PREEMPTING
                dec.detail = "next to start: requeueing job(s) on loan on its GPUs: " + ", ".join(map(str, dec.preempt))
            first_waiting = first_waiting or dec
        elif shape not in not_free and free_now >= _count(d, nodes) and choose(d, nodes, lambda s: not s.busy):
            dec.reason = Reason.RESERVATION
            dec.detail = "fits now, but would run past the start reserved for " + (
                f"job {first_waiting.job}" if first_waiting else "a job ahead"
            )
        else:
            not_free.add(shape)
            dec.reason, dec.detail = Reason.PRIORITY, "jobs ahead of it take the GPUs it needs"
    return decisions


def _waking(dec: Decision, fit: list[tuple[NodeView, list[Slot]]], end: float) -> None:
    """The job fits only with asleep nodes: it waits for them to wake, their GPUs held for it in this pass."""
    sleepers = [n for n, f in fit if any(s.asleep for s in f)]
    dec.reason, dec.wake = Reason.WAKING, [n.id for n in sleepers]
    dec.detail = "waking " + ", ".join(f"{n.name} ({int(n.waking_s or 0)} s)" for n in sleepers)
    dec.placement = [(n.id, [s.index for s in f if s.index != WHOLE_NODE]) for n, f in fit]
    for _, f in fit:
        for s in f:
            s.busy, s.free_at = True, end


def _later(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else max(a, b)


def _expected_start(at: list[tuple[NodeView, list[Slot]]], now: float, free_at) -> float | None:
    """When the chosen slots are expected to be free, by what is known of their holders; None when the
    end of one holder is unknown. Never later than the timeline's own bound (free_at)."""
    latest = now
    for _, f in at:
        for s in f:
            bound = free_at(s)
            if bound <= now:  # free now, or on loan and requeued for this job
                continue
            if s.expect_at is None:
                return None
            latest = max(latest, min(s.expect_at, bound))
    return latest


def _free_at_preempting(s: Slot, now: float, key: tuple) -> float:
    return now if s.loan is not None and s.loan[1] > key else s.free_at


def _preempt_order(s: Slot, free_at) -> tuple:
    # as _reserve_order by the time it frees (loans count as now), then idle GPUs before loaned ones
    return (-free_at(s), s.loan is not None, s.vram_mb, s.index)


def _count(d: Demand, nodes: Sequence[NodeView]) -> int:
    if d.gpus is not None:
        return d.gpus
    k = len(d.named) if d.named else (d.nodes or 1)
    return k * (d.per_node or 1)


def _no_fit_detail(d: Demand, nodes: Sequence[NodeView]) -> str:
    up = [s for n in nodes if n.usable for s in n.slots if _eligible(d, s)]
    vram = f" with at least {d.min_vram_mb / 1024:.1f} GB" if d.min_vram_mb else ""
    # the nodes it could use that are not up, and why: the user sees which node to bring back
    off = [f"{n.name} {n.why_not}" for n in nodes if not n.usable and n.why_not
           and (n.id in d.named if d.named else any(_eligible(d, s) for s in n.slots))]  # fmt: skip
    off_text = f" ({', '.join(off[:5])}{f' and {len(off) - 5} more' if len(off) > 5 else ''})" if off else ""
    if d.gpus is not None:
        return f"needs {d.gpus} GPUs{vram}; {len(up)} such GPUs are up{off_text}"
    what = f"{d.per_node} GPUs{vram} each" if d.per_node else "whole"
    want = len(d.named) if d.named else (d.nodes or 1)
    return f"needs {want} nodes ({what}); not enough such nodes are up{off_text}"


def _fmt_in(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"in {seconds}s"
    if seconds < 3600:
        return f"in {seconds // 60}m"
    return f"in {seconds // 3600}h{seconds % 3600 // 60:02d}m"
