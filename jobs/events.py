"""Pushing job events to browsers: best effort through the channel layer; the DB stays the record."""

from __future__ import annotations

import logging
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

log = logging.getLogger(__name__)


def job_group(job_id: int) -> str:
    return f"job.{job_id}"


def publish_job(job, kind: str, payload: dict[str, Any]) -> None:
    """Send an event to the job's group and a state summary to the cluster group; never raises."""
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(job_group(job.pk), {"type": "job.event", "kind": kind, "data": payload})
        if kind == "state":
            async_to_sync(layer.group_send)(
                "cluster", {"type": "cluster.event", "kind": "job", "data": {"job": job.name, "state": job.state}}
            )
    except Exception as exc:  # Redis down must not stop following: the next page load rebuilds the view
        log.debug("publish to %s failed: %s", job_group(job.pk), exc)
