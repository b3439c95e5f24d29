"""/metrics for Prometheus and the admin pages for health samples and alerts."""

from __future__ import annotations

import pytest
from django.utils import timezone

from cluster.alerts import open_alert
from cluster.models import HealthSample, Node
from jobs.models import Job

TOKEN = "s3cret-token"


@pytest.fixture
def cluster_state(db):
    """Two nodes with a probe sample each (one with a GPU), one DOWN, jobs in two states, one alert."""
    gpu = Node.objects.create(name="gpu-master", address="10.0.0.1", status="healthy", health_score=96)
    down = Node.objects.create(name="gpu1", address="10.0.0.2", status="down", health_score=0)
    HealthSample.objects.create(
        node=gpu, time=timezone.now(), score=96, cpu_percent=12.5, ram_percent=40, rtt_ms=3.2,
        gpus=[{"index": 0, "name": "RTX 5070 Ti", "util_percent": 87, "mem_used_mb": 9000, "mem_total_mb": 12227,
               "temp_c": 71, "power_w": 250.5}],
    )  # fmt: skip
    Job.objects.create(name="a", script="t.py", state=Job.State.QUEUED)
    Job.objects.create(name="b", script="t.py", state=Job.State.QUEUED)
    Job.objects.create(name="c", script="t.py", state=Job.State.RUNNING)
    open_alert(down, "down", "critical", "gpu1 is DOWN")
    return gpu, down


def test_metrics_are_off_without_a_token(client, cluster_state, settings):
    settings.UGRO_PROMETHEUS_TOKEN = ""
    assert client.get("/metrics").status_code == 404


def test_metrics_need_the_bearer_token(client, cluster_state, settings):
    settings.UGRO_PROMETHEUS_TOKEN = TOKEN
    assert client.get("/metrics").status_code == 403
    assert client.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 403


def test_metrics_expose_nodes_gpus_jobs_queue_and_alerts(client, cluster_state, settings):
    settings.UGRO_PROMETHEUS_TOKEN = TOKEN
    resp = client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert resp.status_code == 200 and resp["Content-Type"].startswith("text/plain")
    text = resp.content.decode()
    for line in (
        'ugro_node_up{node="gpu-master"} 1.0',
        'ugro_node_up{node="gpu1"} 0.0',
        'ugro_node_health_score{node="gpu-master"} 96.0',
        'ugro_node_status{node="gpu1",status="down"} 1.0',
        'ugro_node_cpu_percent{node="gpu-master"} 12.5',
        'ugro_gpu_temperature_celsius{gpu="0",name="RTX 5070 Ti",node="gpu-master"} 71.0',
        'ugro_gpu_memory_used_megabytes{gpu="0",name="RTX 5070 Ti",node="gpu-master"} 9000.0',
        'ugro_jobs{state="queued"} 2.0',
        'ugro_jobs{state="running"} 1.0',
        "ugro_queue_length 2.0",
        'ugro_alerts_open{severity="critical"} 1.0',
    ):
        assert line in text, line


def test_admin_lists_nodes_with_scores_samples_and_alerts(admin_client, cluster_state):
    resp = admin_client.get("/admin/cluster/node/")
    assert resp.status_code == 200 and b"96" in resp.content
    assert admin_client.get("/admin/cluster/healthsample/").status_code == 200
    resp = admin_client.get("/admin/cluster/alert/")
    assert resp.status_code == 200 and b"gpu1 is DOWN" in resp.content
    assert admin_client.get("/admin/cluster/alertsettings/add/").status_code == 200
