"""Metric series as JSON (downsampled in SQL) and the page comparing runs."""

from __future__ import annotations

from django.db.models import Max, Min
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, render
from django.views.decorators.http import require_GET

from jobs.models import Job
from jobs.report import human_duration

from .models import MetricPoint
from .series import series

MAX_BUCKETS = 4000
COMPARE_MAX = 8
COMPARE_CHOICES = 100


@require_GET
def api_series(request: HttpRequest, pk: int) -> JsonResponse:
    """`/api/jobs/<id>/series?name=loss&buckets=N[&rank=R]`: one metric per rank and the mean."""
    job = get_object_or_404(Job, pk=pk)
    name = request.GET.get("name", "loss")[:100]
    try:
        buckets = min(MAX_BUCKETS, max(1, int(request.GET.get("buckets", 1000))))
        rank = int(request.GET["rank"]) if request.GET.get("rank", "") != "" else None
    except ValueError:
        return JsonResponse({"error": "buckets and rank must be integers"}, status=400)
    data = series(job.pk, name, rank=rank, buckets=buckets)
    data["job"] = job.pk
    # where each later attempt joined the curve: the chart marks them
    data["attempts"] = [
        {"attempt": n, "step": step or 0}
        for n, step in job.attempts.order_by("number").values_list("number", "from_step")
        if n > 1
    ] + ([{"attempt": job.attempt, "step": job.resume_step or 0}] if job.attempt > 1 else [])
    data["state"] = job.state
    return JsonResponse(data)


def final_loss(job: Job) -> dict:
    """Steps run, last mean loss across ranks at the last step, and the lowest loss seen."""
    points = MetricPoint.objects.filter(job=job, name="loss", superseded=False)
    agg = points.aggregate(last_step=Max("step"), best=Min("value"))
    last = None
    if agg["last_step"] is not None:
        values = list(points.filter(step=agg["last_step"]).values_list("value", flat=True))
        last = sum(values) / len(values)
    return {"last_step": agg["last_step"], "last": last, "best": agg["best"]}


@require_GET
def compare(request: HttpRequest) -> HttpResponse:
    """Overlay the loss curves of the chosen jobs (`?job=<id>&job=<id>`), with their final metrics."""
    chosen_ids = []
    for value in request.GET.getlist("job"):
        if value.isdigit() and int(value) not in chosen_ids:
            chosen_ids.append(int(value))
    chosen_ids = chosen_ids[:COMPARE_MAX]
    by_id = {j.pk: j for j in Job.objects.filter(pk__in=chosen_ids)}
    chosen = [by_id[i] for i in chosen_ids if i in by_id]
    rows = [
        {"job": job, "duration": human_duration(job.duration(), empty="", sep=" "), **final_loss(job)} for job in chosen
    ]
    return render(
        request,
        "metrics/compare.html",
        {
            "rows": rows,
            "chosen_ids": [j.pk for j in chosen],
            "choices": Job.objects.exclude(state=Job.State.QUEUED)[:COMPARE_CHOICES],
            "nav": "compare",
        },
    )
