"""Celery tasks of the cluster app: thin wrappers around the health monitor (and its watch on asleep nodes)."""

from __future__ import annotations

from celery import shared_task

from . import monitor, power


@shared_task(ignore_result=True, expires=5)
def poll_health() -> None:
    """Beat fires this every 5 s; the monitor probes only the nodes whose adaptive interval is due, and the
    asleep and waking nodes get their knock (cluster/power.py)."""
    power.watch()
    monitor.poll_once()


@shared_task(ignore_result=True)
def prune_samples() -> None:
    """Raw samples for 24 h, then 1-minute aggregates for 30 days."""
    monitor.prune_samples()
