"""How many replicas a service runs: scale to zero when idle, wake on a request, scale with load.

The worker's pass decides here (serving/replicas.py then places, starts, checks and stops each replica):

- **Sleep.** A service with min_replicas 0 that had no request for idle_after_s (and none in flight) goes
  SLEEPING: each replica drains (out of the rotation, then stopped: its GPUs go back to the queue).
- **Wake.** A request to a sleeping service (the endpoint, `wake`) makes it WAKING: a replica is placed and
  started as any other; the endpoint holds the request until one is ready, at most cold_start_timeout_s (the
  engine's COLD_START_S by default). The first ready replica makes it RUNNING and records the cold start.
- **Load.** The endpoint's flusher writes each replica's requests in flight, averaged over its last few seconds
  (Replica.load). Past target_outstanding per ready replica, one more is added (up to max_replicas; not while one
  is still coming up); when the load fits in one replica fewer at half the target for SCALE_DOWN_QUIET_S, one
  leaves (down to min_replicas, at least 1 while awake). Replicas are placed as before: free GPUs only.

A replica that leaves drains first (DRAINING): the endpoint stops sending to it within READY_CACHE_S, and it is
stopped once the flusher has reported nothing in flight to it (DRAIN_S), or after DRAIN_MAX_S.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.db import transaction
from django.db.models import Max
from django.utils import timezone

from ugro_site.celery import send_task

from .balancer import GAVE_UP, READY_CACHE_S
from .engines import COLD_START_S
from .models import Replica, Service
from .placement import release
from .stats import FLUSH_S

log = logging.getLogger(__name__)

LOAD_FRESH_S = 3 * FLUSH_S  # an older load figure is not the replica's load now (the web process is gone)
SCALE_DOWN_QUIET_S = 120.0  # load low enough for one replica fewer this long: one leaves
SCALE_DOWN_SHARE = 0.5  # ... low enough: the remaining replicas would be at most half their target
DRAIN_S = READY_CACHE_S + FLUSH_S + 1.0  # the endpoint has stopped picking it, and the flusher has said since
DRAIN_MAX_S = 600.0  # the endpoint's longest exchange: stopped then, whatever is still in flight
# the order replicas leave in: those holding nothing or serving nothing first
LEAVING_ORDER = {Replica.State.PENDING: 0, Replica.State.FAILED: 1, Replica.State.STARTING: 2,
                 Replica.State.UNHEALTHY: 3, Replica.State.READY: 4}  # fmt: skip


def cold_start_timeout(service: Service) -> float:
    return float(service.cold_start_timeout_s or COLD_START_S.get(service.engine, 300))


def staying(replicas: list[Replica]) -> list[Replica]:
    """The replicas that count toward the service's number: not stopped, not leaving (a failed one counts: it
    is not replaced, as before scaling)."""
    return [r for r in replicas if r.state not in (Replica.State.STOPPED, Replica.State.DRAINING)]


def add(service: Service, replicas: list[Replica], checkpoint_id: int, why: str) -> Replica:
    """One more PENDING replica of `checkpoint_id`: a stopped row again (its counters go on), else a new index."""
    fields = {"state": Replica.State.PENDING, "checkpoint_id": checkpoint_id, "restarts": 0, "tag": "",
              "port": None, "ready_at": None, "started_at": None, "unhealthy_since": None, "draining_since": None,
              "outstanding": 0, "load": 0.0, "load_at": None, "note": why[:500]}  # fmt: skip
    for r in sorted(replicas, key=lambda r: r.index):
        if r.state == Replica.State.STOPPED:
            release(r)  # nothing, normally: a stopped replica freed its slots
            if Replica.objects.filter(pk=r.pk, state=Replica.State.STOPPED).update(**fields):
                for key, value in fields.items():
                    setattr(r, key, value)
                return r
    top = Replica.objects.filter(service=service).aggregate(top=Max("index"))["top"]
    index = 0 if top is None else top + 1
    made = Replica.objects.create(service=service, index=index, **fields)
    replicas.append(made)
    log.info("service %s: replica %s added (%s)", service.name, made.index, why)
    return made


def leave(replica: Replica, why: str) -> None:
    """Take a replica out: one holding no engine stops at once, one with an engine drains first."""
    if replica.state in (Replica.State.PENDING, Replica.State.FAILED):
        release(replica)
        fields = {"state": Replica.State.STOPPED, "note": why[:500]}
    else:
        fields = {"state": Replica.State.DRAINING, "draining_since": timezone.now(), "note": f"draining: {why}"[:500]}
    Replica.objects.filter(pk=replica.pk).update(**fields)
    for key, value in fields.items():
        setattr(replica, key, value)


def resize(service: Service, replicas: list[Replica], count: int, why: str) -> None:
    """Add or take out replicas until `count` stay."""
    present = staying(replicas)
    for _ in range(count - len(present)):
        add(service, replicas, service.checkpoint_id, why)
    extra = len(present) - count
    if extra > 0:
        order = sorted(present, key=lambda r: (LEAVING_ORDER.get(r.state, 5), -r.index))
        for r in order[:extra]:
            leave(r, why)


def drained(replica: Replica, now=None) -> bool:
    """Whether a draining replica may be stopped: the endpoint has stopped sending to it and reported nothing in
    flight since (or it has drained for DRAIN_MAX_S)."""
    now = now or timezone.now()
    waited = (now - (replica.draining_since or now)).total_seconds()
    return waited >= DRAIN_MAX_S or (waited >= DRAIN_S and replica.outstanding == 0)


def load_of(replicas: list[Replica], now) -> tuple[float, int]:
    """The requests in flight to the ready replicas (their recent average) and how many are ready."""
    ready = [r for r in replicas if r.state == Replica.State.READY]
    fresh = now - timedelta(seconds=LOAD_FRESH_S)
    return sum(r.load for r in ready if r.load_at and r.load_at >= fresh), len(ready)


def in_flight(replicas: list[Replica], now) -> int:
    fresh = now - timedelta(seconds=LOAD_FRESH_S)
    return sum(r.outstanding for r in replicas if r.load_at and r.load_at >= fresh)


def decide(service: Service, replicas: list[Replica]) -> None:
    """The worker's decision for a service not stopping, before it cares for each replica."""
    now = timezone.now()
    if service.state == Service.State.SLEEPING:
        resize(service, replicas, 0, "asleep")
        return
    if service.state == Service.State.WAKING:
        woken(service, replicas, now)
        return
    if should_sleep(service, replicas, now):
        with transaction.atomic():
            if Service.objects.filter(pk=service.pk, state=Service.State.RUNNING).update(
                state=Service.State.SLEEPING, note=f"asleep: no request for {service.idle_after_s / 60:g} min"
            ):
                service.state = Service.State.SLEEPING
                resize(service, replicas, 0, "asleep: no request")
        return
    if service.next_checkpoint_id is None:
        scale(service, replicas, now)
    if service.next_checkpoint_id is None:
        resize(service, replicas, service.replicas, "to the service's count")


def should_sleep(service: Service, replicas: list[Replica], now) -> bool:
    if service.min_replicas or not service.idle_after_s or service.next_checkpoint_id:
        return False
    last = service.last_request_at or service.created_at
    return (now - last).total_seconds() >= service.idle_after_s and in_flight(replicas, now) == 0


def woken(service: Service, replicas: list[Replica], now) -> None:
    """WAKING: a replica comes up; the first ready one makes the service RUNNING, its cold start recorded. One
    that could not start at all (given up) sends it back to sleep, saying why."""
    first = min((r.ready_at for r in replicas if r.state == Replica.State.READY and r.ready_at), default=None)
    if first is not None:
        took = max((first - (service.wake_at or first)).total_seconds(), 0.0)
        Service.objects.filter(pk=service.pk, state=Service.State.WAKING).update(
            state=Service.State.RUNNING, last_cold_start_s=took, last_request_at=now, quiet_since=None,
            note=f"woke in {took:.1f} s",
        )  # fmt: skip
        return
    present = staying(replicas)
    if present and all(r.state == Replica.State.FAILED for r in present):
        why = present[0].note
        Service.objects.filter(pk=service.pk, state=Service.State.WAKING).update(
            state=Service.State.SLEEPING, note=f"{GAVE_UP}{why}"[:500]
        )
        resize(service, replicas, 0, "asleep: could not wake")
        return
    resize(service, replicas, max(service.replicas, 1), "waking")


def scale(service: Service, replicas: list[Replica], now) -> None:
    """Follow the load between min_replicas (at least 1: awake) and max_replicas, one replica at a time."""
    low, high = max(service.min_replicas, 1), max(service.max_replicas, 1)
    load, ready = load_of(replicas, now)
    coming = [r for r in staying(replicas) if r.state in (Replica.State.PENDING, Replica.State.STARTING)]
    count = service.replicas
    if ready and load / ready > service.target_outstanding and count < high and not coming:
        _set_count(service, count + 1, f"scaled up to {count + 1}: {load:.1f} requests in flight on {ready}")
        return
    if count > low and load <= SCALE_DOWN_SHARE * service.target_outstanding * (count - 1):
        if service.quiet_since is None:
            Service.objects.filter(pk=service.pk).update(quiet_since=now)
            service.quiet_since = now
        elif (now - service.quiet_since).total_seconds() >= SCALE_DOWN_QUIET_S:
            _set_count(service, count - 1, f"scaled down to {count - 1}: {load:.1f} requests in flight")
        return
    if service.quiet_since is not None:
        Service.objects.filter(pk=service.pk).update(quiet_since=None)
        service.quiet_since = None


def _set_count(service: Service, count: int, why: str) -> None:
    now = timezone.now()
    Service.objects.filter(pk=service.pk).update(replicas=count, scaled_at=now, quiet_since=None, note=why[:500])
    service.replicas, service.scaled_at, service.quiet_since, service.note = count, now, None, why
    log.info("service %s: %s", service.name, why)


def wake(name: str) -> bool:
    """A request for a sleeping service (the endpoint): SLEEPING -> WAKING with one replica (more come with the
    load) and a worker asked now; True if this call woke it."""
    now = timezone.now()
    with transaction.atomic():
        woke = Service.objects.filter(name=name, state=Service.State.SLEEPING, min_replicas=0).update(
            state=Service.State.WAKING, wake_at=now, last_request_at=now, replicas=1, quiet_since=None,
            note="waking: a request came",
        )  # fmt: skip
        if woke:
            transaction.on_commit(lambda: send_task("serving.tasks.tend_services"))
    return bool(woke)
