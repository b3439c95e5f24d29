"""The health monitor: probe every due node at once over warm links, record, judge, alert, publish.

`poll_once()` is one step (Celery beat runs it every 5 s through cluster.tasks.poll_health; the
`monitor` command loops it; tests call it directly). Each node is probed when its adaptive
interval (cluster.health.poll_interval) has passed since its last attempt and its circuit
breaker lets it; `force=True` probes every enabled node now (`manage.py health`).

One poll makes up to two attempts per node: a failed probe is retried once at once (a fresh
connection), and each failed attempt counts towards the breaker's 3-failure rule. So a node that
drops off the network is DOWN on the second poll after it went (2 failures, then the 3rd), while
a single dropped packet or a stale warm link does not flap it. A node with failures is probed
again on the next beat tick (not after its adaptive interval), and a warm link is first checked
with a `hello` bounded by the connect timeout, so a silent node fails each attempt within
CONNECT_TIMEOUT_S rather than PROBE_TIMEOUT_S. Between its probes, a node with a warm link gets
that hello on every tick (`gone_silent`); when it fails, that counts as the first failure and the
node is probed at once (two more) rather than when its interval comes round. So a silent node is DOWN
within a tick and three connect timeouts, idle or busy (bench/node_down.py times it). A node that has never answered
is DOWN on its first failed poll: there is no good record to protect from flapping. A DOWN node waiting
out its breaker's backoff gets a TCP knock on every tick and is probed as soon as it answers (`knocked`).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import Avg, Case, Count, IntegerField, Max, Q, Sum, Value, When
from django.db.models.functions import TruncMinute
from django.utils import timezone

from ugro_site.publish import send

from . import alerts, gpus
from .fanout import on_each
from .health import (
    BREAKER_TRIP_AFTER,
    Breaker,
    HealthResult,
    Thresholds,
    alert_conditions,
    poll_interval,
    score_sample,
)
from .links import AgentRequestError, HostKeyError, LinkBusy, LinkError
from .models import Alert, HealthSample, Node

log = logging.getLogger(__name__)

ATTEMPTS_PER_POLL = 2
PROBE_TIMEOUT_S = 10.0  # one probe request: nvidia-smi on a busy or just-woken GPU can take seconds
SAMPLES_RAW_HOURS = 24.0  # raw samples kept a day: last night's trouble at full resolution
SAMPLES_KEEP_DAYS = 30.0  # per-minute aggregates kept a month: trends, at a bounded table size
# How a minute of raw samples becomes one aggregate: peaks for what alerts on peaks, else means.
AVERAGED = ("score", "rtt_ms", "cpu_percent", "disk_free_gb", "load1", "gpu_util_percent", "gpu_mem_used_mb",
            "gpu_power_w")  # fmt: skip
MAXED = ("ram_percent", "disk_percent", "gpu_count", "gpu_mem_total_mb", "gpu_temp_c")


@dataclass
class PollOutcome:
    """What one poll learnt about one node."""

    node: str
    ok: bool
    status: str
    score: int | None = None
    reason: str = ""
    rtt_ms: float | None = None
    sample: dict[str, Any] | None = None
    result: HealthResult | None = None
    went_down: bool = False
    recovered: bool = False
    resolved: list[str] = field(default_factory=list)
    event: dict[str, Any] = field(default_factory=dict)


# The limits samples are judged by: the defaults of cluster/health.py Thresholds, read at each poll.
THRESHOLDS = Thresholds()


JobContext = Callable[[list[Node]], dict[int, tuple[str | None, datetime | None]]]


def no_jobs(nodes: list[Node]) -> dict[int, tuple[str | None, datetime | None]]:
    return {n.pk: (None, None) for n in nodes}


_job_context: JobContext = no_jobs


def set_job_context(provider: JobContext) -> None:
    """Let the app above (jobs, at ready()) say, per node id, the tag of the job running on it (or None) and
    when it last had a job: a busy node is polled faster. Cluster itself knows nothing of jobs."""
    global _job_context
    _job_context = provider


def is_due(node: Node, now: float, job_tag: str | None, last_activity: datetime | None) -> bool:
    """Whether the node's adaptive interval has passed and its breaker allows a probe."""
    breaker = Breaker.from_dict(node.breaker)
    if not breaker.should_try(now):
        return False
    if node.last_poll_at is None or breaker.suspect:
        return True
    age = None if last_activity is None else now - last_activity.timestamp()
    interval = poll_interval(bool(job_tag), age)
    # Beat ticks every 5 s: allow half a tick of slack so a 10 s interval is not stretched to 15 s.
    return now - node.last_poll_at.timestamp() >= interval - 2.5


def _probe(node: Node) -> tuple[dict[str, Any], float]:
    # Connect first, so the round trip measures the network, not an SSH handshake; on a warm link the
    # same hello shows within the connect timeout that the node still answers (a silent node would
    # otherwise hold the probe for its whole timeout, which is sized for a slow nvidia-smi).
    node.reach()
    link = node.link()
    t0 = time.monotonic()
    sample = link.request("probe", timeout=PROBE_TIMEOUT_S, gpu_reader=node.gpu_reader or "auto", workdir=node.workdir)
    return sample, round((time.monotonic() - t0) * 1000.0, 2)


def probe_node(node: Node, breaker: Breaker, now: float, force: bool = False):
    """Up to two attempts; returns (sample, rtt_ms, error, went_down). Breaker updated in place."""
    error = ""
    went_down = False
    for _ in range(ATTEMPTS_PER_POLL):
        if not force and not breaker.should_try(now):
            break
        try:
            sample, rtt = _probe(node)
            return sample, rtt, "", False
        except LinkBusy as exc:  # a long request holds a node that answers: no probe this time, and no failure
            error = str(exc)
            break
        except HostKeyError as exc:
            # not a blip: the node is DOWN at once, and stays so until someone trusts its new key
            error = str(exc)
            breaker.failures = max(breaker.failures, BREAKER_TRIP_AFTER - 1)
            went_down = breaker.record_failure(now) or went_down
            break
        except (LinkError, AgentRequestError, OSError) as exc:
            error = str(exc) or type(exc).__name__
            went_down = breaker.record_failure(now) or went_down
            if breaker.state == "open" and not force:
                break
    return None, None, error, went_down


def _gpu_summary(gpus: list[dict[str, Any]]) -> dict[str, Any]:
    def vals(key: str) -> list[float]:
        return [float(g[key]) for g in gpus if isinstance(g.get(key), (int, float))]

    util, used, total, temp, power = (
        vals(k) for k in ("util_percent", "mem_used_mb", "mem_total_mb", "temp_c", "power_w")
    )
    return {
        "gpu_count": len(gpus),
        "gpu_util_percent": round(sum(util) / len(util), 1) if util else None,
        "gpu_mem_used_mb": sum(used) if used else None,
        "gpu_mem_total_mb": sum(total) if total else None,
        "gpu_temp_c": max(temp) if temp else None,
        "gpu_power_w": round(sum(power), 2) if power else None,
    }


def _sample_row(node: Node, at: datetime, sample: dict[str, Any] | None, result: HealthResult | None, rtt, error):
    """The HealthSample for one probe (unsaved: a poll saves all of them in one statement)."""
    if sample is None:
        return HealthSample(node=node, time=at, ok=False, error=error[:500], status=Node.Status.DOWN)
    load = sample.get("load") or [None]
    gpus = [g for g in sample.get("gpus") or [] if isinstance(g, dict)]
    return HealthSample(
        node=node, time=at, ok=True, score=result.score if result else None, status=result.status if result else "",
        rtt_ms=rtt, cpu_percent=sample.get("cpu_percent"), ram_percent=sample.get("ram_percent"),
        disk_percent=sample.get("disk_percent"), disk_free_gb=sample.get("disk_free_gb"), load1=load[0],
        gpus=gpus, rapl=_rapl(sample), **_gpu_summary(gpus),
    )  # fmt: skip


def _rapl(sample: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The probe's CPU package energy counters (cluster/node/probe.py _probe_rapl) as kept; None: not readable."""
    zones = sample.get("rapl")
    return [z for z in zones if isinstance(z, dict)][:16] or None if isinstance(zones, list) else None


def node_event(node: Node, outcome: PollOutcome | None = None) -> dict[str, Any]:
    """The dashboard's view of a node after a poll (the `data` of a "node" cluster event)."""
    data: dict[str, Any] = {
        "node": node.name,
        "status": node.status,
        "score": node.health_score,
        "reason": node.status_reason,
        "last_seen": node.last_seen.isoformat() if node.last_seen else None,
        "checks": node.health_checks,
    }
    if outcome is not None and outcome.sample is not None:
        keys = ("cpu_percent", "ram_percent", "disk_percent", "load", "gpus")
        data["sample"] = {k: outcome.sample.get(k) for k in keys}
        data["rtt_ms"] = outcome.rtt_ms
    return data


def publish(events: list[dict[str, Any]]) -> None:
    """Push node events to the dashboard's "cluster" group; best effort (Redis is only transport)."""
    for data in events:
        send("cluster", {"type": "cluster.event", "kind": "node", "data": data})


NODE_FIELDS = ["status", "status_reason", "health_score", "health_checks", "last_seen", "breaker", "last_poll_at",
               "poll_lease_until", "workdir_id"]  # fmt: skip


def _claim(due: list[Node], force: bool) -> list[Node]:
    """Take a lease on the due nodes no other poll is probing, so failures are never counted twice.

    Beat can start a poll while a slow one (a node timing out) still runs, in another worker.
    `force` (someone asked for a reading now) probes regardless.
    """
    now = timezone.now()
    lease = timedelta(seconds=ATTEMPTS_PER_POLL * PROBE_TIMEOUT_S + 10)
    with transaction.atomic():
        free = Node.objects.select_for_update(skip_locked=True).filter(pk__in=[n.pk for n in due])
        if not force:
            free = free.filter(Q(poll_lease_until__isnull=True) | Q(poll_lease_until__lt=now))
        ids = set(free.values_list("pk", flat=True))
        Node.objects.filter(pk__in=ids).update(poll_lease_until=now + lease)
    return [n for n in due if n.pk in ids]


def _judge(node, breaker, probed, job_tag, now, at, t, open_alerts) -> tuple[PollOutcome, HealthSample]:
    """Apply one node's probe result to its row (unsaved), its alerts, and a sample (unsaved)."""
    sample, rtt, error, went_down = probed
    if sample is None and node.last_seen is None and breaker.state != "open":
        went_down = breaker.trip(now)  # never answered: nothing to protect from flapping
    node.last_poll_at = at
    node.poll_lease_until = None
    node.breaker = breaker.to_dict()
    if sample is None:
        if breaker.state == "open":
            node.status = Node.Status.DOWN
            node.status_reason = f"unreachable: {error}"[:500]
            node.health_score = 0
            node.health_checks = [{"name": "reachable", "severity": "critical", "detail": error[:300]}]
            existing = next((a for a in open_alerts if a.key == "down" and not a.job_name), None)
            alerts.open_alert(node, "down", "critical", f"{node.name} is DOWN: {error}", existing=existing)
        outcome = PollOutcome(node.name, False, node.status, node.health_score, error, went_down=went_down)
        outcome.event = node_event(node, outcome)
        return outcome, _sample_row(node, at, None, None, None, error)

    recovered = breaker.record_success(now)
    node.breaker = breaker.to_dict()
    enriched = {**sample, "rtt_ms": rtt, "expected_job": job_tag, "node": node.name}
    result = score_sample(enriched, node.gpu_count, t)
    node.status = result.status
    node.health_score = result.score
    node.status_reason = result.reason()[:500]
    node.health_checks = [{"name": c.name, "severity": c.severity, "detail": c.detail} for c in result.failed]
    node.last_seen = at
    node.workdir_id = _workdir_id(sample)
    resolved = alerts.sync_node_alerts(node, alert_conditions(result, enriched, t), open_alerts)
    if recovered:
        alerts.record_event(node, "recovered", f"{node.name} recovered (score {result.score}, {result.status})")
    outcome = PollOutcome(
        node.name, True, result.status, result.score, result.reason(), rtt, sample, result,
        recovered=recovered, resolved=[a.key for a in resolved],
    )  # fmt: skip
    outcome.event = node_event(node, outcome)
    return outcome, _sample_row(node, at, sample, result, rtt, "")


def _workdir_id(sample: dict[str, Any]) -> str:
    """The id the probe read in the node's workdir (cluster/node/probe.py ugro_workdir_id), '' if none or not one."""
    found = sample.get("workdir_id")
    return found if isinstance(found, str) and len(found) == 32 and found.isalnum() else ""


def gone_silent(idle: list[Node], now: float) -> list[Node]:
    """Nodes between probes whose warm link no longer answers a hello: they are probed now.

    Without this a node that goes silent while idle is noticed only when its interval (up to 40 s)
    comes round. A hello on a warm link is one round trip and no database work, so every tick
    affords it; nodes without a warm link here, being probed by another poll, or DOWN are left out.
    """
    stamp = timezone.now()
    warm = [
        n
        for n in idle
        if Breaker.from_dict(n.breaker).state == "closed"
        and (n.poll_lease_until is None or n.poll_lease_until < stamp)
        and n.link().connected
    ]
    return [node for node, _, err in on_each(warm, lambda n: n.reach()) if err is not None
            and not isinstance(err, LinkBusy)]  # fmt: skip


KNOCK_TIMEOUT_S = 1.0  # a TCP connect to a DOWN node's SSH port: a silent one never answers, a live one in ms
_knock_answered: dict[int, bool] = {}  # node pk -> whether its last knock (in this process) was answered


def knocked(waiting: list[Node]) -> list[Node]:
    """DOWN nodes waiting out their breaker's backoff (5, 10, 20 ... 300 s) that answer again: probed now.

    Every tick each such node gets a knock, a TCP connect to its SSH port (no login, no database work;
    KNOCK_TIMEOUT_S at most, all at once). One that answers a knock for the first time since it went DOWN
    (or since it last did not) is back, or may be (a cable plugged in again, a machine rebooted): its probe
    goes ahead of the backoff, so its leftovers are killed and a job waiting for it starts within a tick.
    One that keeps answering knocks but not probes (sshd hung) keeps the backoff. A back node that another
    poll still holds (a probe sent while it was silent) is not probed on that tick: poll_once forgets its
    answered knock, so the next tick counts it as back again."""

    def knock(node: Node) -> bool:
        try:
            socket.create_connection((node.address, node.ssh_port), timeout=KNOCK_TIMEOUT_S).close()
        except OSError:
            return False
        return True

    back = []
    for node, answered, _err in on_each([n for n in waiting if n.transport == Node.Transport.SSH], knock):
        if answered and not _knock_answered.get(node.pk):
            back.append(node)
        _knock_answered[node.pk] = bool(answered)
    return back


def poll_once(nodes: list[Node] | None = None, force: bool = False, now: float | None = None) -> list[PollOutcome]:
    """One monitor step: probe every due (or, with force, every) enabled node concurrently.

    The probes run side by side, one thread per node doing nothing but network; the database
    work for all of them then happens in this thread in a few statements.
    """
    now = time.time() if now is None else now
    nodes = list(Node.objects.filter(enabled=True)) if nodes is None else nodes
    # an asleep or waking node is cluster/power.py's to watch: a probe would only count failures against it
    nodes = [n for n in nodes if n.status not in (Node.Status.ASLEEP, Node.Status.WAKING)]
    context = _job_context(nodes)
    due = [n for n in nodes if force or is_due(n, now, *context[n.pk])]
    silent = [] if force else gone_silent([n for n in nodes if n not in due], now)
    back = [] if force else knocked([n for n in nodes if n not in due and Breaker.from_dict(n.breaker).state == "open"])
    due += silent + back
    if not due:
        return []
    due = _claim(due, force)
    for node in back:
        if node not in due:  # another poll still probes it (from before it came back): knock it again next tick
            _knock_answered.pop(node.pk, None)
    if not due:
        return []
    breakers = {n.pk: Breaker.from_dict(n.breaker) for n in due}
    for node in back:
        if node.pk in breakers:  # it answers again: the backoff is over, and the link connects at once
            breakers[node.pk].open_until = now
            node.link().heard_again()
    for node in silent:
        if node.pk in breakers:  # its hello was a failed attempt; the probe makes the other two at once
            breakers[node.pk].record_failure(now)
    probed = on_each(due, lambda n: probe_node(n, breakers[n.pk], now, force))
    at = timezone.now()
    t = THRESHOLDS
    open_alerts: dict[int, list] = {}
    for alert in Alert.objects.filter(node__in=due, resolved_at__isnull=True):
        open_alerts.setdefault(alert.node_id, []).append(alert)
    outcomes, rows = [], []
    with transaction.atomic():
        for node, result, err in probed:
            if err is not None:  # probe_node turns link errors into results; this is a bug
                log.error("health probe of %s failed: %s", node.name, err)
                continue
            outcome, row = _judge(
                node, breakers[node.pk], result, context[node.pk][0], now, at, t, open_alerts.get(node.pk, [])
            )
            outcomes.append(outcome)
            rows.append(row)
        for node in due:
            if node.last_poll_at == at:
                # One plain UPDATE per node: bulk_update's CASE per field costs more than it saves here.
                # not over a sleep that began while it was probed (cluster/power.py put_to_sleep)
                Node.objects.filter(pk=node.pk).exclude(status=Node.Status.ASLEEP).update(
                    **{f: getattr(node, f) for f in NODE_FIELDS}
                )
        HealthSample.objects.bulk_create(rows)
        gpus.record_readings({o.node: (o.sample or {}).get("gpus") or [] for o in outcomes if o.ok}, due)
    publish([o.event for o in outcomes])
    return outcomes


def run(seconds: float, tick: float = 5.0, stop=None) -> int:
    """Poll in the foreground for `seconds` (the `monitor` command, for setups without Celery)."""
    deadline = time.monotonic() + seconds
    polls = 0
    while time.monotonic() < deadline and not (stop and stop()):
        t0 = time.monotonic()
        from .power import watch  # cluster.power calls this module's poll_once on the nodes that woke

        watch()
        poll_once()
        polls += 1
        time.sleep(max(0.0, min(tick - (time.monotonic() - t0), deadline - time.monotonic())))
    return polls


# -- retention -------------------------------------------------------------------------------


def prune_samples(now: datetime | None = None) -> dict[str, int]:
    """Raw samples older than 24 h become 1-minute aggregates; aggregates older than 30 days go."""
    now = now or timezone.now()
    # Only whole minutes: a minute straddling the cutoff waits for the next run.
    raw_cutoff = (now - timedelta(hours=SAMPLES_RAW_HOURS)).replace(second=0, microsecond=0)
    keep_cutoff = now - timedelta(days=SAMPLES_KEEP_DAYS)
    old = HealthSample.objects.filter(kind=HealthSample.Kind.RAW, time__lt=raw_cutoff)
    per_minute = (
        old.annotate(
            ok_int=Case(When(ok=True, then=Value(1)), default=Value(0), output_field=IntegerField()),
            minute=TruncMinute("time", tzinfo=UTC),
        )
        .values("node_id", "minute")
        .annotate(
            n=Count("id"),
            ok_n=Sum("ok_int"),
            asleep_n=Sum(
                Case(When(status=Node.Status.ASLEEP, then=Value(1)), default=Value(0), output_field=IntegerField())
            ),
            **{k: Avg(k) for k in AVERAGED},
            **{k: Max(k) for k in MAXED},
        )
        .order_by("node_id", "minute")
    )
    with transaction.atomic():
        made = HealthSample.objects.bulk_create(
            HealthSample(
                node_id=row["node_id"],
                time=row["minute"],
                kind=HealthSample.Kind.MINUTE,
                samples=row["n"],
                ok=row["ok_n"] == row["n"],
                status="" if row["ok_n"] else Node.Status.ASLEEP if row["asleep_n"] else Node.Status.DOWN,
                **{k: row[k] for k in AVERAGED + MAXED},
            )  # fmt: skip
            for row in per_minute
        )
        raw_deleted, _ = old.delete()
        expired, _ = HealthSample.objects.filter(kind=HealthSample.Kind.MINUTE, time__lt=keep_cutoff).delete()
    return {"aggregated": len(made), "raw_deleted": raw_deleted, "expired": expired}
