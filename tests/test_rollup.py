"""The metric rollup (metrics/rollup.py): folded behind ingestion up to a per-job mark, and the series the
charts read from it with the points past the mark folded in."""

from __future__ import annotations

import importlib
import math
import sys
import threading
from collections.abc import Iterator, Sequence
from datetime import timedelta
from types import SimpleNamespace
from urllib.parse import quote

import pytest
from django.apps import apps as django_apps
from django.contrib.auth.models import User
from django.db import connection, transaction
from django.db.models import Max
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from cluster.models import Node
from jobs import lifecycle
from jobs.models import Checkpoint, Job, Rank
from metrics import rollup
from metrics.ingest import Sample, save_points
from metrics.models import MetricPoint, MetricRollup, RollupMark
from metrics.series import _bucketed, metric_names, series

from .jobrows import update_jobs

STEPS = 3000
START = timezone.now() - timedelta(hours=1)  # step s is stored as logged at START + s seconds
BUCKETS = 50  # 3000 steps / 50 -> level 5 (94 buckets of 32 steps); level 6 would give 47


def make_job(name: str = "rollup-job") -> Job:
    return Job.objects.create(name=name, script="train.py")


def loss(rank: int, step: int) -> float:
    if rank == 1 and step == 1717:
        return 50.0  # a one-step spike
    if rank == 0 and step == 2222:
        return -50.0  # a one-step dip
    return 2.0 + math.exp(-step / 700) + 0.05 * math.sin(step * 0.37 + rank)


def ingest(
    job: Job, steps, ranks=(0, 1), name: str = "loss", chunk: int = 700, attempt: int = 1, value=loss,
    fold_every: int | None = 1,
):  # fmt: skip
    """Points as the follower stores them: batches of Samples through save_points, ranks interleaved, the
    rollup caught up after every `fold_every` batches and after the last (None: never, they stay pending)."""
    start = START
    rows = [
        Sample(job.pk, r, s, name, value(r, s), start + timedelta(seconds=s), attempt) for s in steps for r in ranks
    ]
    batches = range(0, len(rows), chunk)
    for n, i in enumerate(batches, 1):
        with transaction.atomic():
            save_points(rows[i : i + chunk])
        if fold_every is not None and (n % fold_every == 0 or n == len(batches)):
            rollup.catch_up(job.pk)


def table(job: Job) -> list[tuple]:
    fields = ("name", "level", "rank", "bucket", "n", "v_min", "v_max", "v_sum", "first_step", "last_step",
              "last_value", "t_min", "t_max")  # fmt: skip
    rows = MetricRollup.objects.filter(job=job).order_by("name", "level", "rank", "bucket").values_list(*fields)
    return [(*r[:7], round(r[7], 6), *r[8:]) for r in rows]


def assert_same_series(got: dict, want: dict) -> None:
    """Equal answers: every drawn point exactly, the means up to the order their sums were added in."""
    assert {k: v for k, v in got.items() if k != "mean"} == {k: v for k, v in want.items() if k != "mean"}
    assert got["mean"]["x"] == want["mean"]["x"]
    assert got["mean"]["y"] == pytest.approx(want["mean"]["y"], rel=1e-12)


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

    # when the whole series is asked, all of it folded: two queries (the bounds and where the points past the
    # mark lie, one level's rows), whatever was stored
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

    # when live points arrive after the page loaded (the follower's next batches), not yet folded
    ingest(job, range(2000, STEPS), chunk=97, fold_every=None)
    later = series(job.pk, "loss", buckets=BUCKETS)
    # then the next answer has them, up to the new last step, and counts them
    assert later["total_points"] == 2 * STEPS
    assert later["ranks"]["0"]["x"][-1] == STEPS - 1 and later["ranks"]["0"]["y"][-1] == loss(0, STEPS - 1)
    # and once folded, the rollup built batch by batch is the one a rebuild from the points makes
    assert rollup.catch_up(job.pk) == 2 * (STEPS - 2000)
    assert_same_series(series(job.pk, "loss", buckets=BUCKETS), later)
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


@pytest.mark.django_db
def test_the_panels_endpoint_answers_every_metric_as_series_does_in_the_same_queries_for_2_or_6(
    django_assert_num_queries,
):
    user = User.objects.create_user("alice", password="pw-alice-123")
    client = Client()
    client.force_login(user)
    two, six = make_job("two"), make_job("six")
    for job, names in ((two, ["loss", "lr"]), (six, ["loss", "lr", "eval/loss", "grad_norm", "a", "b"])):
        for i, name in enumerate(names):
            # steps of each metric differ (so levels may too), all past 4 x BUCKETS: read from the rollup
            ingest(job, range(STEPS + 500 * i), name=name, value=lambda r, s, i=i: loss(r, s) + i)
    # points past the mark (of one metric of two, of two of six): folded in on read
    ingest(two, range(STEPS + 500, STEPS + 520), name="lr", fold_every=None)
    ingest(six, range(STEPS + 2500, STEPS + 2600), name="b", fold_every=None)
    ingest(six, range(STEPS, STEPS + 40), ranks=(2,), name="lr", fold_every=None)
    client.get(f"/api/jobs/{two.pk}/panels?buckets={BUCKETS}")  # the session is loaded once
    counts = []
    for job in (two, six):
        names = metric_names(job.pk)
        with CaptureQueriesContext(connection) as queries:
            got = client.get(f"/api/jobs/{job.pk}/panels?buckets={BUCKETS}").json()
        counts.append(len(queries))
        assert list(got["series"]) == names and got["job"] == job.pk
        for name in names:  # each one as the one-metric answer has it
            assert_same_series(got["series"][name], series(job.pk, name, buckets=BUCKETS))
        # asked by name, in the page's order: the same, in that order
        query = "&".join(f"name={quote(n)}" for n in reversed(names))
        again = client.get(f"/api/jobs/{job.pk}/panels?buckets={BUCKETS}&{query}").json()["series"]
        assert list(again) == names[::-1] and again == got["series"]
    # one read of every metric, not one per metric: six metrics cost what two do, plus the name lookups
    # (metric_names' index seeks, one per name and one to find the end)
    assert counts[1] - counts[0] == 4, counts
    assert got["series"]["b"]["ranks"]["0"]["x"][-1] == STEPS + 2599
    assert got["series"]["lr"]["ranks"]["2"]["x"][-1] == STEPS + 39
    # ranks=first (what a chart shows until all ranks are asked for): each metric's lowest rank alone, the
    # same line as in the whole answer, the whole metric's point count
    first = client.get(f"/api/jobs/{six.pk}/panels?buckets={BUCKETS}&ranks=first").json()["series"]
    for name, whole in got["series"].items():
        assert first[name]["only_rank"] == 0 and list(first[name]["ranks"]) == ["0"]
        assert first[name]["ranks"]["0"] == whole["ranks"]["0"]
        assert first[name]["total_points"] == whole["total_points"]
    later = make_job("later-ranks")
    ingest(later, range(STEPS), ranks=(1, 2))
    ingest(later, range(STEPS, STEPS + 30), ranks=(2,), fold_every=None)
    got = client.get(f"/api/jobs/{later.pk}/panels?buckets={BUCKETS}&ranks=first").json()["series"]["loss"]
    assert got["only_rank"] == 1 and list(got["ranks"]) == ["1"]
    assert got["ranks"]["1"] == series(later.pk, "loss", buckets=BUCKETS)["ranks"]["1"]
    # what no job logged is simply absent; a bad bucket count is one clear error
    assert client.get(f"/api/jobs/{two.pk}/panels?name=nope").json()["series"] == {"nope": {
        "name": "nope", "ranks": {}, "mean": {"x": [], "y": []}, "total_points": 0}}  # fmt: skip
    bad = client.get(f"/api/jobs/{two.pk}/panels?buckets=x")
    assert bad.status_code == 400 and bad.json() == {"error": "buckets and rank must be integers"}


# -- folding behind ingestion: the mark --------------------------------------------------------------


def mark(job: Job) -> int | None:
    return RollupMark.objects.filter(job=job).values_list("upto", flat=True).first()


def last_id(job: Job) -> int:
    return MetricPoint.objects.filter(job=job).aggregate(top=Max("id"))["top"]


def in_a_thread(fn, *args):
    """fn(*args) on a thread of its own (its own database connection); a handle whose join() gives the result."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # handed to the test thread
            out["error"] = exc
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()

    def join(timeout: float = 60.0):
        thread.join(timeout)
        assert not thread.is_alive(), f"{fn.__name__} still running after {timeout} s"
        if "error" in out:
            raise out["error"]
        return out["value"]

    join.thread = thread
    return join


@pytest.mark.django_db
def test_points_are_stored_without_the_rollup_and_catch_up_folds_each_one_once():
    job, other = make_job(), make_job("other")
    # the follower's batches for two jobs, interleaved: ids of one job run through the other's
    for start in range(0, 1000, 100):
        ingest(job, range(start, start + 100), fold_every=None)
        ingest(other, range(start, start + 100), ranks=(0,), fold_every=None)
    assert not MetricRollup.objects.exists() and not RollupMark.objects.exists()

    # when the rollup catches up, then every point of the job is folded, and only the job's
    assert rollup.catch_up(job.pk) == 2000
    assert mark(job) == last_id(job) and mark(other) is None
    folded = table(job)
    assert sum(r[4] for r in folded if r[1] == rollup.TOP) == 2000
    # and a second catch_up folds nothing more: the same rows
    assert rollup.catch_up(job.pk) == 0
    assert table(job) == folded
    # new points are folded once, on top
    ingest(job, range(1000, 1100), fold_every=None)
    assert rollup.catch_up(job.pk) == 200 and rollup.catch_up(job.pk) == 0
    assert mark(job) == last_id(job)
    caught_up = table(job)
    rollup.rebuild(job.pk)
    assert table(job) == caught_up and mark(job) == last_id(job)


@pytest.mark.django_db(transaction=True)
def test_two_catch_ups_at_once_never_fold_a_point_twice():
    job = make_job()
    ingest(job, range(500), fold_every=None)
    for more in (None, range(500, 700)):  # the first time the job has no mark yet: both try to make it
        if more is not None:
            ingest(job, more, fold_every=None)
        pending = MetricPoint.objects.filter(job=job, id__gt=mark(job) or 0).count()
        # given a catch_up that has folded but not committed yet
        with transaction.atomic():
            assert rollup.catch_up(job.pk) == pending
            # when a second one starts meanwhile (another connection), then it waits for the mark
            second = in_a_thread(rollup.catch_up, job.pk)
            second.thread.join(1.0)
            assert second.thread.is_alive()
        # and once the first committed, it finds nothing left to fold
        assert second() == 0
        assert mark(job) == last_id(job)
    folded = table(job)
    rollup.rebuild(job.pk)
    assert table(job) == folded


@pytest.mark.django_db(transaction=True)
def test_catch_ups_racing_each_other_and_the_writer_count_every_point_once():
    job = make_job()
    start = timezone.now()
    stop = threading.Event()

    def write() -> int:
        for b in range(30):
            with transaction.atomic():
                # the lock the follower's lease renewal takes on the job's row before it stores points
                Job.objects.select_for_update(no_key=True).get(pk=job.pk)
                save_points([Sample(job.pk, r, b * 20 + s, "loss", loss(r, b * 20 + s), start, 1)
                             for s in range(20) for r in (0, 1)])  # fmt: skip
        return 30 * 40

    def fold() -> int:
        folded = 0
        while not stop.is_set():
            folded += rollup.catch_up(job.pk)
        return folded

    folders = [in_a_thread(fold), in_a_thread(fold)]
    written = in_a_thread(write)()
    stop.set()
    folded = sum(f() for f in folders) + rollup.catch_up(job.pk)
    assert folded == written == MetricPoint.objects.filter(job=job).count()
    assert mark(job) == last_id(job)
    caught_up = table(job)
    rollup.rebuild(job.pk)
    assert table(job) == caught_up


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("buckets", "rank"),
    [(50, None), (40, None), (50, 1), (2000, None)],  # between stored levels, a stored one, one rank, raw points
)
def test_a_series_with_points_past_the_mark_equals_the_one_read_after_catch_up(
    django_assert_num_queries, buckets, rank
):
    job = make_job()
    ingest(job, range(2000))  # folded
    # past the mark: the curve goes on, a new rank shows up, a folded step is logged again (a new minimum),
    # and the last step is logged twice (the later value is the last point)
    ingest(job, range(2000, STEPS), fold_every=None)
    ingest(job, range(0, STEPS, 7), ranks=(2,), fold_every=None, value=lambda r, s: 1.5 + s / 1e4)
    ingest(job, [1999], ranks=(0,), fold_every=None, value=lambda r, s: -7.0)
    ingest(job, [STEPS - 1], ranks=(1,), fold_every=None, value=lambda r, s: 4.25)
    pending = MetricPoint.objects.filter(job=job, id__gt=mark(job)).count()
    assert pending > 0

    # when the whole series is read before the rollup caught up: three queries (the bounds and where the
    # points past the mark lie, those points, one level's rows)
    with django_assert_num_queries(3):
        before = series(job.pk, "loss", rank=rank, buckets=buckets, with_time=True)
    assert rollup.catch_up(job.pk) == pending
    after = series(job.pk, "loss", rank=rank, buckets=buckets, with_time=True)

    # then it shows every stored point, as the answer after the fold does
    assert_same_series(before, after)
    assert before["total_points"] == (2 * STEPS + len(range(0, STEPS, 7)) + 2 if rank is None else STEPS + 1)
    assert (before["ranks"]["1"]["x"][-1], before["ranks"]["1"]["y"][-1]) == (STEPS - 1, 4.25)
    if rank is None:
        assert -7.0 in before["ranks"]["0"]["y"]
        assert before["ranks"]["2"]["x"][-1] == STEPS - 1 - (STEPS - 1) % 7


def fold_in_python(job_id: int, first: int, last: int) -> int:
    """rollup._fold_in_sql's result the slow way: fold_points and upsert over the points read in chunks.
    The points folded."""
    rows = MetricPoint.objects.filter(
        job_id=job_id, id__gte=first, id__lte=last, superseded=False, step__isnull=False
    ).order_by("id")
    folded = 0

    def counted() -> Iterator[Sequence]:
        nonlocal folded
        for row in rows.values_list("job_id", "rank", "step", "name", "value", "time").iterator(chunk_size=20000):
            folded += 1
            yield row

    rollup.upsert(rollup.fold_into_levels(counted()))
    return folded


@pytest.mark.django_db
def test_the_fold_in_sql_equals_the_fold_in_python(monkeypatch):
    in_sql, in_python = make_job("in-sql"), make_job("in-python")

    def store(steps, value, ranks=(0, 1)):
        for job in (in_sql, in_python):
            ingest(job, steps, ranks=ranks, fold_every=None, value=value, chunk=50)

    def catch_up_both() -> None:
        assert rollup.catch_up(in_sql.pk) > 0
        with monkeypatch.context() as m:
            m.setattr(rollup, "_fold_in_sql", fold_in_python)
            assert rollup.catch_up(in_python.pk) > 0

    store(range(100), loss)
    store([40, 40, 99], lambda r, s: 10.0 * r + s)  # steps again, one of them twice in a batch
    catch_up_both()
    # folded onto stored buckets: an equal last step (the new value wins), a step inside, new steps
    store([99, 57], lambda r, s: -1.0 - r)
    store(range(100, 300), lambda r, s: math.cos(s))
    store([299], lambda r, s: 3.5, ranks=(1,))
    catch_up_both()
    assert table(in_sql) == table(in_python)
    last = {row[2]: row[10] for row in table(in_sql) if row[1] == rollup.TOP}
    assert last == {0: math.cos(299), 1: 3.5}


@pytest.mark.django_db
def test_a_cut_with_points_past_the_mark_equals_a_rebuild():
    job = make_job()
    ingest(job, range(2000))  # folded
    ingest(job, range(2000, STEPS), fold_every=None)  # past the mark, some of them before the cut too
    ingest(job, range(1200, 1300), fold_every=None, value=lambda r, s: 0.5)
    # when a resume from step 1500 supersedes what follows it and cuts the rollup there
    MetricPoint.objects.filter(job=job, step__gt=1500).update(superseded=True)
    rollup.cut(job.pk, 1500)
    # then the rollup holds every point on the curve once, up to the job's last point
    assert mark(job) == last_id(job)
    cut = table(job)
    rollup.rebuild(job.pk)
    assert table(job) == cut
    assert sum(r[4] for r in cut if r[1] == rollup.TOP) == 2 * 1501 + 200
    assert rollup.catch_up(job.pk) == 0
    # and a cut of everything leaves no row and nothing to fold
    ingest(job, range(1501, 1600), attempt=2, fold_every=None)
    MetricPoint.objects.filter(job=job).update(superseded=True)
    rollup.cut(job.pk, None)
    assert table(job) == [] and mark(job) == last_id(job)


@pytest.mark.django_db
def test_a_job_without_a_mark_reads_its_raw_points_and_gets_one_when_first_folded():
    job = make_job()
    ingest(job, range(STEPS), fold_every=None)  # as a job whose points came before any fold
    assert mark(job) is None
    # the series comes from the raw points, every one of them counted
    raw = series(job.pk, "loss", buckets=BUCKETS)
    assert raw["total_points"] == 2 * STEPS and raw["ranks"]["0"]["x"][-1] == STEPS - 1
    # the first catch_up makes the mark and folds everything: the rollup a rebuild makes
    assert rollup.catch_up(job.pk) == 2 * STEPS and mark(job) == last_id(job)
    folded = table(job)
    rollup.rebuild(job.pk)
    assert table(job) == folded
    assert series(job.pk, "loss", buckets=BUCKETS)["total_points"] == 2 * STEPS
    # a cut and a rebuild make the mark of a job that has none
    cut, rebuilt = make_job("cut"), make_job("rebuilt")
    for other in (cut, rebuilt):
        ingest(other, range(100), fold_every=None)
    rollup.cut(cut.pk, 49)
    rollup.rebuild(rebuilt.pk)
    assert (mark(cut), mark(rebuilt)) == (last_id(cut), last_id(rebuilt))
    # and a job that is gone is left alone
    assert rollup.catch_up(10**9) == 0


@pytest.mark.django_db
def test_the_migration_marks_every_job_with_points_as_folded():
    migration = importlib.import_module("metrics.migrations.0006_rollup_mark")
    job, empty = make_job(), make_job("empty")
    ingest(job, range(100))
    RollupMark.objects.all().delete()
    migration.mark_folded(django_apps, SimpleNamespace(connection=connection))
    assert mark(job) == last_id(job) and mark(empty) is None


@pytest.mark.django_db(transaction=True)
def test_a_catch_up_committing_while_a_series_is_read_counts_nothing_twice():
    job = make_job()
    ingest(job, range(2000))
    ingest(job, range(2000, STEPS), fold_every=None, value=lambda r, s: 100.0 + s)  # past the mark
    folded_midway = []

    def fold_after_the_bounds(execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        if not folded_midway and "metrics_metricrollup" in sql:
            folded_midway.append(in_a_thread(rollup.catch_up, job.pk)())
        return result

    # when the points past the mark are folded (and committed) right after the series read its bounds
    with connection.execute_wrapper(fold_after_the_bounds):
        got = series(job.pk, "loss", buckets=BUCKETS)
    assert folded_midway == [2 * (STEPS - 2000)] and mark(job) == last_id(job)
    # then the answer is the one read before the fold (one snapshot), which is the one read after it
    assert got["total_points"] == 2 * STEPS
    assert_same_series(got, series(job.pk, "loss", buckets=BUCKETS))


@pytest.mark.django_db(transaction=True)
def test_a_catch_up_during_a_resume_waits_for_it_without_a_deadlock():
    job = make_job()
    ingest(job, range(1000))
    ingest(job, range(1000, 2000), fold_every=None)
    with transaction.atomic():
        # given a resume holding the job's row (requeue locks it before it supersedes points and cuts)
        Job.objects.select_for_update().get(pk=job.pk)
        MetricPoint.objects.filter(job=job, step__gt=1500).update(superseded=True)
        # when the follower's catch_up starts meanwhile, then it waits
        folding = in_a_thread(rollup.catch_up, job.pk)
        folding.thread.join(1.0)
        assert folding.thread.is_alive()
        rollup.cut(job.pk, 1500)
    # and once the resume committed it finds the points folded by the cut (no deadlock either way round)
    assert folding() == 0
    assert mark(job) == last_id(job)
    cut = table(job)
    rollup.rebuild(job.pk)
    assert table(job) == cut


@pytest.mark.django_db
def test_the_reconciler_folds_what_a_killed_follower_left_of_a_recently_ended_job():
    from jobs.reconcile import reconcile

    # given two ended jobs whose followers died before their last fold: one just ended, one long ago
    recent, old = make_job("ended-now"), make_job("ended-long-ago")
    for job, ended in ((recent, timezone.now()), (old, timezone.now() - timedelta(hours=2))):
        update_jobs(Job.objects.filter(pk=job.pk), state=Job.State.SUCCEEDED, finished_at=ended)
        ingest(job, range(1, 201), fold_every=None)
    # when the reconciler passes
    report = reconcile([recent.pk, old.pk], orphans=False)
    # then the recent one's points are folded, each once; the old one is left to the charts' own fold
    assert report.folded == ["ended-now"]
    assert RollupMark.objects.get(job=recent).upto == MetricPoint.objects.filter(job=recent).latest("id").id
    assert MetricRollup.objects.get(job=recent, level=rollup.TOP, rank=0).n == 200
    assert not RollupMark.objects.filter(job=old).exists()
    # and a second pass finds nothing left
    assert reconcile([recent.pk, old.pk], orphans=False).folded == []
