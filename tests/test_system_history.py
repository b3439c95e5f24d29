"""System metrics history (cluster.history) and its endpoints; the compare page's metric choice and
config diff, through Django's test client."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from cluster.history import history
from cluster.models import HealthSample, Node
from jobs.models import Job, Rank
from metrics.models import MetricPoint

pytestmark = pytest.mark.django_db


@pytest.fixture
def browser():
    client = Client()
    client.force_login(User.objects.create_user("alice", password="pw-alice-123"))
    return client


@pytest.fixture
def node():
    return Node.objects.create(name="gpu1", address="127.0.0.3", gpu_count=2)


def gpu(index: int, util: float) -> dict:
    return {"index": index, "util_percent": util, "mem_used_mb": 1000.0 * (index + 1), "temp_c": 50.0, "power_w": 100.0}


def test_history_averages_each_gpu_into_time_buckets(node):
    # given four raw samples over 40 minutes, GPU 0 and GPU 1 each
    end = timezone.now()
    start = end - timedelta(minutes=40)
    for i, util in enumerate([10, 30, 50, 70]):
        HealthSample.objects.create(node=node, time=start + timedelta(minutes=10 * i + 1), cpu_percent=util,
                                    ram_percent=40, gpus=[gpu(0, util), gpu(1, 100 - util)])  # fmt: skip
    # when cut into two buckets
    data = history([node], start, end, buckets=2)
    by_name = {m["name"]: m for m in data["metrics"]}
    # then each bucket holds the mean of its samples, per GPU, at the bucket's middle
    assert by_name["gpu_util"]["lines"]["gpu1 GPU 0"]["y"] == [20.0, 60.0]
    assert by_name["gpu_util"]["lines"]["gpu1 GPU 1"]["y"] == [80.0, 40.0]
    assert by_name["gpu_util"]["lines"]["gpu1 GPU 0"]["t"] == [
        round(start.timestamp() + 600, 3),
        round(start.timestamp() + 1800, 3),
    ]
    assert by_name["cpu"]["lines"]["gpu1"]["y"] == [20.0, 60.0]
    assert by_name["gpu_power"]["unit"] == "W" and data["kind"] == "raw"
    # and a job's GPUs only, when it names them
    only0 = history([node], start, end, buckets=2, gpus={node.pk: {0}})
    assert list(next(m for m in only0["metrics"] if m["name"] == "gpu_mem")["lines"]) == ["gpu1 GPU 0"]


def test_history_falls_back_on_minute_aggregates_and_skips_failed_probes(node):
    end = timezone.now()
    start = end - timedelta(hours=30)
    HealthSample.objects.create(node=node, time=start + timedelta(hours=1), kind=HealthSample.Kind.MINUTE,
                                gpu_util_percent=42.0, cpu_percent=12.0, samples=6)  # fmt: skip
    HealthSample.objects.create(node=node, time=start + timedelta(hours=2), ok=False, error="timeout", cpu_percent=99)
    data = history([node], start, start + timedelta(hours=3), buckets=3)
    by_name = {m["name"]: m for m in data["metrics"]}
    assert data["kind"] == "minute"
    assert by_name["gpu_util"]["lines"] == {"gpu1 GPUs": {"t": [pytest.approx(start.timestamp() + 5400)], "y": [42.0]}}
    assert by_name["cpu"]["lines"]["gpu1"]["y"] == [12.0]


def test_history_refuses_a_bad_window(node):
    now = timezone.now()
    with pytest.raises(ValueError, match="end after it starts"):
        history([node], now, now)
    with pytest.raises(ValueError, match="buckets"):
        history([node], now - timedelta(hours=1), now, buckets=0)


def test_node_history_endpoint_and_its_bad_input(browser, node):
    HealthSample.objects.create(node=node, time=timezone.now() - timedelta(minutes=5), gpus=[gpu(0, 55)])
    data = browser.get("/api/nodes/gpu1/history?hours=1&buckets=10").json()
    assert data["node"] == "gpu1"
    assert next(m for m in data["metrics"] if m["name"] == "gpu_util")["lines"]["gpu1 GPU 0"]["y"] == [55.0]
    for bad in ("hours=0", "hours=abc", "buckets=0", "hours=100000"):
        response = browser.get(f"/api/nodes/gpu1/history?{bad}")
        assert response.status_code == 400 and "hours must be" in response.json()["error"], bad
    assert browser.get("/api/nodes/nope/history").status_code == 404


def test_job_system_endpoint_covers_the_jobs_span_and_gpus(browser, node):
    now = timezone.now()
    span = {"running_at": now - timedelta(minutes=30), "finished_at": now - timedelta(minutes=10)}
    job = Job.objects.create(name="j", script="s.py", state=Job.State.SUCCEEDED, nproc_per_node=1, **span)
    Rank.objects.create(job=job, node=node, index=0, active=False)
    HealthSample.objects.create(node=node, time=now - timedelta(minutes=20), gpus=[gpu(0, 90), gpu(1, 5)])
    HealthSample.objects.create(node=node, time=now - timedelta(minutes=5), gpus=[gpu(0, 1), gpu(1, 1)])  # after it
    data = browser.get(f"/api/jobs/{job.pk}/system").json()
    util = next(m for m in data["metrics"] if m["name"] == "gpu_util")["lines"]
    assert util == {"gpu1 GPU 0": {"t": [pytest.approx((now - timedelta(minutes=20)).timestamp(), abs=3)], "y": [90.0]}}
    queued = Job.objects.create(name="q", script="s.py")
    assert browser.get(f"/api/jobs/{queued.pk}/system").json()["metrics"] == []


def test_node_page_shows_the_node_and_its_recent_jobs(browser, node):
    job = Job.objects.create(name="on-gpu1", script="s.py", state=Job.State.SUCCEEDED)
    Rank.objects.create(job=job, node=node, index=0, active=False)
    html = browser.get("/nodes/gpu1/").content.decode()
    assert 'id="system"' in html and "/api/nodes/gpu1/history?hours=24" in html
    assert f'href="/jobs/{job.pk}/"' in html
    assert browser.get("/nodes/nope/").status_code == 404


def test_compare_any_metric_with_final_best_and_a_config_diff(browser, node):
    now = timezone.now()
    a = Job.objects.create(name="a", script="s.py", params={"lr": 0.1, "model": "m"}, script_args=["--x", "1"])
    b = Job.objects.create(name="b", script="s.py", params={"lr": 0.2, "model": "m"}, script_args=["--x", "1"])
    for job, values in ((a, [0.5, 0.7, 0.6]), (b, [0.4, 0.9, 0.8])):
        MetricPoint.objects.bulk_create(
            MetricPoint(job=job, rank=0, step=s, name="eval/acc", value=v, time=now) for s, v in enumerate(values)
        )
        MetricPoint.objects.create(job=job, rank=0, step=1, name="loss", value=1.0, time=now)
    html = browser.get(f"/compare/?job={a.pk}&job={b.pk}&metric=eval/acc").content.decode()
    # final = rank 0's last value; best = the highest for a metric that is no loss
    assert '<td class="num">0.6</td><td class="num">0.7</td>' in html
    assert '<td class="num">0.8</td><td class="num">0.9</td>' in html
    assert '<tr class="differs"><th scope="row">lr</th>' in html
    assert '<tr class="same"><th scope="row">model</th>' in html
    assert '<tr class="same"><th scope="row">args</th>' in html
    # an unknown metric falls back on the loss
    assert 'data-metric="loss"' in browser.get(f"/compare/?job={a.pk}&metric=nope").content.decode()
