"""Pushing job events to browsers: best effort through the channel layer; the DB stays the record."""

from __future__ import annotations

import json
from typing import Any

from ugro_site.publish import send


def job_group(job_id: int) -> str:
    return f"job.{job_id}"


def publish_job(job, kind: str, payload: dict[str, Any]) -> bool:
    """Send an event to the job's group and a state summary to the cluster group; never raises
    (ugro_site/publish.py: one event loop per thread, kept). False if the job's event was not sent.

    The event goes out as the JSON text the browsers get, encoded here once: the web process then relays
    the text to each viewer of the job as it is, instead of decoding nested lists from the channel layer and
    encoding them again for every viewer."""
    text = json.dumps({"kind": kind, "data": payload}, separators=(",", ":"))
    sent = send(job_group(job.pk), {"type": "job.event", "kind": kind, "text": text})
    if kind == "state":
        send("cluster", {"type": "cluster.event", "kind": "job", "data": {"job": job.name, "state": job.state}})
    return sent
