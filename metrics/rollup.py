"""A multi-resolution rollup of every metric, kept beside the points, so a chart's query does not grow with
the points stored.

For each job, metric and rank, and each level k in LEVELS (every other power of two), bucket b holds the steps
[b * 2**k, (b + 1) * 2**k): how many points, their min, max and sum, the first and last step, the value
at the last step and the first and last time. A chart of R steps wanting B buckets reads the coarsest
level k with at least B buckets (between B and 2B per rank; when k is not stored, the database groups
pairs of the stored level below), whatever the number of points stored.

The follower stores points (COPY) in its lease's transaction and leaves the rollup alone; about once a
second, in a short transaction of its own, catch_up() folds the job's points stored since its RollupMark
into every level: counts and sums add up, min/max/first/last merge. The charts fold the few points past
the mark themselves (metrics/series.py), so they never lag. Superseded points are not in the rollup: a
resume cuts the buckets past the step it resumes from and rebuilds the one it cuts through from the
points still on the curve (`cut`).

Why one id per job is a safe mark: every writer of a job's points holds the job's row lock from before
its first insert until it commits (the follower's renew(), metric files' guard, which is the same
renew()), and point ids come from one sequence. A writer draws its ids only once it holds the lock, so
after the previous writer of the job committed: within a job, an id committed later is greater than
every id committed before it. When catch_up has read the job's points up to id M, every point of the job
it did not see (uncommitted then, or stored since) has an id above M; setting the mark to M neither
skips a point nor folds one twice. Every writer of the rollup (catch_up, cut, rebuild) locks the mark
row first, so they take turns.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from django.db import connection, transaction
from django.db.models import Max
from django.db.models.expressions import RawSQL

from jobs.models import Job

from .models import MetricPoint, MetricRollup, RollupMark

# Stored levels: buckets of 16 steps up to 1,048,576 steps, every other power of two (each level is one
# more row to upsert per metric and rank at every ingestion batch); a query for the level between two
# stored ones groups pairs of the finer one's rows (SPACING).
SPACING = 2
LEVELS = tuple(range(4, 21, SPACING))
TOP = LEVELS[-1]
UPSERT_CHUNK = 1000
INT8_MAX = 2**63 - 1

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


def fold_into_levels(rows: Iterable[Sequence]) -> dict[int, Buckets]:
    """Points (job_id, rank, step, name, value, time), in the order they were stored, as the buckets of every
    level: the finest folded from the points, each coarser one from the level below."""
    buckets = fold_points(rows)
    by_level = {}
    for level in LEVELS:
        if level != LEVELS[0]:
            buckets = coarser(buckets)
        by_level[level] = buckets
    return by_level


def _on_conflict() -> str:
    """The merge of a new bucket into the stored one, the new one's points stored later (on an equal last
    step its value wins)."""
    qn = connection.ops.quote_name
    table = qn(MetricRollup._meta.db_table)

    def col(c: str) -> str:
        return f"{table}.{qn(c)}"

    def new(c: str) -> str:
        return f"EXCLUDED.{qn(c)}"

    sets = [
        f"n = {col('n')} + {new('n')}",
        f"v_min = LEAST({col('v_min')}, {new('v_min')})",
        f"v_max = GREATEST({col('v_max')}, {new('v_max')})",
        f"v_sum = {col('v_sum')} + {new('v_sum')}",
        f"first_step = LEAST({col('first_step')}, {new('first_step')})",
        f"last_step = GREATEST({col('last_step')}, {new('last_step')})",
        f"last_value = CASE WHEN {new('last_step')} >= {col('last_step')} THEN {new('last_value')}"
        f" ELSE {col('last_value')} END",
        f"t_min = LEAST({col('t_min')}, {new('t_min')})",
        f"t_max = GREATEST({col('t_max')}, {new('t_max')})",
    ]
    return f" ON CONFLICT (job_id, name, level, rank, bucket) DO UPDATE SET {', '.join(sets)}"


def upsert(by_level: dict[int, Buckets]) -> int:
    """INSERT the buckets of every level given, merged into the rows already there (ON CONFLICT), in one
    statement per UPSERT_CHUNK rows: every level of a batch is one round trip, not one each. Keys go in
    sorted order, so two writers lock shared rows in the same order."""
    items = sorted((level, *key, v) for level, buckets in by_level.items() for key, v in buckets.items())
    if not items:
        return 0
    qn = connection.ops.quote_name
    table = qn(MetricRollup._meta.db_table)
    row_sql = "(" + ", ".join(["%s"] * len(COLUMNS)) + ")"
    head = f"INSERT INTO {table} ({', '.join(qn(c) for c in COLUMNS)}) VALUES "
    tail = _on_conflict()
    with connection.cursor() as cursor:
        for i in range(0, len(items), UPSERT_CHUNK):
            chunk = items[i : i + UPSERT_CHUNK]
            params: list = []
            for level, job_id, name, rank, bucket, v in chunk:
                params += [job_id, name, level, rank, bucket, *v[:9]]
            cursor.execute(head + ", ".join([row_sql] * len(chunk)) + tail, params)
    return len(items)


def catch_up(job_id: int) -> int:
    """Fold the job's points stored since its mark (and not superseded) into every level and move the mark
    past them, in one short transaction of its own; the number of points folded (0 when none were new).

    The follower calls it about once a second per job, after its lease's transaction committed."""
    with transaction.atomic():
        # derived data: a crash that loses this commit loses the mark's move with it, and the next
        # catch_up folds the same points again
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL synchronous_commit TO OFF")
        upto = _lock_mark(job_id)
        return 0 if upto is None else _fold_pending(job_id, upto)


def _lock_mark(job_id: int) -> int | None:
    """Lock the job's mark (made at 0 if it has none) until the transaction ends; its upto, or None if the
    job is gone. The job's row is key-share locked first: the rollup's and the mark's foreign keys take
    that lock when a row is inserted, and requeue() holds the job's row FOR UPDATE while it calls cut(),
    which locks the mark: taking the job's lock after the mark's would deadlock with it."""
    jobs = connection.ops.quote_name(Job._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT 1 FROM {jobs} WHERE id = %s FOR KEY SHARE", [job_id])
        if cursor.fetchone() is None:
            return None
    marks = RollupMark.objects.select_for_update().filter(job_id=job_id)
    upto = marks.values_list("upto", flat=True).first()
    if upto is None:
        RollupMark.objects.bulk_create([RollupMark(job_id=job_id, upto=0)], ignore_conflicts=True)
        upto = marks.values_list("upto", flat=True).get()  # 0, or what a catch_up racing this one left
    return upto


def _fold_pending(job_id: int, upto: int) -> int:
    """catch_up's fold, with the job's mark locked at `upto`: the points past it into every level, and the
    mark moved to the last of them (superseded ones included: they never come back on the curve)."""
    first, first_params = past_mark_query(job_id, upto)
    last, last_params = past_mark_query(job_id, upto, last=True)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT ({first}), ({last})", first_params + last_params)
        span = cursor.fetchone()
    if span[0] is None:
        return 0
    folded = _fold_in_sql(job_id, *span)
    RollupMark.objects.filter(job_id=job_id).update(upto=span[1])
    return folded


def past_mark_query(job_id: int, upto: int | None = None, last: bool = False) -> tuple[str, list]:
    """SQL and parameters for the first (or last) id of a job's points past the mark `upto` (None: the one
    stored, 0 when the job has none). A row comparison in (job, id) order, LIMIT 1: only the (job, id)
    index serves it, one index descent. Asked as `job_id = J AND id > U`, PostgreSQL walked the primary
    key from U through every later point of every job (its statistics cannot tell that the ids of a job
    quiet for a while lie far apart); with both bounds as row comparisons, a backward scan went on
    through every point of the job."""
    points = connection.ops.quote_name(MetricPoint._meta.db_table)
    marks = connection.ops.quote_name(RollupMark._meta.db_table)
    mark = f"COALESCE(%s, (SELECT MAX(upto) FROM {marks} WHERE job_id = %s), 0)"
    if last:  # the job's last point (or the one before the job's, if it has none): past the mark?
        return (
            f"SELECT id FROM (SELECT job_id, id FROM {points} WHERE (job_id, id) <= (%s, {INT8_MAX})"
            f" ORDER BY job_id DESC, id DESC LIMIT 1) AS p WHERE job_id = %s AND id > {mark}",
            [job_id, job_id, upto, job_id],
        )
    return (  # the point after the mark, if it is the job's
        f"SELECT id FROM (SELECT job_id, id FROM {points} WHERE (job_id, id) > (%s, {mark})"
        " ORDER BY job_id, id LIMIT 1) AS p WHERE job_id = %s",
        [job_id, upto, job_id, job_id],
    )


def _fold_in_sql(job_id: int, first: int, last: int) -> int:
    """The fold as one statement, grouped by the database: the job's points with ids first..last into
    finest-level buckets (the last value is the one of the greatest step, of the point stored last on a
    tie), those crossed with every level (a row per point and level sorted spilled to disk at a second's
    points), and the result merged into the stored rows by upsert()'s rules, in upsert()'s key order
    (names by code point, as Python sorts them). The points folded (superseded ones, and points with no
    step, which charts place by time, are skipped)."""
    qn = connection.ops.quote_name
    table = qn(MetricRollup._meta.db_table)
    points = qn(MetricPoint._meta.db_table)
    levels = ", ".join(str(level) for level in LEVELS)
    up = f"bucket >> (level - {LEVELS[0]})"
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL work_mem = '64MB'")  # sorts in memory; this transaction only
        cursor.execute(
            f"WITH pending AS MATERIALIZED (SELECT id, name, rank, step, value, time FROM {points}"
            " WHERE job_id = %s AND id >= %s AND id <= %s AND NOT superseded AND step IS NOT NULL),"
            f" fine AS (SELECT name, rank, step >> {LEVELS[0]} AS bucket, count(*) AS n, min(value) AS v_min,"
            " max(value) AS v_max, sum(value) AS v_sum, min(step) AS first_step, max(step) AS last_step,"
            " (array_agg(value ORDER BY step DESC, id DESC))[1] AS last_value, min(time) AS t_min,"
            f" max(time) AS t_max FROM pending GROUP BY name, rank, step >> {LEVELS[0]}),"
            f" folded AS (INSERT INTO {table} ({', '.join(qn(c) for c in COLUMNS)})"
            f" SELECT %s, name, level, rank, {up}, sum(n), min(v_min), max(v_max), sum(v_sum), min(first_step),"
            " max(last_step), (array_agg(last_value ORDER BY last_step DESC))[1], min(t_min), max(t_max)"
            f" FROM fine CROSS JOIN unnest(ARRAY[{levels}]) AS level GROUP BY level, name, rank, {up}"
            f' ORDER BY level, name COLLATE "C", rank, {up}{_on_conflict()})'
            " SELECT count(*) FROM pending",
            [job_id, first, last, job_id],
        )
        return cursor.fetchone()[0]


def cut(job_id: int, from_step: int | None) -> None:
    """After the job's points past `from_step` were superseded (None: all of them): drop the buckets past
    it and rebuild, level by level, the one bucket per level that `from_step` cuts through. The points past
    the mark are folded first, under the same lock, so none is lost and none counted twice."""
    with transaction.atomic():
        upto = _lock_mark(job_id)
        if upto is None:
            return
        _fold_pending(job_id, upto)
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
    """The whole rollup of one job again, from its points on the curve, and its mark set to its last point
    (for points written around ingestion, as the page-load benchmark does)."""
    with transaction.atomic():
        upto = _lock_mark(job_id)
        if upto is None:
            return
        top = MetricPoint.objects.filter(job_id=job_id).aggregate(top=Max("id"))["top"]
        build(job_id, top)
        if top is not None:
            RollupMark.objects.filter(job_id=job_id).update(upto=top)


def build(job_id: int, upto: int | None) -> None:
    """The job's rollup rows from nothing, from its points on the curve with id <= upto (None: all of
    them); its mark is left alone (the caller's, or made later: the migration that made marks uses it)."""
    MetricRollup.objects.filter(job_id=job_id).delete()
    _rebuild_in_sql(job_id, upto)


def _rebuild_in_sql(job_id: int, upto: int | None) -> None:
    """build()'s rows: each level grouped by the database (3M points: seconds, not minutes),
    the finest from the points, each coarser one from the level below; the last value is the one of
    the greatest step (of the point stored last, on a tie), as catch_up keeps it."""
    table = connection.ops.quote_name(MetricRollup._meta.db_table)
    points = connection.ops.quote_name(MetricPoint._meta.db_table)
    columns = ", ".join(COLUMNS)
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} ({columns}) SELECT job_id, name, %s, rank, step >> %s, count(*), min(value),"
            " max(value), sum(value), min(step), max(step), (array_agg(value ORDER BY step DESC, id DESC))[1],"
            f" min(time), max(time) FROM {points} WHERE job_id = %s AND NOT superseded"
            + (" AND id <= %s" if upto is not None else "")
            + " GROUP BY job_id, name, rank, step >> %s",
            [LEVELS[0], LEVELS[0], job_id, *([upto] if upto is not None else []), LEVELS[0]],
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
    """What the rollup's coarsest level says of a whole series (and the points past its mark, once added)."""

    lo: int  # first step
    hi: int  # last step
    points: int
    last: dict[int, tuple[int, float]]  # each rank's last step and its value there
    past_mark: tuple[int, int] | None  # the first and last id of the job's points the rows do not hold


def bounds(job_id: int, name: str, rank: int | None = None) -> Bounds | None:
    """The series' extent from the rollup's coarsest level (a row or two per rank), and where the job's
    points past its mark lie, read in one statement (one snapshot); None when the rollup has no row of the
    series."""
    return bounds_of(job_id, [name], rank).get(name)


def bounds_of(job_id: int, names: Sequence[str], rank: int | None = None) -> dict[str, Bounds]:
    """`bounds` of several series of a job in one statement: the names the rollup holds rows of."""
    rows = MetricRollup.objects.filter(job_id=job_id, name__in=list(names), level=TOP)
    if rank is not None:
        rows = rows.filter(rank=rank)
    past = {"first_past": RawSQL(*past_mark_query(job_id)), "last_past": RawSQL(*past_mark_query(job_id, last=True))}
    by_name: dict[str, list[tuple]] = {}
    for row in (
        rows.annotate(**past)
        .order_by("name", "rank", "bucket")
        .values_list("name", "rank", "n", "first_step", "last_step", "last_value", "first_past", "last_past")
    ):
        by_name.setdefault(row[0], []).append(row[1:])
    return {
        name: Bounds(
            min(r[2] for r in got),
            max(r[3] for r in got),
            sum(r[1] for r in got),
            {r[0]: (r[3], r[4]) for r in got},
            got[0][5:7] if got[0][5] is not None else None,
        )  # fmt: skip  # rows come in bucket order: each rank's last row is its latest
        for name, got in by_name.items()
    }


def with_pending(known: Bounds, pending: Buckets) -> Bounds:
    """The bounds with points past the mark added, given as buckets (of any level): they were stored after
    every point in the rows, so on a rank's equal last step theirs is the last value."""
    lo, hi, points, last = known.lo, known.hi, known.points, dict(known.last)
    for (_, _, rank, _), v in pending.items():
        points += v[0]
        lo = min(lo, v[4])
        hi = max(hi, v[5])
        if rank not in last or v[5] >= last[rank][0]:
            last[rank] = (v[5], v[6])
    return Bounds(lo, hi, points, last, known.past_mark)


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
