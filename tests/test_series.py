"""Tests of metrics.series.series(): raw points for short histories, SQL buckets for long ones."""

from __future__ import annotations

import math

import pytest
from django.utils import timezone

from jobs.models import Job
from metrics.ingest import Sample, save_points
from metrics.models import MetricPoint
from metrics.series import series

pytestmark = pytest.mark.django_db


def make_job(name: str = "series-job") -> Job:
    return Job.objects.create(name=name, script="train/train_production.py")


def add_points(job: Job, rows: list[tuple[int, int, float]], name: str = "loss") -> None:
    """rows: (rank, step, value)."""
    now = timezone.now()
    MetricPoint.objects.bulk_create(
        [MetricPoint(job=job, rank=r, step=s, name=name, value=v, time=now) for r, s, v in rows],
        batch_size=5000,
    )


def add_many_points(job: Job, rows: list[tuple[int, int, float]], name: str = "loss") -> None:
    """add_points for hundreds of thousands of rows: through the follower's own COPY (save_points), which
    takes 200k rows in about a second where an executemany of INSERTs took 15 s."""
    now = timezone.now()
    save_points([Sample(job.pk, r, s, name, v, now) for r, s, v in rows])


def test_small_history_is_exact() -> None:
    job = make_job()
    add_points(job, [(0, 1, 4.0), (0, 2, 3.0), (0, 3, 2.0), (1, 1, 6.0), (1, 3, 4.0)])
    # Noise that must not leak in: another metric, another job.
    add_points(job, [(0, 1, 0.1), (1, 1, 0.2)], name="lr")
    add_points(make_job("other-job"), [(0, 1, 99.0)])

    assert series(job.pk, "loss") == {
        "name": "loss",
        "ranks": {"0": {"x": [1, 2, 3], "y": [4.0, 3.0, 2.0]}, "1": {"x": [1, 3], "y": [6.0, 4.0]}},
        "mean": {"x": [1, 2, 3], "y": [5.0, 3.0, 3.0]},
        "total_points": 5,
    }


def test_small_history_filters() -> None:
    job = make_job()
    add_points(job, [(0, 1, 4.0), (0, 2, 3.0), (0, 3, 2.0), (1, 1, 6.0), (1, 3, 4.0)])

    assert series(job.pk, "loss", rank=1) == {
        "name": "loss",
        "ranks": {"1": {"x": [1, 3], "y": [6.0, 4.0]}},
        "mean": {"x": [1, 3], "y": [6.0, 4.0]},
        "total_points": 2,
    }
    windowed = series(job.pk, "loss", step_min=2, step_max=3)
    assert windowed["ranks"] == {"0": {"x": [2, 3], "y": [3.0, 2.0]}, "1": {"x": [3], "y": [4.0]}}
    assert windowed["total_points"] == 3


def test_no_points() -> None:
    job = make_job()
    assert series(job.pk, "loss") == {
        "name": "loss",
        "ranks": {},
        "mean": {"x": [], "y": []},
        "total_points": 0,
    }


def test_ranks_sort_numerically() -> None:
    job = make_job()
    add_points(job, [(10, 1, 1.0), (2, 1, 2.0), (0, 1, 3.0)])
    assert list(series(job.pk, "loss")["ranks"]) == ["0", "2", "10"]


def test_bucketed_path_is_exact_on_a_small_case() -> None:
    job = make_job()
    values = [5.0, 1.0, 9.0, 3.0, 4.0, 8.0, 2.0, 7.0, 6.0, 0.0, 3.0, 3.5]
    add_points(job, [(0, step, v) for step, v in enumerate(values)])
    add_points(job, [(1, step, 10.0) for step in range(12)])
    # 24 points > 4 * 2 buckets: steps 0..11 in two buckets of width 6 (starts 0 and 6, middles 3 and 9),
    # then each rank's exact last point (step 11).
    result = series(job.pk, "loss", buckets=2)
    assert result["total_points"] == 24
    assert result["ranks"] == {
        "0": {"x": [0, 3, 6, 9, 11], "y": [1.0, 9.0, 0.0, 7.0, 3.5]},
        "1": {"x": [0, 3, 6, 9, 11], "y": [10.0, 10.0, 10.0, 10.0, 10.0]},
    }
    mean_0 = (sum(values[:6]) / 6 + 10.0) / 2
    mean_1 = (sum(values[6:]) / 6 + 10.0) / 2
    assert result["mean"]["x"] == [3, 9]
    assert result["mean"]["y"] == pytest.approx([mean_0, mean_1])


def test_large_history_is_bucketed_in_sql() -> None:
    job = make_job()
    steps = 100_000
    spike_step, dip_step = 54_321, 77_777

    def loss(rank: int, step: int) -> float:
        if rank == 1 and step == spike_step:
            return 1000.0
        if rank == 0 and step == dip_step:
            return -1000.0
        return 2.0 + 3.0 * math.exp(-step / 20_000) + 0.01 * rank

    add_many_points(job, [(r, s, loss(r, s)) for r in (0, 1) for s in range(1, steps + 1)])
    buckets = 1000

    result = series(job.pk, "loss", buckets=buckets)

    assert result["total_points"] == 2 * steps
    assert set(result["ranks"]) == {"0", "1"}
    width = steps // buckets
    for xy in result["ranks"].values():
        assert len(xy["x"]) == len(xy["y"]) <= 2 * buckets + 2
        assert all(a < b for a, b in zip(xy["x"], xy["x"][1:], strict=False))
        assert xy["x"][0] == 1
        assert xy["x"][-1] <= steps
    # The spike's max survives, placed at the middle of its bucket.
    rank1 = result["ranks"]["1"]
    assert max(rank1["y"]) == 1000.0
    spike_x = rank1["x"][rank1["y"].index(1000.0)]
    assert spike_x - width < spike_step < spike_x + width
    # The dip's min survives, placed at the start of its bucket.
    rank0 = result["ranks"]["0"]
    assert min(rank0["y"]) == -1000.0
    dip_x = rank0["x"][rank0["y"].index(-1000.0)]
    assert dip_x <= dip_step < dip_x + width
    # The mean: one point per bucket, close to the curve away from the spikes.
    mean = result["mean"]
    assert len(mean["x"]) == len(mean["y"]) <= buckets
    assert mean["y"][0] == pytest.approx(5.0, abs=0.05)
    assert mean["y"][-1] == pytest.approx(2.0 + 3.0 * math.exp(-5), abs=0.01)

    one_rank = series(job.pk, "loss", rank=1, buckets=buckets)
    assert one_rank["total_points"] == steps
    assert list(one_rank["ranks"]) == ["1"]
    assert one_rank["ranks"]["1"] == rank1

    # A zoomed window small enough to come back raw.
    window = series(job.pk, "loss", buckets=buckets, step_min=spike_step - 10, step_max=spike_step + 10)
    assert window["total_points"] == 42
    assert window["ranks"]["1"]["x"] == list(range(spike_step - 10, spike_step + 11))
    assert window["ranks"]["1"]["y"][10] == 1000.0


def test_times_come_aligned_with_steps_raw_and_bucketed() -> None:
    from datetime import timedelta

    job = make_job()
    start = timezone.now()
    MetricPoint.objects.bulk_create(
        MetricPoint(job=job, rank=r, step=s, name="loss", value=1.0 / s, time=start + timedelta(seconds=s))
        for r in (0, 1)
        for s in range(1, 401)
    )
    # raw: one time per point, the point's own
    raw = series(job.pk, "loss", buckets=1000, with_time=True)
    assert raw["times"]["0"][:2] == [round((start + timedelta(seconds=s)).timestamp(), 3) for s in (1, 2)]
    # bucketed: a bucket's first and last times beside its two points, never going back
    bucketed = series(job.pk, "loss", buckets=10, with_time=True)
    for rank, xy in bucketed["ranks"].items():
        times = bucketed["times"][rank]
        assert len(times) == len(xy["x"]) and times == sorted(times)
        assert times[0] == round((start + timedelta(seconds=1)).timestamp(), 3)
    assert "times" not in series(job.pk, "loss")
