"""One metric of one job as chart-ready series, downsampled in SQL when the history is long.

A long run logs millions of points; pulling them all into Python for every
chart refresh would be slow and memory-hungry.  Past ``RAW_FACTOR * buckets``
points the database groups the steps into equal-width buckets and returns, per
rank and bucket, only the min, max and mean of the values.

Shape of the result (JSON-ready; rank keys are strings because JSON keys are)::

    {"name": "loss",
     "ranks": {"0": {"x": [steps...], "y": [values...]}, "1": {...}},
     "mean": {"x": [steps...], "y": [values...]},
     "total_points": 200000}

With ``with_time`` it also holds ``"times": {"0": [unix seconds...]}``, aligned with each rank's ``x``
(for the wall-time and relative-time x axes).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from django.db import connections, transaction
from django.db.models import Avg, BigIntegerField, Count, ExpressionWrapper, F, Max, Min, QuerySet, Value

from metrics.models import MetricPoint

# Up to this many points per requested bucket, raw points are cheaper than grouping.
RAW_FACTOR = 4


def metric_names(job_id: int, limit: int = 50) -> list[str]:
    """Names of the job's metrics, by index seeks (a skip scan: cheap with millions of points)."""
    names: list[str] = []
    points = MetricPoint.objects.filter(job_id=job_id)
    while len(names) < limit:
        qs = points.filter(name__gt=names[-1]) if names else points
        name = qs.order_by("name").values_list("name", flat=True).first()
        if name is None:
            break
        names.append(name)
    return names


def series(
    job_id: int,
    name: str,
    *,
    rank: int | None = None,
    buckets: int = 1000,
    step_min: int | None = None,
    step_max: int | None = None,
    with_time: bool = False,
) -> dict[str, Any]:
    """The metric ``name`` of job ``job_id``, per rank and averaged across ranks.

    ``rank`` limits it to one rank; ``step_min``/``step_max`` (inclusive) to a
    window of steps.  ``total_points`` counts the stored points matching these
    filters, whatever is returned.

    Up to ``4 * buckets`` matching points, every point is returned, and
    ``mean`` is the mean across ranks at each step.  Beyond that the step range
    actually present is cut into at most ``buckets`` equal-width integer
    buckets, and each rank gets per non-empty bucket two points:
    ``(bucket_start_step, min value)`` and ``(bucket_mid_step, max value)``.
    The database knows each bucket's min and max but not the steps they were
    at; placing the min at the bucket start and the max at its middle keeps
    x monotone and draws an envelope in which every spike survives, at the cost
    of up to half a bucket of error in a spike's x.  ``mean`` then holds, per
    bucket (at its middle step), the mean across ranks of each rank's mean value
    in that bucket.
    """
    if buckets < 1:
        raise ValueError("buckets must be >= 1")
    points = MetricPoint.objects.filter(job_id=job_id, name=name, superseded=False)  # a resume's curve
    if rank is not None:
        points = points.filter(rank=rank)
    if step_min is not None:
        points = points.filter(step__gte=step_min)
    if step_max is not None:
        points = points.filter(step__lte=step_max)

    # No full count up front (a scan of every point): a LIMITed count says raw or bucketed, the
    # step range comes from the (job, name, step) index, and the buckets' counts sum to the total.
    raw_limit = RAW_FACTOR * buckets
    probe = points.order_by()[: raw_limit + 1].count()
    times: dict[int, list[float]] = {}
    if probe <= raw_limit:
        ranks, mean = _raw(points, times if with_time else None)
        total = probe
    else:
        stats = points.aggregate(lo=Min("step"), hi=Max("step"))
        ranks, mean, total = _bucketed(points, stats["lo"], stats["hi"], buckets, times if with_time else None)
    result = {"name": name, "ranks": ranks, "mean": mean, "total_points": total}
    if with_time:
        result["times"] = _by_rank_key(times)
    return result


def _raw(
    points: QuerySet[MetricPoint], times: dict[int, list[float]] | None = None
) -> tuple[dict[str, dict[str, list]], dict[str, list]]:
    """Every point, per rank in step order, and the per-step mean across ranks (and each point's time)."""
    per_rank: dict[int, dict[str, list]] = {}
    sums: dict[int, list[float]] = defaultdict(lambda: [0.0, 0])
    fields = ("rank", "step", "value", "time") if times is not None else ("rank", "step", "value")
    for row in points.order_by("step", "rank", "id").values_list(*fields):
        point_rank, step, value = row[:3]
        xy = per_rank.setdefault(point_rank, {"x": [], "y": []})
        xy["x"].append(step)
        xy["y"].append(value)
        if times is not None:
            times.setdefault(point_rank, []).append(round(row[3].timestamp(), 3))
        acc = sums[step]
        acc[0] += value
        acc[1] += 1
    # Rows came in step order, so sums' insertion order is step order.
    mean = {"x": list(sums), "y": [total / count for total, count in sums.values()]}
    return _by_rank_key(per_rank), mean


def _bucketed(
    points: QuerySet[MetricPoint], lo: int, hi: int, buckets: int, times: dict[int, list[float]] | None = None
) -> tuple[dict[str, dict[str, list]], dict[str, list], int]:
    """Per rank and equal-width step bucket, min/max (and mean) computed by the database; and the
    number of points they hold."""
    width = -(-(hi - lo + 1) // buckets)  # ceil: at most `buckets` buckets cover [lo, hi]
    # step and lo are integers, so '/' is integer division on SQLite and PostgreSQL alike;
    # step - lo >= 0, so truncation equals floor.
    bucket = ExpressionWrapper((F("step") - Value(lo)) / Value(width), output_field=BigIntegerField())
    stats = {"v_min": Min("value"), "v_max": Max("value"), "v_avg": Avg("value"), "n": Count("id")}
    if times is not None:
        stats.update(t_min=Min("time"), t_max=Max("time"))
    rows = points.annotate(bucket=bucket).values("rank", "bucket").annotate(**stats).order_by("rank", "bucket")
    per_rank: dict[int, dict[str, list]] = {}
    total = 0
    bucket_means: dict[int, list[float]] = defaultdict(list)
    half = width // 2
    for row in _grouped(rows):
        total += row["n"]
        start = lo + row["bucket"] * width
        xy = per_rank.setdefault(row["rank"], {"x": [], "y": []})
        xy["x"].append(start)
        xy["y"].append(row["v_min"])
        two = bool(half or row["v_max"] != row["v_min"])
        if two:
            xy["x"].append(start + half)
            xy["y"].append(row["v_max"])
        if times is not None:
            # the bucket's first and last times: monotone, like the steps they stand beside
            t = times.setdefault(row["rank"], [])
            t.append(round(row["t_min"].timestamp(), 3))
            if two:
                t.append(round(row["t_max"].timestamp(), 3))
        bucket_means[row["bucket"]].append(row["v_avg"])
    order = sorted(bucket_means)
    mean = {
        "x": [lo + b * width + half for b in order],
        "y": [sum(bucket_means[b]) / len(bucket_means[b]) for b in order],
    }
    return _by_rank_key(per_rank), mean, total


def _grouped(rows: QuerySet) -> list[dict[str, Any]]:
    """Evaluate the GROUP BY. PostgreSQL guesses one group per few rows for `(step - lo) / width`
    (there are only ranks x buckets), so with the default 4 MB work_mem it sorts every point,
    spilling to disk, where hashing into a few thousand groups is about twice as fast; JIT
    compilation only adds to a query this short. Both settings last for this transaction only."""
    connection = connections[rows.db]
    if connection.vendor != "postgresql":
        return list(rows)
    with transaction.atomic(using=rows.db):
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL work_mem = '64MB'")
            cursor.execute("SET LOCAL jit = off")
        return list(rows)


def _by_rank_key(per_rank: dict[int, dict[str, list]]) -> dict[str, dict[str, list]]:
    """Ranks in numeric order, keyed by their decimal string (JSON object keys are strings)."""
    return {str(r): per_rank[r] for r in sorted(per_rank)}
