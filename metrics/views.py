"""Metric series as JSON (downsampled in SQL) and the page comparing runs."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, render
from django.views.decorators.http import require_GET

from jobs.models import Job
from jobs.report import human_duration

from .final import final_loss, format_value
from .series import series

MAX_BUCKETS = 4000
COMPARE_MAX = 8
COMPARE_CHOICES = 100


@require_GET
def api_series(request: HttpRequest, pk: int) -> JsonResponse:
    """`/api/jobs/<id>/series?name=loss&buckets=N[&rank=R][&time=1]`: one metric per rank and the mean (and
    each point's time)."""
    job = get_object_or_404(Job, pk=pk)
    name = request.GET.get("name", "loss")[:100]
    try:
        buckets = min(MAX_BUCKETS, max(1, int(request.GET.get("buckets", 1000))))
        rank = int(request.GET["rank"]) if request.GET.get("rank", "") != "" else None
    except ValueError:
        return JsonResponse({"error": "buckets and rank must be integers"}, status=400)
    data = series(job.pk, name, rank=rank, buckets=buckets, with_time=request.GET.get("time") == "1")
    data["job"] = job.pk
    data["state"] = job.state
    return JsonResponse(data)


def loss_facts(job: Job) -> dict:
    """Final loss (the one definition: rank 0's last logged loss), its step, and the lowest loss seen."""
    loss = final_loss(job.pk)
    if loss is None:
        return {"last_step": None, "last": None, "best": None}
    return {"last_step": loss.step, "last": loss.text, "best": format_value(loss.best)}


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
        {"job": job, "duration": human_duration(job.duration(), empty="", sep=" "), **loss_facts(job)} for job in chosen
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
