"""Celery tasks of services: thin, safe to run twice."""

from __future__ import annotations

from celery import shared_task

from .replicas import tend


@shared_task(ignore_result=True, acks_late=True)
def tend_services() -> None:
    """Place, start, check, restart and stop service replicas (serving/replicas.py)."""
    tend()
