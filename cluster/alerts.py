"""Alerts: open one per node and condition, resolve it when the condition clears, tell people.

The health monitor calls `sync_node_alerts` after each probe with the conditions true now; jobs
call `job_finished_alert` and `rank_died_alert`. Every new alert (and every escalation) is
delivered after commit by email (Django's email backend) and by a JSON POST to a webhook, on a
small background pool with a short timeout, so a slow or failing receiver never blocks a poll.
"""

from __future__ import annotations

import json
import logging
import urllib.request
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django.apps import apps
from django.conf import settings
from django.core.mail import send_mail
from django.db import IntegrityError, transaction
from django.utils import timezone

from .models import Alert, AlertSettings, Node

log = logging.getLogger(__name__)

SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}
# Condition keys the health monitor owns: a probe that no longer reports one resolves it.
MONITOR_KEYS = ("down", "score", "gpu_count", "gpu_temp:", "ram", "disk")
WEBHOOK_TIMEOUT_S = 5.0

# Two threads are plenty for a few alerts a minute; a hung receiver delays only other deliveries.
_UNKNOWN = object()
_senders = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ugro-alert")


def _monitor_key(key: str) -> bool:
    return any(key == k or (k.endswith(":") and key.startswith(k)) for k in MONITOR_KEYS)


def open_alert(
    node: Node | None, key: str, severity: str, message: str, job_name: str = "", existing: Any = _UNKNOWN
) -> Alert | None:
    """Open the alert for this condition, or update the open one; people hear of new and louder ones.

    `existing`: the open alert for (node, key), or None for none, when the caller already knows.
    """
    now = timezone.now()
    message = message[:1000]
    if existing is _UNKNOWN:
        existing = Alert.objects.filter(node=node, key=key, resolved_at__isnull=True, job_name=job_name).first()
    if existing:
        louder = SEVERITY_RANK[severity] > SEVERITY_RANK[existing.severity]
        if existing.severity != severity or existing.message != message:
            existing.severity, existing.message, existing.updated_at = severity, message, now
            existing.save(update_fields=["severity", "message", "updated_at"])
        if louder:
            notify(existing)
        return existing
    try:
        with transaction.atomic():
            alert = Alert.objects.create(
                node=node, key=key, severity=severity, message=message, job_name=job_name,
                opened_at=now, updated_at=now,
            )  # fmt: skip
    except IntegrityError:
        return None  # another poller opened it a moment ago: one open alert per condition
    notify(alert)
    return alert


def record_event(
    node: Node | None, key: str, message: str, job_name: str = "", severity: str = Alert.Severity.INFO
) -> Alert:
    """Something people want to know that needs no action now (the alert is resolved when made)."""
    now = timezone.now()
    alert = Alert.objects.create(
        node=node, key=key, severity=severity, message=message[:1000], job_name=job_name,
        opened_at=now, updated_at=now, resolved_at=now,
    )  # fmt: skip
    notify(alert)
    return alert


def resolve(alerts: Iterable[Alert]) -> list[Alert]:
    now = timezone.now()
    done = []
    for alert in alerts:
        if Alert.objects.filter(pk=alert.pk, resolved_at__isnull=True).update(resolved_at=now, updated_at=now):
            alert.resolved_at = now
            done.append(alert)
    return done


def sync_node_alerts(
    node: Node, conditions: Iterable[tuple[str, str, str]], open_alerts: list[Alert] | None = None
) -> list[Alert]:
    """Make the node's open monitor alerts match `conditions` ((key, severity, message) true now).

    Opens what is new, escalates what got worse, resolves monitor conditions no longer present
    (returned). Alerts owned by others (a rank that died) are left alone. `open_alerts`: the
    node's open alerts when the caller fetched them for many nodes at once; writes happen only
    when something changed.
    """
    if open_alerts is None:
        open_alerts = list(Alert.objects.filter(node=node, resolved_at__isnull=True, job_name=""))
    mine = {a.key: a for a in open_alerts if not a.job_name}
    wanted = {key: (severity, message) for key, severity, message in conditions}
    for key, (severity, message) in wanted.items():
        open_alert(node, key, severity, message, existing=mine.get(key))
    stale = [a for key, a in mine.items() if _monitor_key(key) and key not in wanted]
    return resolve(stale)


def job_finished_alert(job: Any) -> Alert:
    """INFO: a job ended (succeeded, failed or was cancelled). Called by the jobs app."""
    reason = f": {job.failure_reason}" if getattr(job, "failure_reason", "") else ""
    return record_event(None, f"job_finished:{job.name}", f"job {job.name} {job.state}{reason}", job_name=job.name)


def job_ended_alerts(job: Any) -> None:
    """A job reached its final state: its open alerts resolve, people hear how it ended, and a failure
    stays open as one CRITICAL alert (kind, rank, exit code, decisive line) on the failing node until
    the job is resumed or retried. A job refused by its pre-flight (nothing started) is shown on the job:
    what a node lacks is that node's own alert (jobs.preflight.tell_setup), not one more per refused job."""
    resolve_job_alerts(job.name)
    job_finished_alert(job)
    if job.state == "failed" and job.failure_kind != "PREFLIGHT":
        node = Node.objects.filter(name=job.failure_node).first() if job.failure_node else None
        open_alert(node, f"job_failed:{job.name}", Alert.Severity.CRITICAL, f"job {job.name} failed: "
                   f"{job.failure_reason}", job_name=job.name)  # fmt: skip


def rank_died_alert(rank: Any) -> Alert | None:
    """CRITICAL: a rank of a job exited with an error. Called by the jobs app; one per job and node."""
    code = rank.exit_text() if hasattr(rank, "exit_text") else rank.exit_code
    message = f"rank {rank.index} of job {rank.job.name} died (exit {code})"
    return open_alert(rank.node, f"rank_died:{rank.job.name}", Alert.Severity.CRITICAL, message, job_name=rank.job.name)


def resolve_job_alerts(job_name: str) -> list[Alert]:
    """Resolve a job's open alerts (once the job is dealt with: cancelled, retried, resumed)."""
    return resolve(Alert.objects.filter(job_name=job_name, resolved_at__isnull=True))


# -- delivery -------------------------------------------------------------------------------


def job_on_node(node_id: int | None) -> str | None:
    """The name of the job holding a node now, if any (a health alert says which job it may hurt)."""
    if node_id is None:
        return None
    rank = apps.get_model("jobs", "Rank")
    return rank.objects.filter(node_id=node_id, active=True).values_list("job__name", flat=True).first()


def payload(alert: Alert) -> dict[str, Any]:
    """The webhook body: `text` for Slack, `title`/`message` for ntfy-style receivers, plus every field.

    Every alert carries its node and job: a job's own alert names the job; a node's health alert
    names the job holding the node when it was sent."""
    job = alert.job_name or job_on_node(alert.node_id)
    where = alert.node.name if alert.node_id else (alert.job_name or "cluster")
    if job and alert.node_id:
        where += f" (job {job})"
    title = f"UGRO {alert.severity.upper()}: {where}"
    return {
        "text": f"{title}: {alert.message}",
        "title": title,
        "message": alert.message,
        "alert": {
            "id": alert.pk,
            "severity": alert.severity,
            "key": alert.key,
            "node": alert.node.name if alert.node_id else None,
            "job": job or None,
            "message": alert.message,
            "opened_at": alert.opened_at.isoformat(),
            "resolved_at": alert.resolved_at.isoformat() if alert.resolved_at else None,
        },
    }


def _targets() -> tuple[str, list[str], str]:
    cfg = AlertSettings.objects.filter(pk=1).first()
    webhook = (cfg.webhook_url if cfg else "") or getattr(settings, "UGRO_ALERT_WEBHOOK_URL", "")
    emails = list(getattr(settings, "UGRO_ALERT_EMAILS", []) or [])
    if cfg:
        emails += [e for e in cfg.email_list() if e not in emails]
    return webhook, emails, (cfg.min_severity if cfg else "info")


def post_webhook(url: str, body: dict[str, Any], timeout: float = WEBHOOK_TIMEOUT_S) -> int:
    """POST body as JSON; returns the HTTP status (raises on network errors and HTTP errors)."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method="POST", headers={"Content-Type": "application/json", "User-Agent": "ugro-alerts"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (the URL is the admin's own)
        return resp.status


def _deliver(body: dict[str, Any], webhook: str, emails: list[str]) -> None:
    if webhook:
        try:
            post_webhook(webhook, body)
        except Exception as exc:  # a receiver's failure is logged, never raised into monitoring
            log.warning("alert webhook %s failed: %s", webhook, exc)
    if emails:
        try:
            send_mail(body["title"], body["text"], None, emails, fail_silently=False)
        except Exception as exc:  # the same for a mail server that is down
            log.warning("alert email to %s failed: %s", ", ".join(emails), exc)


def notify(alert: Alert) -> None:
    """Deliver the alert after the surrounding transaction commits, in the background."""
    webhook, emails, minimum = _targets()
    if SEVERITY_RANK[alert.severity] < SEVERITY_RANK.get(minimum, 0) or not (webhook or emails):
        return
    body = payload(alert)
    transaction.on_commit(lambda: _senders.submit(_deliver, body, webhook, emails))


def alert_record(a: Alert) -> dict:
    return {
        "id": a.pk,
        "severity": a.severity,
        "key": a.key,
        "node": a.node.name if a.node_id else None,
        "job": a.job_name or None,
        "message": a.message,
        "open": a.is_open,
        "opened_at": a.opened_at.isoformat(),
        "resolved_at": a.resolved_at.isoformat() if a.resolved_at else None,
    }
