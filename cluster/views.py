"""The cluster overview: master and workers with their GPUs, status and the job each one runs."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from jobs.models import Job, Rank

from .models import ClusterSettings, Node

# Names the health samples may use for their GPU readings (as the node probe reports them).
GPU_FIELDS = ("util_percent", "mem_used_mb", "mem_total_mb", "temp_c")


def latest_sample(node: Node) -> Any | None:
    """The node's newest health sample, if the health models provide one (they are optional here)."""
    for attr in ("latest_sample", "last_sample"):
        sample = getattr(node, attr, None)
        if callable(sample):
            sample = sample()
        if sample is not None:
            return sample
    for related in ("samples", "health_samples"):
        manager = getattr(node, related, None)
        if manager is not None and hasattr(manager, "order_by"):
            field = "time" if any(f.name == "time" for f in manager.model._meta.fields) else "pk"
            return manager.order_by(f"-{field}").first()
    return None


def gpu_readings(sample: Any | None) -> list[dict[str, Any]]:
    """Per-GPU utilization, memory and temperature from a sample: a `gpus` list, or flat gpu_* fields."""
    if sample is None:
        return []
    gpus = getattr(sample, "gpus", None)
    if isinstance(gpus, list):
        rows = []
        for i, gpu in enumerate(gpus):
            if isinstance(gpu, dict):
                rows.append({"index": gpu.get("index", i), **{k: gpu.get(k) for k in GPU_FIELDS}})
        return rows
    flat = {k: getattr(sample, f"gpu_{k}", getattr(sample, k, None)) for k in GPU_FIELDS}
    return [{"index": 0, **flat}] if any(v is not None for v in flat.values()) else []


def node_cards(nodes: list[Node]) -> list[dict[str, Any]]:
    running = {
        r.node_id: r
        for r in Rank.objects.filter(active=True, node__in=nodes).select_related("job").order_by("job__created_at")
    }
    cards = []
    for node in nodes:
        sample = latest_sample(node)
        gpus = gpu_readings(sample)
        for gpu in gpus:
            used, total = gpu.get("mem_used_mb"), gpu.get("mem_total_mb")
            gpu["mem_percent"] = round(100 * used / total) if used is not None and total else None
        rank = running.get(node.pk)
        cards.append(
            {
                "node": node,
                "rank": rank,
                "job": rank.job if rank else None,
                "gpus": gpus,
                "score": getattr(sample, "score", None) if sample is not None else None,
                "sampled_at": getattr(sample, "time", None) if sample is not None else None,
            }
        )
    return cards


@require_GET
def overview(request: HttpRequest) -> HttpResponse:
    nodes = list(Node.objects.all())
    cards = node_cards(nodes)
    return render(
        request,
        "cluster/overview.html",
        {
            "cluster": ClusterSettings.load(),
            "masters": [c for c in cards if c["node"].role == Node.Role.MASTER],
            "workers": [c for c in cards if c["node"].role != Node.Role.MASTER],
            "node_count": len(nodes),
            "live_jobs": Job.objects.filter(state__in=Job.LIVE_STATES).count(),
            "queued_jobs": Job.objects.filter(state=Job.State.QUEUED).count(),
            "nav": "cluster",
        },
    )
