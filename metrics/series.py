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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any, NamedTuple

from django.db import connection, connections, transaction
from django.db.models import Avg, BigIntegerField, Count, ExpressionWrapper, F, Max, Min, QuerySet, Value

from metrics import rollup
from metrics.models import MetricPoint, MetricRollup

# Up to this many points per requested bucket, raw points are cheaper than grouping.
RAW_FACTOR = 4
# Points past the rollup's mark folded here at most (the follower leaves about a second's worth); more, and
# the series is grouped from the raw points as if it had no rollup.
PENDING_MAX = 50_000


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
    ``mean`` is the mean across ranks at each step.  Beyond that the steps are
    cut into buckets and each rank gets per non-empty bucket two points:
    ``(first step in the bucket, min value)`` and ``(bucket middle, max value)``,
    and after its last bucket its exact last point.  The min and max steps are
    not known (the middle stands for the max: x stays monotone and every spike
    survives, up to half a bucket off in x).  ``mean`` then holds, per bucket (at
    its middle step), the mean across ranks of each rank's mean in that bucket.

    The whole series (no step window) is read from the rollup (metrics/rollup.py):
    its coarsest level with at least ``buckets`` buckets of 2**k steps, between
    ``buckets`` and twice that many, whatever the points stored. The points stored
    since the rollup last caught up (past the job's mark: a second's worth while
    the follower runs) are folded in here, so the answer holds every stored point;
    the rollup, its mark and those points are read in one snapshot. A window, a
    series short enough for the finest level, or one with no rollup (or more
    points past the mark than PENDING_MAX) is grouped from the raw points in SQL
    (``buckets`` equal-width buckets from the window's first step).
    """
    if buckets < 1:
        raise ValueError("buckets must be >= 1")
    if step_min is None and step_max is None:
        return series_of(job_id, [name], rank=rank, buckets=buckets, with_time=with_time)[name]
    points = _points(job_id, name, rank)
    if step_min is not None:
        points = points.filter(step__gte=step_min)
    if step_max is not None:
        points = points.filter(step__lte=step_max)
    return _from_points(name, points, None, buckets, with_time)


def series_of(
    job_id: int,
    names: Sequence[str],
    *,
    rank: int | None = None,
    first_rank: bool = False,
    buckets: int = 1000,
    with_time: bool = False,
) -> dict[str, dict[str, Any]]:
    """`series` of several whole metrics of a job (a page's panels), as one read: one snapshot, one
    statement for their bounds, one for the points past the mark, and one per rollup level for their
    buckets (read with a plain cursor: no per-row converters on the page's hot path). A name with no
    rollup, or short enough for the raw points, is read as `series` reads it, in the same snapshot.

    ``first_rank``: of each metric read from the rollup, only the lowest rank that logged it (what a chart
    shows until every rank is asked for: a third of the rows and bytes with three ranks), marked
    ``"only_rank": R`` in its answer; ``total_points`` still counts every rank's points. Short series come
    whole (every rank: they cost little)."""
    if buckets < 1:
        raise ValueError("buckets must be >= 1")
    names = list(dict.fromkeys(names))
    out: dict[str, dict[str, Any]] = {}
    by_level: dict[int, list[tuple[str, rollup.Bounds]]] = {}
    with _one_snapshot():
        known = rollup.bounds_of(job_id, names, rank) if names else {}
        pending = _past_mark(job_id, known, rank)
        for name in names:
            bounds = known.get(name) if pending is not None else None  # None: the rollup is far behind
            if bounds is not None and name in pending:
                bounds = rollup.with_pending(bounds, pending[name])
            level = rollup.level_for(bounds.lo, bounds.hi, buckets) if bounds is not None else None
            if bounds is None or level is None or bounds.points <= RAW_FACTOR * buckets:
                out[name] = _from_points(name, _points(job_id, name, rank), bounds, buckets, with_time)
                if not out[name]["total_points"]:
                    timed = _by_time(name, _points(job_id, name, rank, stepless=True), buckets)
                    if timed["total_points"]:
                        out[name] = timed
            else:
                by_level.setdefault(level, []).append((name, bounds))
        for level, group in by_level.items():
            only = {name: min(bounds.last) for name, bounds in group} if first_rank else None
            rows = _rollup_rows(job_id, [name for name, _ in group], rank, level, with_time, only)
            for name, bounds in group:
                times: dict[int, list[float]] | None = {} if with_time else None
                buckets_of = rows.get(name, [])
                if pending and name in pending:
                    more = rollup.coarser(pending[name], level - rollup.LEVELS[0])
                    if only is not None:
                        more = {key: v for key, v in more.items() if key[2] == only[name]}
                    buckets_of = _with_pending(buckets_of, more, with_time)
                last_values = {r: value for r, (_, value) in bounds.last.items()}
                ranks, mean, _ = _envelope(buckets_of, 0, 1 << level, last_values, times)
                out[name] = _result(name, ranks, mean, bounds.points, times)
                if only is not None:
                    out[name]["only_rank"] = only[name]
    return {name: out[name] for name in names}


def _points(job_id: int, name: str, rank: int | None, *, stepless: bool = False) -> QuerySet[MetricPoint]:
    """A series' points at steps (stepless: its points that have only a time)."""
    points = MetricPoint.objects.filter(job_id=job_id, name=name, superseded=False, step__isnull=stepless)
    return points if rank is None else points.filter(rank=rank)


def _by_time(name: str, points: QuerySet[MetricPoint], buckets: int) -> dict[str, Any]:
    """A series whose points have no step (a Lightning bar's values), placed by time: x is each point's
    time (unix seconds), as `times` is; the latest RAW_FACTOR * buckets points of each rank. Marked
    "by_time" (a chart draws it on a time axis)."""
    per_rank: dict[int, dict[str, list]] = {}
    times: dict[int, list[float]] = {}
    total = 0
    for point_rank in points.order_by().values_list("rank", flat=True).distinct():
        rows = list(points.filter(rank=point_rank).order_by("-id").values_list("time", "value")[: RAW_FACTOR * buckets])
        rows.reverse()
        stamps = [round(t.timestamp(), 3) for t, _ in rows]
        per_rank[point_rank] = {"x": stamps, "y": [v for _, v in rows]}
        times[point_rank] = stamps
        total += len(rows)
    result = _result(name, _by_rank_key(per_rank), {"x": [], "y": []}, total, times)
    result["by_time"] = True
    return result


def _result(name: str, ranks: dict, mean: dict, total: int, times: dict[int, list[float]] | None) -> dict[str, Any]:
    result = {"name": name, "ranks": ranks, "mean": mean, "total_points": total}
    if times is not None:
        result["times"] = _by_rank_key(times)
    return result


def _past_mark(job_id: int, known: dict[str, rollup.Bounds], rank: int | None) -> dict[str, rollup.Buckets] | None:
    """The points of these series stored since the rollup last caught up, as finest-level buckets per name;
    None when there are more than PENDING_MAX (the rollup is far behind: read the raw points)."""
    past = next((b.past_mark for b in known.values() if b.past_mark is not None), None)
    if past is None:
        return {}
    rows = MetricPoint.objects.filter(
        job_id=job_id, name__in=list(known), superseded=False, id__gte=past[0], id__lte=past[1], step__isnull=False
    )
    if rank is not None:
        rows = rows.filter(rank=rank)
    got = list(rows.order_by("id").values_list("job_id", "rank", "step", "name", "value", "time")[: PENDING_MAX + 1])
    if len(got) > PENDING_MAX:
        return None
    by_name: dict[str, rollup.Buckets] = {}
    for key, acc in rollup.fold_points(got).items():
        by_name.setdefault(key[1], {})[key] = acc
    return by_name


def _from_points(
    name: str, points: QuerySet[MetricPoint], known: rollup.Bounds | None, buckets: int, with_time: bool
) -> dict[str, Any]:
    """A series from its raw points: every point when few, else grouped in SQL. `known`: its bounds from the
    rollup, if it has one. Without, no full count up front (a scan of every point): a LIMITed count says
    raw or bucketed, the step range comes from the (job, name, step) index, and the buckets' counts sum to
    the total."""
    times: dict[int, list[float]] | None = {} if with_time else None
    raw_limit = RAW_FACTOR * buckets
    if known is not None:
        lo, hi, total = known.lo, known.hi, known.points
    else:
        total = points.order_by()[: raw_limit + 1].count()
        lo = hi = None
    if total <= raw_limit:
        ranks, mean = _raw(points, times)
    else:
        if lo is None:
            stats = points.aggregate(lo=Min("step"), hi=Max("step"))
            lo, hi = stats["lo"], stats["hi"]
        ranks, mean, total = _bucketed(points, lo, -(-(hi - lo + 1) // buckets), times)
    return _result(name, ranks, mean, total, times)


@contextmanager
def _one_snapshot() -> Iterator[None]:
    """The rollup, its mark and the points past the mark read as of one moment: read apart, a catch_up
    committing in between would count its points twice (or not at all): a REPEATABLE READ transaction
    (read-only: it can never fail to serialize). Inside a caller's transaction, that transaction's
    isolation holds (it cannot be changed there)."""
    if connection.in_atomic_block:
        yield
        return
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        yield


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


class Bucket(NamedTuple):
    """What a chart draws of one rank's bucket of steps, from the raw points or the rollup."""

    rank: int
    index: int  # the bucket covers steps [origin + index * width, origin + (index + 1) * width)
    n: int
    v_min: float
    v_max: float
    v_total: float  # the sum of the values
    first_step: int
    last_step: int
    last_value: float | None  # the value at last_step; None where the raw grouping does not know it
    t_min: datetime | None  # None where the times were not asked for
    t_max: datetime | None


def _rollup_rows(
    job_id: int,
    names: list[str],
    rank: int | None,
    level: int,
    with_time: bool,
    only: dict[str, int] | None = None,
) -> dict[str, list[tuple]]:
    """Each name's buckets of 2**level steps (of its rank in `only`, if given), as rows in Bucket's field
    order sorted by rank and index: one indexed range read of the stored level, grouped by pairs in the
    database when `level` lies between two stored ones (the last value then only counts in each rank's
    final bucket: it comes from the bounds). A plain cursor: Django's per-row converters cost more than
    the query here."""
    stored = rollup.stored_level(level)
    table = connection.ops.quote_name(MetricRollup._meta.db_table)
    params: list = [job_id, stored]
    if only is None:
        where = f"job_id = %s AND level = %s AND name IN ({', '.join(['%s'] * len(names))})"
        params += names
    else:
        where = f"job_id = %s AND level = %s AND (name, rank) IN (VALUES {', '.join(['(%s, %s)'] * len(names))})"
        params += [value for name in names for value in (name, only[name])]
    if rank is not None:
        where += " AND rank = %s"
        params.append(rank)
    times = ", t_min, t_max" if with_time else ""  # thousands of timestamps to decode: only for a time axis
    if stored == level:
        sql = (
            f"SELECT name, rank, bucket, n, v_min, v_max, v_sum, first_step, last_step, last_value{times}"
            f" FROM {table} WHERE {where} ORDER BY name, rank, bucket"
        )
    else:
        shift = level - stored
        times = ", MIN(t_min), MAX(t_max)" if with_time else ""
        sql = (
            f"SELECT name, rank, bucket >> {shift} AS b, CAST(SUM(n) AS bigint), MIN(v_min), MAX(v_max),"
            f" SUM(v_sum), MIN(first_step), MAX(last_step), NULL{times}"
            f" FROM {table} WHERE {where} GROUP BY name, rank, b ORDER BY name, rank, b"
        )
    by_name: dict[str, list[tuple]] = {}
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        rows = cursor.fetchall()
    for row in rows:
        by_name.setdefault(row[0], []).append(row[1:])
    return by_name


def _with_pending(buckets: list[tuple], pending: rollup.Buckets, with_times: bool) -> list[tuple]:
    """Rows in Bucket's field order (sorted by rank and index) with the buckets of the points past the mark
    merged in, by the rollup's rules (they were stored later: on an equal last step their value wins)."""
    at = {(b[0], b[1]): i for i, b in enumerate(buckets)}
    merged = list(buckets)
    added = False
    for (_, _, rank, index), v in pending.items():
        extra = (v[7], v[8]) if with_times else ()
        i = at.get((rank, index))
        if i is None:
            merged.append((rank, index, *v[:7], *extra))
            added = True
            continue
        b = merged[i]
        # the row's fields after (rank, index) are a rollup bucket's; without times, the pending one's stand in
        acc = [*b[2:9], *(b[9:11] if with_times else v[7:9])]
        rollup.merge(acc, v)
        merged[i] = (rank, index, *acc[:7], *(acc[7:9] if with_times else ()))
    if added:
        merged.sort(key=lambda b: (b[0], b[1]))
    return merged


def _bucketed(
    points: QuerySet[MetricPoint], origin: int, width: int, times: dict[int, list[float]] | None = None
) -> tuple[dict[str, dict[str, list]], dict[str, list], int]:
    """Per rank and step bucket [origin + i * width, origin + (i + 1) * width), min/max/mean computed by
    the database from the raw points; and the number of points they hold."""
    # step and origin are integers, so '/' is integer division; buckets start at or below the first step,
    # so step - origin >= 0 and truncation equals floor.
    bucket = ExpressionWrapper((F("step") - Value(origin)) / Value(width), output_field=BigIntegerField())
    stats = {
        "v_min": Min("value"), "v_max": Max("value"), "v_avg": Avg("value"), "n": Count("id"),
        "s_min": Min("step"), "s_max": Max("step"),
    }  # fmt: skip
    if times is not None:
        stats.update(t_min=Min("time"), t_max=Max("time"))
    rows = points.annotate(bucket=bucket).values("rank", "bucket").annotate(**stats).order_by("rank", "bucket")
    buckets = [
        Bucket(r["rank"], r["bucket"], r["n"], r["v_min"], r["v_max"], r["v_avg"] * r["n"], r["s_min"], r["s_max"],
               None, r.get("t_min"), r.get("t_max"))
        for r in _grouped(rows)
    ]  # fmt: skip
    # each rank's exact last point: a short backward scan of the (job, name, step) index per rank
    last_values = {
        r: points.filter(rank=r).order_by("-step", "-id").values_list("value", flat=True).first()
        for r in sorted({b.rank for b in buckets})
    }
    return _envelope(buckets, origin, width, last_values, times)


def _envelope(
    buckets: list[Bucket] | list[tuple],
    origin: int,
    width: int,
    last_values: dict[int, float | None],
    times: dict[int, list[float]] | None,
) -> tuple[dict[str, dict[str, list]], dict[str, list], int]:
    """Buckets (or tuples in their field order; sorted by rank, then index) as each rank's min/max
    envelope ending on its exact last point, the mean across ranks per bucket, and the points they hold."""
    per_rank: dict[int, dict[str, list]] = {}
    total = 0
    bucket_means: dict[int, list[float]] = defaultdict(list)
    half = width // 2
    count = len(buckets)
    for i, b in enumerate(buckets):
        rank, index, n, v_min, v_max, v_total, first, last_step, last_value = b[:9]
        total += n
        final = i + 1 == count or buckets[i + 1][0] != rank
        xy = per_rank.get(rank)
        if xy is None:
            xy = per_rank[rank] = {"x": [], "y": []}
        xs, ys = xy["x"], xy["y"]
        t = times.setdefault(rank, []) if times is not None else None
        xs.append(first)
        ys.append(v_min)
        if t is not None:
            # the bucket's first and last times: monotone, like the steps they stand beside
            t.append(round(b[9].timestamp(), 3))
        # the max at the bucket's middle, inside its steps, and before the last point of a final bucket
        room = last_step - 1 if final else last_step
        mid = origin + index * width + half
        mid = first if mid < first else mid
        mid = mid if mid <= room else max(room, first)
        if mid > first or v_max != v_min:
            xs.append(mid)
            ys.append(v_max)
            if t is not None:
                t.append(round(b[10].timestamp(), 3))
        if final and last_step > xs[-1]:
            last = last_value if last_value is not None else last_values.get(rank)
            if last is not None:
                xs.append(last_step)
                ys.append(last)
                if t is not None:
                    t.append(round(b[10].timestamp(), 3))
        bucket_means[index].append(v_total / n)
    order = sorted(bucket_means)
    mean = {
        "x": [origin + k * width + half for k in order],
        "y": [sum(bucket_means[k]) / len(bucket_means[k]) for k in order],
    }
    return _by_rank_key(per_rank), mean, total


def _grouped(rows: QuerySet) -> list[dict[str, Any]]:
    """Evaluate the GROUP BY. PostgreSQL guesses one group per few rows for `(step - lo) / width`
    (there are only ranks x buckets), so with the default 4 MB work_mem it sorts every point,
    spilling to disk, where hashing into a few thousand groups is about twice as fast; JIT
    compilation only adds to a query this short. Both settings last for this transaction only."""
    connection = connections[rows.db]
    with transaction.atomic(using=rows.db):
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL work_mem = '64MB'")
            cursor.execute("SET LOCAL jit = off")
        return list(rows)


def _by_rank_key(per_rank: dict[int, dict[str, list]]) -> dict[str, dict[str, list]]:
    """Ranks in numeric order, keyed by their decimal string (JSON object keys are strings)."""
    return {str(r): per_rank[r] for r in sorted(per_rank)}
