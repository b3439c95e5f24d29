"""Metric series as JSON (downsampled in SQL) and the page comparing runs."""

from __future__ import annotations

import shlex

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, render
from django.views.decorators.http import require_GET

from jobs import report
from jobs.energy import job_energies
from jobs.models import Job
from jobs.report import attempt_marks, human_duration

from .final import final_value, format_value
from .series import metric_names, series, series_of

MAX_BUCKETS = 4000
PANELS_MAX = 50  # metrics in one /panels answer (metric_names' own limit)
COMPARE_MAX = 8
COMPARE_CHOICES = 100


@require_GET
def api_series(request: HttpRequest, pk: int) -> JsonResponse:
    """`/api/jobs/<id>/series?name=loss&buckets=N[&rank=R][&time=1]`: one metric per rank and the mean (and
    each point's time)."""
    job = get_object_or_404(Job, pk=pk)
    name = request.GET.get("name", "loss")[:100]
    try:
        buckets, rank = _buckets_and_rank(request)
    except ValueError:
        return JsonResponse({"error": "buckets and rank must be integers"}, status=400)
    data = series(job.pk, name, rank=rank, buckets=buckets, with_time=request.GET.get("time") == "1")
    return JsonResponse({**data, **_curve_facts(job)})


@require_GET
def api_panels(request: HttpRequest, pk: int) -> JsonResponse:
    """`/api/jobs/<id>/panels?buckets=N[&name=a&name=b...][&rank=R|&ranks=first][&time=1]`: several metrics
    (every one the job logged when no name is given, up to PANELS_MAX) in one answer, `{"series": {name:
    <what /series answers>}}`: what the job page asks for first, one request and one read instead of one
    per panel. `ranks=first`: each long metric's lowest rank only (marked `only_rank`), what its chart
    shows until all ranks are asked for."""
    job = get_object_or_404(Job, pk=pk)
    names = [n[:100] for n in request.GET.getlist("name")][:PANELS_MAX] or metric_names(job.pk, PANELS_MAX)
    try:
        buckets, rank = _buckets_and_rank(request)
    except ValueError:
        return JsonResponse({"error": "buckets and rank must be integers"}, status=400)
    first = request.GET.get("ranks") == "first" and rank is None
    data = series_of(
        job.pk, names, rank=rank, first_rank=first, buckets=buckets, with_time=request.GET.get("time") == "1"
    )
    return JsonResponse({"series": data, **_curve_facts(job)})


def _buckets_and_rank(request: HttpRequest) -> tuple[int, int | None]:
    buckets = min(MAX_BUCKETS, max(1, int(request.GET.get("buckets", 1000))))
    rank = int(request.GET["rank"]) if request.GET.get("rank", "") != "" else None
    return buckets, rank


def _curve_facts(job: Job) -> dict:
    """The job's id and state, and where each later attempt joined the curve (the charts mark them)."""
    return {"job": job.pk, "attempts": attempt_marks(job), "state": job.state}


def metric_facts(job: Job, name: str) -> dict:
    """Final value (rank 0's last logged), its step, and the best value seen, as the pages print them."""
    final = final_value(job.pk, name, extremes=True)
    if final is None:
        return {"last_step": None, "last": None, "best": None, "rank": None}
    return {"last_step": final.step, "last": final.text, "best": format_value(final.best), "rank": final.rank}


def config_rows(jobs: list[Job]) -> list[dict]:
    """What each job ran with, one row per setting, marked where the jobs differ."""
    ranks = {
        job.pk: list(job.ranks.select_related("node").prefetch_related("node__gpus").order_by("index")) for job in jobs
    }
    columns: dict[str, list[str]] = {
        "script": [job.script for job in jobs],
        "args": [shlex.join(str(a) for a in job.script_args or []) for job in jobs],
    }
    keys = sorted({k for job in jobs for k in (job.params or {}) if k != "extra"})
    for key in keys:
        columns[key] = ["" if (job.params or {}).get(key) is None else str(job.params[key]) for job in jobs]
    columns["nodes"] = [", ".join(r.node.name for r in ranks[job.pk]) for job in jobs]
    columns["GPUs"] = [", ".join(r.node.gpu_label for r in ranks[job.pk]) for job in jobs]
    columns["procs / node"] = [str(job.nproc_per_node or "GPU count") for job in jobs]
    columns["duration"] = [human_duration(job.duration(), empty="", sep=" ") for job in jobs]
    return [{"name": k, "values": v, "differs": len(set(v)) > 1} for k, v in columns.items()]


@require_GET
def compare(request: HttpRequest) -> HttpResponse:
    """Any metric of the chosen jobs (`?job=<id>&job=<id>&metric=loss`) on one chart, their configs side by
    side with what differs marked, and each job's final and best value of the metric."""
    chosen_ids = []
    for value in request.GET.getlist("job"):
        if value.isdigit() and int(value) not in chosen_ids:
            chosen_ids.append(int(value))
    chosen_ids = chosen_ids[:COMPARE_MAX]
    by_id = {j.pk: j for j in Job.objects.select_related("current").filter(pk__in=chosen_ids)}
    chosen = [by_id[i] for i in chosen_ids if i in by_id]
    names = sorted({n for job in chosen for n in metric_names(job.pk)}, key=chart_order)
    metric = request.GET.get("metric", "")[:100]
    if metric not in names:
        metric = names[0] if names else "loss"
    used = job_energies(chosen)
    rows = [
        {
            "job": job,
            "duration": human_duration(job.duration(), empty="", sep=" "),
            "energy": used[job.pk],
            **metric_facts(job, metric),
        }
        for job in chosen
    ]
    return render(
        request,
        "metrics/compare.html",
        {
            "rows": rows,
            "metric": metric,
            "metric_names": names,
            "config": config_rows(chosen),
            "code": report.code_rows(chosen),
            "changes": [report.code_changes(chosen[0], other) for other in chosen[1:]],
            "chosen_ids": [j.pk for j in chosen],
            "choices": Job.objects.exclude(state=Job.State.QUEUED)[:COMPARE_CHOICES],
            "nav": "compare",
        },
    )


def chart_order(name: str) -> tuple[int, str]:
    """Loss first, then other losses, then by name (as the job page orders its panels)."""
    leaf = name.rsplit("/", 1)[-1]
    return (0 if leaf == "loss" else 1 if "loss" in name else 2, name)
