"""The cluster overview: master and workers with their GPUs, status and the job each one runs."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, render
from django.utils import timezone
from django.views.decorators.http import require_GET

from cluster.gpus import gpu_text
from cluster.history import MAX_BUCKETS, history
from cluster.models import GPU, Alert, ClusterSettings, HealthSample, Node
from jobs.models import Allocation, Job, Rank
from jobs.network import last_pairs

# Per-GPU reading names, as the node probe reports them (and HealthSample's gpu_* fields repeat them).
GPU_FIELDS = ("util_percent", "mem_used_mb", "mem_total_mb", "temp_c")
ALERTS_SHOWN = 20
HISTORY_HOURS = 24
MAX_HISTORY_HOURS = 24 * 30
RECENT_JOBS = 10


def latest_sample(node: Node) -> HealthSample | None:
    """The node's newest successful raw probe (raw samples carry per-GPU readings)."""
    return node.samples.filter(kind=HealthSample.Kind.RAW, ok=True).order_by("-time").first()


def gpu_readings(sample: HealthSample | None) -> list[dict[str, Any]]:
    """Per-GPU utilization, memory and temperature: the sample's `gpus` list, else its node-wide gpu_* fields."""
    if sample is None:
        return []
    rows = [
        {"index": gpu.get("index", i), **{k: gpu.get(k) for k in GPU_FIELDS}}
        for i, gpu in enumerate(sample.gpus or [])
        if isinstance(gpu, dict)
    ]
    if rows:
        return rows
    flat = {k: getattr(sample, f"gpu_{k}", None) for k in GPU_FIELDS}
    return [{"index": 0, **flat}] if any(v is not None for v in flat.values()) else []


def node_cards(nodes: list[Node]) -> list[dict[str, Any]]:
    running: dict[int, list[Rank]] = {}
    for r in Rank.objects.filter(active=True, node__in=nodes).select_related("job").order_by("job__created_at"):
        running.setdefault(r.node_id, []).append(r)
    held = {
        (a.node_id, a.gpu_index): a.job
        for a in Allocation.objects.filter(active=True, node__in=nodes).select_related("job")
    }
    gpu_rows: dict[int, list[GPU]] = {}
    for g in GPU.objects.filter(node__in=nodes):
        gpu_rows.setdefault(g.node_id, []).append(g)
    cards = []
    for node in nodes:
        sample = latest_sample(node)
        gpus = gpu_readings(sample)
        for gpu in gpus:
            used, total = gpu.get("mem_used_mb"), gpu.get("mem_total_mb")
            gpu["mem_percent"] = round(100 * used / total) if used is not None and total else None
            gpu["job"] = held.get((node.pk, gpu.get("index")))
        ranks = running.get(node.pk, [])
        cards.append(
            {
                "node": node,
                "gpu_text": gpu_text(node, gpu_rows.get(node.pk, [])),
                "ranks": ranks,
                "rank": ranks[0] if ranks else None,
                "job": ranks[0].job if ranks else None,
                # which job holds which GPU (a node without GPUs is held whole)
                "holders": [
                    {"index": g.index, "model": g.model, "job": held.get((node.pk, g.index))}
                    for g in gpu_rows.get(node.pk, [])
                ]  # fmt: skip
                or [{"index": None, "model": "", "job": held.get((node.pk, -1))}],
                "gpus": gpus,
                "score": sample.score if sample else None,
                "sampled_at": sample.time if sample else None,
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
            "alerts": Alert.objects.filter(resolved_at__isnull=True).select_related("node")[:ALERTS_SHOWN],
            "live_jobs": Job.objects.filter(state__in=Job.LIVE_STATES).count(),
            "queued_jobs": Job.objects.filter(state=Job.State.QUEUED).count(),
            "links": last_pairs(),
            "nav": "cluster",
        },
    )


@require_GET
def node_detail(request: HttpRequest, name: str) -> HttpResponse:
    """One node: its card, 24 h of GPU/CPU/RAM history, and the jobs it ran lately."""
    node = get_object_or_404(Node, name=name)
    recent = Rank.objects.filter(node=node).select_related("job").order_by("-job__created_at")[:RECENT_JOBS]
    return render(
        request,
        "cluster/node.html",
        {
            "card": node_cards([node])[0],
            "node": node,
            "recent": recent,
            "alerts": node.alerts.filter(resolved_at__isnull=True)[:ALERTS_SHOWN],
            "hours": HISTORY_HOURS,
            "nav": "cluster",
        },
    )


@require_GET
def api_node_history(request: HttpRequest, name: str) -> JsonResponse:
    """`/api/nodes/<name>/history?hours=24&buckets=N`: the node's system metrics, downsampled."""
    node = get_object_or_404(Node, name=name)
    try:
        hours = float(request.GET.get("hours", HISTORY_HOURS))
        buckets = int(request.GET.get("buckets", 400))
        if not 0 < hours <= MAX_HISTORY_HOURS or not 1 <= buckets <= MAX_BUCKETS:
            raise ValueError
    except ValueError:
        return JsonResponse(
            {"error": f"hours must be in (0, {MAX_HISTORY_HOURS}] and buckets in [1, {MAX_BUCKETS}]"}, status=400
        )
    until = timezone.now()
    return JsonResponse({"node": node.name, **history([node], until - timedelta(hours=hours), until, buckets=buckets)})
