"""A multi-resolution rollup of every metric, kept at ingestion, so a chart's query no longer grows with
the points stored.

For each job, metric and rank, and each level k in LEVELS (every other power of two), bucket b holds the steps
[b * 2**k, (b + 1) * 2**k): how many points, their min, max and sum, the first and last step, the value
at the last step and the first and last time. A chart of R steps wanting B buckets reads the coarsest
level k with at least B buckets (between B and 2B per rank; when k is not stored, the database groups
pairs of the stored level below), whatever the number of points stored.

Ingestion folds each batch into level LEVELS[0] buckets in Python, derives the coarser levels from
those (a bucket of level k is buckets 2b and 2b + 1 of level k - 1), and upserts them in one
statement per chunk: counts and sums add up, min/max/first/last merge. Superseded points are not in
the rollup: a resume cuts the buckets past the step it resumes from and rebuilds the one it cuts
through from the points still on the curve (`cut`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from django.db import connection

from .models import MetricPoint, MetricRollup

# Stored levels: buckets of 16 steps up to 1,048,576 steps, every other power of two (each level is one
# more row to upsert per metric and rank at every ingestion batch); a query for the level between two
# stored ones groups pairs of the finer one's rows (SPACING).
SPACING = 2
LEVELS = tuple(range(4, 21, SPACING))
TOP = LEVELS[-1]
UPSERT_CHUNK = 1000

# (job_id, name, rank, bucket) -> [n, v_min, v_max, v_sum, first_step, last_step, last_value, t_min, t_max]
Buckets = dict[tuple[int, str, int, int], list]
COLUMNS = ("job_id", "name", "level", "rank", "bucket", "n", "v_min", "v_max", "v_sum",
           "first_step", "last_step", "last_value", "t_min", "t_max")  # fmt: skip


def fold_points(rows: Iterable[Sequence], level: int = LEVELS[0]) -> Buckets:
    """Level-`level` buckets of points given as (job_id, rank, step, name, value, time, ...), in the
    order they were stored (on equal steps the later one is the last value, as the raw series has it)."""
    acc: Buckets = {}
    for job_id, rank, step, name, value, when, *_ in rows:
        step = int(step)
        key = (job_id, name, rank, step >> level)
        a = acc.get(key)
        if a is None:
            acc[key] = [1, value, value, value, step, step, value, when, when]
            continue
        a[0] += 1
        if value < a[1]:
            a[1] = value
        if value > a[2]:
            a[2] = value
        a[3] += value
        if step < a[4]:
            a[4] = step
        if step >= a[5]:
            a[5] = step
            a[6] = value
        if when < a[7]:
            a[7] = when
        if when > a[8]:
            a[8] = when
    return acc


def merge(a: list, b: list) -> None:
    """Fold bucket b into bucket a (b stored after a: on an equal last step b's value wins)."""
    a[0] += b[0]
    a[1] = min(a[1], b[1])
    a[2] = max(a[2], b[2])
    a[3] += b[3]
    a[4] = min(a[4], b[4])
    if b[5] >= a[5]:
        a[5], a[6] = b[5], b[6]
    a[7] = min(a[7], b[7])
    a[8] = max(a[8], b[8])


def coarser(buckets: Buckets, shift: int = SPACING) -> Buckets:
    """`shift` levels up: buckets b << shift .. (b + 1) << shift - 1 become bucket b."""
    up: Buckets = {}
    for (job_id, name, rank, bucket), v in buckets.items():  # children hold disjoint steps: any order
        key = (job_id, name, rank, bucket >> shift)
        a = up.get(key)
        if a is None:
            up[key] = list(v)
        else:
            merge(a, v)
    return up


def add(rows: Iterable[Sequence]) -> int:
    """Fold newly stored points (job_id, rank, step, name, value, time) into every level; the number of
    bucket rows written. Call it in the transaction that stores the points."""
    buckets = fold_points(rows)
    by_level = {}
    for level in LEVELS:
        if level != LEVELS[0]:
            buckets = coarser(buckets)
        by_level[level] = buckets
    return upsert(by_level)


def upsert(by_level: dict[int, Buckets]) -> int:
    """INSERT the buckets of every level given, merged into the rows already there (ON CONFLICT: PostgreSQL
    and SQLite alike), in one statement per UPSERT_CHUNK rows: every level of a batch is one round trip,
    not one each. Keys go in sorted order, so two writers lock shared rows in the same order."""
    items = sorted((level, *key, v) for level, buckets in by_level.items() for key, v in buckets.items())
    if not items:
        return 0
    qn = connection.ops.quote_name
    table = qn(MetricRollup._meta.db_table)
    least, greatest = ("LEAST", "GREATEST") if connection.vendor == "postgresql" else ("MIN", "MAX")
    adapt = connection.ops.adapt_datetimefield_value if connection.vendor != "postgresql" else (lambda t: t)

    def col(c: str) -> str:
        return f"{table}.{qn(c)}"

    def new(c: str) -> str:
        return f"EXCLUDED.{qn(c)}"

    sets = [
        f"n = {col('n')} + {new('n')}",
        f"v_min = {least}({col('v_min')}, {new('v_min')})",
        f"v_max = {greatest}({col('v_max')}, {new('v_max')})",
        f"v_sum = {col('v_sum')} + {new('v_sum')}",
        f"first_step = {least}({col('first_step')}, {new('first_step')})",
        f"last_step = {greatest}({col('last_step')}, {new('last_step')})",
        f"last_value = CASE WHEN {new('last_step')} >= {col('last_step')} THEN {new('last_value')}"
        f" ELSE {col('last_value')} END",
        f"t_min = {least}({col('t_min')}, {new('t_min')})",
        f"t_max = {greatest}({col('t_max')}, {new('t_max')})",
    ]
    row_sql = "(" + ", ".join(["%s"] * len(COLUMNS)) + ")"
    head = f"INSERT INTO {table} ({', '.join(qn(c) for c in COLUMNS)}) VALUES "
    tail = f" ON CONFLICT (job_id, name, level, rank, bucket) DO UPDATE SET {', '.join(sets)}"
    with connection.cursor() as cursor:
        for i in range(0, len(items), UPSERT_CHUNK):
            chunk = items[i : i + UPSERT_CHUNK]
            params: list = []
            for level, job_id, name, rank, bucket, v in chunk:
                params += [job_id, name, level, rank, bucket, *v[:7], adapt(v[7]), adapt(v[8])]
            cursor.execute(head + ", ".join([row_sql] * len(chunk)) + tail, params)
    return len(items)


def cut(job_id: int, from_step: int | None) -> None:
    """After the job's points past `from_step` were superseded (None: all of them): drop the buckets past
    it and rebuild, level by level, the one bucket per level that `from_step` cuts through."""
    rollups = MetricRollup.objects.filter(job_id=job_id)
    if from_step is None:
        rollups.delete()
        return
    first_gone = from_step + 1
    kept: Buckets = {}
    for level in LEVELS:
        start = first_gone >> level  # the bucket first_gone falls in: rebuilt from what is left of it
        rollups.filter(level=level, bucket__gte=start).delete()
        if level == LEVELS[0]:
            lo = start << level
            rows = (
                MetricPoint.objects.filter(job_id=job_id, superseded=False, step__gte=lo, step__lte=from_step)
                .order_by("id")
                .values_list("job_id", "rank", "step", "name", "value", "time")
            )
            kept = fold_points(rows, level)
        else:
            below = rollups.filter(level=level - SPACING, bucket__gte=start << SPACING)
            kept = coarser(_as_buckets(below))
        upsert({level: kept})


def rebuild(job_id: int) -> None:
    """The whole rollup of one job again, from its points on the curve (for points stored before the
    rollup existed, or written around ingestion, as the page-load benchmark does)."""
    MetricRollup.objects.filter(job_id=job_id).delete()
    if connection.vendor == "postgresql":
        _rebuild_in_sql(job_id)
        return
    rows = (
        MetricPoint.objects.filter(job_id=job_id, superseded=False)
        .order_by("id")
        .values_list("job_id", "rank", "step", "name", "value", "time")
    )
    add(rows.iterator(chunk_size=20000))


def _rebuild_in_sql(job_id: int) -> None:
    """rebuild() on PostgreSQL: each level grouped by the database (3M points: seconds, not minutes),
    the finest from the points, each coarser one from the level below; the last value is the one of
    the greatest step (of the point stored last, on a tie), as ingestion keeps it."""
    table = connection.ops.quote_name(MetricRollup._meta.db_table)
    points = connection.ops.quote_name(MetricPoint._meta.db_table)
    columns = ", ".join(COLUMNS)
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} ({columns}) SELECT job_id, name, %s, rank, step >> %s, count(*), min(value),"
            " max(value), sum(value), min(step), max(step), (array_agg(value ORDER BY step DESC, id DESC))[1],"
            f" min(time), max(time) FROM {points} WHERE job_id = %s AND NOT superseded"
            " GROUP BY job_id, name, rank, step >> %s",
            [LEVELS[0], LEVELS[0], job_id, LEVELS[0]],
        )
        for level in LEVELS[1:]:
            cursor.execute(
                f"INSERT INTO {table} ({columns}) SELECT job_id, name, %s, rank, bucket >> %s, sum(n), min(v_min),"
                " max(v_max), sum(v_sum), min(first_step), max(last_step),"
                " (array_agg(last_value ORDER BY last_step DESC))[1], min(t_min), max(t_max)"
                f" FROM {table} WHERE job_id = %s AND level = %s GROUP BY job_id, name, rank, bucket >> %s",
                [level, SPACING, job_id, level - SPACING, SPACING],
            )


def _as_buckets(rollups) -> Buckets:
    out: Buckets = {}
    for r in rollups.order_by("bucket").values_list("job_id", "name", "rank", "bucket", *COLUMNS[5:]):
        out[r[:4]] = list(r[4:])
    return out


class Bounds(NamedTuple):
    """What the rollup's coarsest level says of a whole series."""

    lo: int  # first step
    hi: int  # last step
    points: int
    last_values: dict[int, float]  # each rank's value at its last step


def bounds(job_id: int, name: str, rank: int | None = None) -> Bounds | None:
    """The series' extent from the rollup's coarsest level (a row or two per rank); None when it has none."""
    rows = MetricRollup.objects.filter(job_id=job_id, name=name, level=TOP)
    if rank is not None:
        rows = rows.filter(rank=rank)
    got = list(rows.order_by("rank", "bucket").values_list("rank", "n", "first_step", "last_step", "last_value"))
    if not got:
        return None
    return Bounds(
        min(r[2] for r in got), max(r[3] for r in got), sum(r[1] for r in got), {r[0]: r[4] for r in got}
    )  # rows come in bucket order: each rank's last row is its latest


def level_for(lo: int, hi: int, buckets: int) -> int | None:
    """The coarsest level (stored or between two stored ones) with at least `buckets` buckets over steps
    lo..hi; None if even the finest has fewer (the raw points are few enough to group directly)."""
    for level in range(TOP, LEVELS[0] - 1, -1):
        if (hi >> level) - (lo >> level) + 1 >= buckets:
            return level
    return None


def stored_level(level: int) -> int:
    """The stored level a query for `level` reads (itself, or the finer one just below it)."""
    return level - (level - LEVELS[0]) % SPACING
