"""The metric rollup kept at ingestion (metrics/rollup.py) and the series the charts read from it."""

from __future__ import annotations

import math
import sys
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from cluster.models import Node
from jobs import lifecycle
from jobs.models import Checkpoint, Job, Rank
from metrics import rollup
from metrics.ingest import Sample, save_points
from metrics.models import MetricPoint, MetricRollup
from metrics.series import _bucketed, series

STEPS = 3000
BUCKETS = 50  # 3000 steps / 50 -> level 5 (94 buckets of 32 steps); level 6 would give 47


def make_job(name: str = "rollup-job") -> Job:
    return Job.objects.create(name=name, script="train.py")


def loss(rank: int, step: int) -> float:
    if rank == 1 and step == 1717:
        return 50.0  # a one-step spike
    if rank == 0 and step == 2222:
        return -50.0  # a one-step dip
    return 2.0 + math.exp(-step / 700) + 0.05 * math.sin(step * 0.37 + rank)


def ingest(job: Job, steps, ranks=(0, 1), name: str = "loss", chunk: int = 700, attempt: int = 1, value=loss):
    """Points as the follower stores them: batches of Samples through save_points, ranks interleaved."""
    start = timezone.now() - timedelta(hours=1)
    rows = [
        Sample(job.pk, r, s, name, value(r, s), start + timedelta(seconds=s), attempt) for s in steps for r in ranks
    ]
    for i in range(0, len(rows), chunk):
        save_points(rows[i : i + chunk])


def table(job: Job) -> list[tuple]:
    fields = ("name", "level", "rank", "bucket", "n", "v_min", "v_max", "v_sum", "first_step", "last_step",
              "last_value", "t_min", "t_max")  # fmt: skip
    rows = MetricRollup.objects.filter(job=job).order_by("name", "level", "rank", "bucket").values_list(*fields)
    return [(*r[:7], round(r[7], 6), *r[8:]) for r in rows]


def raw_envelope(job: Job, level: int, name: str = "loss", with_time: bool = False) -> dict:
    """The same envelope grouped by the database from the raw points, on the rollup's grid."""
    times: dict | None = {} if with_time else None
    points = MetricPoint.objects.filter(job=job, name=name, superseded=False)
    ranks, mean, total = _bucketed(points, 0, 1 << level, times)
    out = {"ranks": ranks, "mean": mean, "total_points": total}
    if times is not None:
        out["times"] = {str(r): times[r] for r in sorted(times)}
    return out


@pytest.mark.django_db
@pytest.mark.parametrize(("buckets", "level"), [(50, 5), (40, 6)])  # between two stored levels; a stored one
def test_the_rollup_answer_equals_the_raw_grouping_on_a_known_series(django_assert_num_queries, buckets, level):
    job = make_job()
    ingest(job, range(STEPS))
    # a step logged twice by rank 0 at the end: the later value is the last point, as in the raw series
    ingest(job, [STEPS - 1], ranks=(0,), value=lambda r, s: 7.5)
    known = rollup.bounds(job.pk, "loss")
    assert (known.lo, known.hi, known.points) == (0, STEPS - 1, 2 * STEPS + 1)
    assert rollup.level_for(known.lo, known.hi, buckets) == level
    assert rollup.stored_level(level) == (4 if level == 5 else 6)

    # when the whole series is asked: two queries (the bounds, one level's rows), whatever was stored
    with django_assert_num_queries(2):
        got = series(job.pk, "loss", buckets=buckets, with_time=True)

    want = raw_envelope(job, level, with_time=True)
    assert got["total_points"] == want["total_points"] == 2 * STEPS + 1
    assert got["ranks"] == want["ranks"]
    assert got["times"] == want["times"]
    assert got["mean"]["x"] == want["mean"]["x"]
    assert got["mean"]["y"] == pytest.approx(want["mean"]["y"])
    # between `buckets` and twice that many buckets: two points each, and the exact last point
    for xy in got["ranks"].values():
        assert 2 * buckets <= len(xy["x"]) <= 4 * buckets + 1
        assert xy["x"] == sorted(xy["x"])
    # the spike and the dip survive; each rank ends on its last stored point
    assert max(got["ranks"]["1"]["y"]) == 50.0 and min(got["ranks"]["0"]["y"]) == -50.0
    assert (got["ranks"]["0"]["x"][-1], got["ranks"]["0"]["y"][-1]) == (STEPS - 1, 7.5)
    assert (got["ranks"]["1"]["x"][-1], got["ranks"]["1"]["y"][-1]) == (STEPS - 1, loss(1, STEPS - 1))
    # one rank alone reads the same rows
    assert series(job.pk, "loss", rank=1, buckets=buckets)["ranks"]["1"] == got["ranks"]["1"]


@pytest.mark.django_db
def test_incremental_rollup_equals_a_rebuild_and_live_appends_show(django_assert_num_queries):
    job = make_job()
    ingest(job, range(0, 2000), chunk=333)
    ingest(job, range(0, 500), name="lr", value=lambda r, s: 1e-3 * (1 - s / 500))
    first = series(job.pk, "loss", buckets=BUCKETS)
    assert first["ranks"]["0"]["x"][-1] == 1999

    # when live points arrive after the page loaded (the follower's next batches)
    ingest(job, range(2000, STEPS), chunk=97)
    later = series(job.pk, "loss", buckets=BUCKETS)
    # then the next answer has them, up to the new last step, and counts them
    assert later["total_points"] == 2 * STEPS
    assert later["ranks"]["0"]["x"][-1] == STEPS - 1 and later["ranks"]["0"]["y"][-1] == loss(0, STEPS - 1)
    # and the rollup built batch by batch is the one a rebuild from the points makes
    incremental = table(job)
    rollup.rebuild(job.pk)
    assert table(job) == incremental
    assert {r[0] for r in incremental} == {"loss", "lr"}
    assert {r[1] for r in incremental} == set(rollup.LEVELS)


@pytest.mark.django_db
def test_a_zoomed_window_and_a_short_series_come_from_the_raw_points():
    job = make_job()
    ingest(job, range(STEPS))
    # a window: the raw points, every one of them
    window = series(job.pk, "loss", buckets=BUCKETS, step_min=1710, step_max=1725)
    assert window["total_points"] == 32
    assert window["ranks"]["1"]["x"] == list(range(1710, 1726))
    assert window["ranks"]["1"]["y"][7] == 50.0
    # a window still too long for raw points: grouped from the raw points in its own range
    wide = series(job.pk, "loss", buckets=BUCKETS, step_min=1000, step_max=2999)
    assert wide["total_points"] == 4000
    assert wide["ranks"]["0"]["x"][0] == 1000 and wide["ranks"]["0"]["x"][-1] == 2999
    assert min(wide["ranks"]["0"]["y"]) == -50.0
    # a short series: every point, even though a rollup exists
    short = make_job("short")
    ingest(short, range(10), ranks=(0,))
    assert MetricRollup.objects.filter(job=short).exists()
    assert series(short.pk, "loss")["ranks"]["0"]["x"] == list(range(10))
    # a series longer than 4 x buckets but too short for the finest level's 16 steps: grouped raw
    mid = make_job("mid")
    ingest(mid, range(300), ranks=(0,))
    grouped = series(mid.pk, "loss", buckets=BUCKETS)
    assert grouped["total_points"] == 300 and len(grouped["ranks"]["0"]["x"]) <= 2 * BUCKETS + 1
    assert grouped["ranks"]["0"]["x"][-1] == 299


@pytest.mark.django_db(transaction=True)
def test_a_resume_cuts_the_rollup_where_the_next_attempt_joins(tmp_path, settings):
    settings.JOBS_DIR = tmp_path / "jobs"
    node = Node.objects.create(name="box", address="127.0.0.1", transport="local", role="master",
                               workdir=str(tmp_path / "wd"), agent_python=sys.executable)  # fmt: skip
    job = Job.objects.create(name="r1", script="train.py", tag="r1-t1", state=Job.State.FAILED,
                             failure_kind="SCRIPT_ERROR", finished_at=timezone.now())  # fmt: skip
    Rank.objects.create(job=job, node=node, index=0, state=Rank.State.EXITED, exit_code=1, active=False)
    ingest(job, range(STEPS))  # attempt 1 got to step 2999

    # when attempt 2 resumes from step 1500 and logs its own (different) curve from there
    c = Checkpoint.objects.create(job=job, node=node, path="wd/ckpt-1500", size=10, mtime=0, step=1500, ready=True)
    assert lifecycle.requeue(job, lifecycle.NextAttempt(reason="test", checkpoint=c, resume_path="ckpt-1500"))
    job.refresh_from_db()
    assert (job.attempt, job.resume_step) == (2, 1500)
    ingest(job, range(1501, 2600), attempt=2, value=lambda r, s: 1.0)

    # then the series follows attempt 1 up to 1500 and attempt 2 after it, nothing of attempt 1 past it
    got = series(job.pk, "loss", buckets=BUCKETS)
    assert got["total_points"] == 2 * 1501 + 2 * 1099
    assert got["ranks"]["1"]["x"][-1] == 2599 and got["ranks"]["1"]["y"][-1] == 1.0
    assert max(got["ranks"]["1"]["y"]) < 50.0  # attempt 1's spike at 1717 is off the curve
    assert min(got["ranks"]["0"]["y"]) > -50.0  # and so is its dip at 2222
    level = rollup.level_for(0, 2599, BUCKETS)
    want = raw_envelope(job, level)
    assert got["ranks"] == want["ranks"] and got["total_points"] == want["total_points"]
    # and the rollup cut and grown again is the one a rebuild makes
    kept = table(job)
    rollup.rebuild(job.pk)
    assert table(job) == kept


@pytest.mark.django_db
def test_the_series_endpoint_asks_the_same_few_queries_whatever_is_stored(django_assert_num_queries):
    user = User.objects.create_user("alice", password="pw-alice-123")
    client = Client()
    client.force_login(user)
    small, big = make_job("small"), make_job("big")
    ingest(small, range(STEPS))
    ingest(big, range(4 * STEPS), ranks=(0, 1, 2))
    answers = []
    for job in (small, big):
        client.get(f"/api/jobs/{job.pk}/series?name=loss&buckets={BUCKETS}")  # the session is loaded once
        # session, user and their two permission lookups (the site's policy), the job, the rollup's
        # bounds and rows, the earlier attempts
        with django_assert_num_queries(8):
            answers.append(client.get(f"/api/jobs/{job.pk}/series?name=loss&buckets={BUCKETS}").json())
    assert answers[0]["total_points"] == 2 * STEPS and answers[1]["total_points"] == 12 * STEPS
    assert answers[1]["ranks"]["2"]["x"][-1] == 4 * STEPS - 1
